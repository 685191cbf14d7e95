"""On-policy prompts for draft training: what the target is asked in an app, answered by the target itself.

A draft is judged on the target's greedy answers to real prompts, and a small target answers a
coding task or a chat question quite differently from how it continues the middle of a source
file. So besides stdlib windows, the head trains on the target's own answers to:

- HumanEval problems after the first `BENCH_HUMANEVAL` (the benches' `humaneval:N` prompts, N up
  to that, stay unseen), as plain-text prompts;
- chat requests built from train-split stdlib source (explain a function, document it, summarize
  its docstring), wrapped in the target's chat template (the benches' `chat:N` prompts are
  general-topic requests written for mobc and are never trained on);
- general-topic chat requests the target writes itself (`self_chat_requests`, Magpie: an aligned
  chat model given its template up to the user's turn writes a plausible user request). Code-derived
  requests alone taught the head code-flavoured answers; the target's own requests cover the topics
  a chat app is asked about (travel, planning, advice, writing) in the target's own words; with
  `REQUEST_OPENERS` each batch starts its requests with a common instruction verb or question word.

Everything is real text from installed packages or the target itself; nothing downloads.
"""

from __future__ import annotations

import ast
import random
import time
from collections.abc import Callable
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


def app_prompts(tokenizer: Any, n_chat: int, seed: int = 0, requests: list[str] = ()) -> list[list[int]]:
    """Token ids of HumanEval prompts (plain), stdlib chat requests and `requests` (both through the chat
    template), interleaved."""
    code = [encode(tokenizer, p) for p in load_prompts("humaneval")[BENCH_HUMANEVAL:]]
    chats: list[list[int]] = []
    own: list[list[int]] = []
    if getattr(tokenizer, "chat_template", None):
        chats = [encode(tokenizer, ChatPrompt(CHAT_TASKS[i % len(CHAT_TASKS)].format(src=src, doc=doc)))
                 for i, (src, doc) in enumerate(_functions(n_chat, seed))]
        own = [encode(tokenizer, ChatPrompt(r)) for r in requests]
    random.Random(seed).shuffle(code)
    return interleave(code, chats, own)


def interleave(*lists: list) -> list:
    """One item of each list in turn; a list that runs out drops out."""
    out, its = [], [iter(x) for x in lists]
    while its:
        alive = []
        for it in its:
            item = next(it, None)
            if item is not None:
                out.append(item)
                alive.append(it)
        its = alive
    return out


def _user_turn_prefix(tokenizer: Any) -> str | None:
    """The chat template's text up to where the user's message begins (system turn included)."""
    mark = "\u2063mobc-request\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False,
                                         add_generation_prompt=True)
    return text.split(mark)[0] if isinstance(text, str) and mark in text else None


# Openers a self-written request may be made to start with (`--self-chat-openers`): common root verbs and
# question words of instruction datasets (as in Self-Instruct's analysis of its tasks), with a few for the
# request kinds MT-bench groups chat into (roleplay: Pretend, Imagine; math: Solve, Calculate). Left alone,
# the target asks mostly for advice and plans; an opener makes it also write the other kinds of request a
# chat app gets, still in its own words. "" leaves it free. (The held-out chat requests are the first ones
# written, i.e. the free batch's.)
REQUEST_OPENERS = ("", "Write", "Explain", "Describe", "Create", "Give", "List", "Summarize", "Suggest", "Compare",
                   "Solve", "Calculate", "Imagine", "Pretend", "Rewrite", "Classify", "Identify", "How", "What", "Why")


@torch.no_grad()
def self_chat_requests(teacher: Any, tokenizer: Any, n: int, seed: int, batch: int = 32, max_tokens: int = 64,
                       seconds: float = float("inf"), openers: tuple[str, ...] = ("",),
                       log: Callable[[str], None] | None = None) -> list[str]:
    """Up to `n` distinct user requests the target writes itself (Magpie).

    The target continues its chat template's user-turn prefix, sampled (temperature 1, top-p 0.95,
    seeded); a request is kept when it ends its turn (end-of-text) within `max_tokens` and has a few
    words. Sampling, not greedy: the requests must differ from each other. Batch i starts every request
    with `openers[i % len(openers)]` (the opener is part of the request)."""
    prefix = _user_turn_prefix(tokenizer) if getattr(tokenizer, "chat_template", None) else None
    eos = getattr(tokenizer, "eos_token_id", None)
    if prefix is None or eos is None or n <= 0:
        return []
    t0, out, seen = time.perf_counter(), [], set()
    with torch.random.fork_rng():
        torch.manual_seed(seed + 23)
        for i in range(4 * (n // batch + 1)):  # bounded: a target that rarely ends its turn gives fewer
            opener = openers[i % len(openers)]
            ids = torch.tensor([tokenizer(prefix + opener, add_special_tokens=False).input_ids])
            x = ids.expand(batch, -1)
            seq = teacher.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=True,
                                   temperature=1.0, top_p=0.95, top_k=0, pad_token_id=eos, eos_token_id=eos)
            for row in seq[:, ids.shape[1]:].tolist():
                if eos not in row:
                    continue  # ran out of tokens mid-request
                text = (opener + tokenizer.decode(row[: row.index(eos)], skip_special_tokens=True)).strip()
                if len(text.split()) >= 4 and text not in seen:
                    seen.add(text)
                    out.append(text)
            if log:
                log(f"self-written chat requests: {min(len(out), n)}/{n} ({time.perf_counter() - t0:.0f} s)")
            if len(out) >= n or time.perf_counter() - t0 > seconds:
                break
    return out[:n]


@torch.no_grad()
def prompt_continuations(teacher: Any, prompts: list[list[int]], seq_len: int, keep_prompt: int, batch: int,
                         seconds: float, pad_id: int = 0, max_prompt: int = 256, min_prompt: int = 8,
                         log: Callable[[str], None] | None = None) -> torch.Tensor:
    """[n, seq_len] windows: each prompt's last `keep_prompt` tokens (all of a shorter prompt) and the
    target's greedy answer filling the rest of the window.

    Prompts shorter than `min_prompt` or longer than `max_prompt` (their prefill would eat the budget)
    are skipped; each run of 4 batches is sorted by length so a batch, left-padded to its longest
    prompt (attention mask 0 on the pads), wastes little; generation stops at the time budget."""
    prompts = [p for p in prompts if min_prompt <= len(p) <= max_prompt]
    prompts = [p for i in range(0, len(prompts), 4 * batch) for p in sorted(prompts[i : i + 4 * batch], key=len)]
    t0, out = time.perf_counter(), []
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        width = max(len(p) for p in group)
        kept = [min(keep_prompt, len(p)) for p in group]
        new = seq_len - min(kept)  # the shortest kept prompt's answer fills the most of its window
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(group):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        seq = teacher.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, pad_token_id=pad_id)
        out.extend(seq[r, width - k : width - k + seq_len] for r, k in enumerate(kept))
        if log:
            log(f"answers: {len(out)}/{len(prompts)} windows ({time.perf_counter() - t0:.0f} s)")
        if time.perf_counter() - t0 > seconds:
            break
    return torch.stack(out) if out else torch.zeros(0, seq_len, dtype=torch.long)
