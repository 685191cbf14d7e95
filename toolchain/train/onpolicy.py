"""On-policy prompts for draft training: what the target is asked in an app, answered by the target itself.

A draft is judged on the target's greedy answers to real prompts, and a small target answers a
coding task or a chat question quite differently from how it continues the middle of a source
file. So besides stdlib windows, the head trains on the target's own answers to:

- HumanEval problems after the first `BENCH_HUMANEVAL` (the benches' `humaneval:N` prompts, N up
  to that, stay unseen), as plain-text prompts;
- chat requests built from train-split stdlib source (explain a function, document it, summarize
  its docstring), wrapped in the target's chat template (the benches' `chat:N` prompts are
  general-topic requests written for mobc and are never trained on).

Everything is real text from installed packages; nothing downloads.
"""

from __future__ import annotations

import ast
import random
import time
from typing import Any

import torch

from toolchain.bench.prompts import ChatPrompt, encode, load_prompts
from toolchain.train import corpus

BENCH_HUMANEVAL = 32  # the first 32 HumanEval problems are the benches'; training reads the rest

CHAT_TASKS = (
    "Explain what this Python function does, step by step:\n\n```python\n{src}\n```",
    "Write a short docstring and one usage example for this function:\n\n```python\n{src}\n```",
    "Summarize this documentation in plain words:\n\n{doc}",
)


def _functions(n: int, seed: int, max_chars: int = 1200) -> list[tuple[str, str]]:
    """(source, docstring) of documented, short functions from train-split stdlib files."""
    out: list[tuple[str, str]] = []
    for text in corpus.texts("train", seed):
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and (doc := ast.get_docstring(node)) and len(doc) > 80:
                src = ast.get_source_segment(text, node)
                if src and len(src) <= max_chars:
                    out.append((src, doc))
                    break  # one per file: spread over the library
        if len(out) >= n:
            break
    return out


def app_prompts(tokenizer: Any, n_chat: int, seed: int = 0) -> list[list[int]]:
    """Token ids of HumanEval prompts (plain) and stdlib chat requests (chat template), interleaved."""
    code = [encode(tokenizer, p) for p in load_prompts("humaneval")[BENCH_HUMANEVAL:]]
    chats: list[list[int]] = []
    if getattr(tokenizer, "chat_template", None):
        chats = [encode(tokenizer, ChatPrompt(CHAT_TASKS[i % len(CHAT_TASKS)].format(src=src, doc=doc)))
                 for i, (src, doc) in enumerate(_functions(n_chat, seed))]
    random.Random(seed).shuffle(code)
    mixed = [p for pair in zip(code, chats, strict=False) for p in pair]
    longer = code if len(code) > len(chats) else chats
    return mixed + longer[min(len(code), len(chats)):]


@torch.no_grad()
def prompt_continuations(teacher: Any, prompts: list[list[int]], seq_len: int, keep_prompt: int, batch: int,
                         seconds: float, pad_id: int = 0, max_prompt: int = 256) -> torch.Tensor:
    """[n, seq_len] windows: each prompt's last `keep_prompt` tokens and the target's greedy answer.

    Prompts shorter than `keep_prompt` (a window holds no padding) or longer than `max_prompt` (their
    prefill would eat the budget) are skipped; each run of 4 batches is sorted by length so a batch,
    left-padded to its longest prompt (attention mask 0 on the pads), wastes little; generation
    stops at the time budget."""
    prompts = [p for p in prompts if keep_prompt <= len(p) <= max_prompt]
    prompts = [p for i in range(0, len(prompts), 4 * batch) for p in sorted(prompts[i : i + 4 * batch], key=len)]
    new = seq_len - keep_prompt
    t0, out = time.perf_counter(), []
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        width = max(len(p) for p in group)
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(group):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        seq = teacher.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, pad_token_id=pad_id)
        out.append(seq[:, width - keep_prompt : width + new])
        if time.perf_counter() - t0 > seconds:
            break
    return torch.cat(out) if out else torch.zeros(0, seq_len, dtype=torch.long)
