"""`mobc bench head`: trained draft heads side by side on the target's own answers, teacher-forced.

The target answers every prompt greedily (up to max_new tokens or its end-of-turn); each head then drafts a
gamma-token chain from every answer position, seeing the target's true features up to that position and its
own after it, as the chain policy does without lookup. A chain counts the leading drafts equal to the target's
greedy tokens, so tokens per target call is what a chain run would reach on these answers. No compiled graphs
and no runtime: a few minutes where a decode bench takes twenty, and every head reads the same answers and
teacher states, so the differences between heads are the heads'. Beside that count, each answer is replayed as a
chain run and a chain+lookup run would walk it (bench/replay.py): the tokens per target call `mobc bench decode`
reports for those policies with this target's 8-row verify graph. Sets of windows from the on-policy caches
a training read (`windows`) measure the heads on answers they were trained on: the gap to the prompt sets is
how much a head over-fits. Each head's first drafts are also split by how sure the target itself is of the
token they must guess (its probability of its own greedy token there): misses where the target decides
narrowly are the hardest to win (any small error in the head's estimate flips the choice); misses where it is
sure are the head's own.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from toolchain.bench.prompts import BenchError, encode, load_prompts
from toolchain.bench.replay import head_distribution, replay_chain, tokens_per_call
from toolchain.runtime.policies.chain import EXTEND_AT, EXTEND_ROWS, RUN_MATCH
from toolchain.train.draft import teacher_states
from toolchain.train.head import cached_answers, draft_chains, drafts_accepted


def head_labels(heads: list[Path]) -> list[str]:
    """Table labels of heads given as folders or files: each folder's name (a `head.safetensors` file's folder,
    another file's own name), or the paths as given where two names would be the same."""
    names = [h.parent.name if h.name == "head.safetensors" else h.name for h in heads]
    return names if len(set(names)) == len(names) and all(names) else [str(h) for h in heads]


def prompt_sets(spec: str) -> dict[str, str]:
    """`spec`'s sets by name (humaneval:20+chat:24 -> humaneval, chat); a set given twice keeps its full spec."""
    parts = [p.strip() for p in spec.split("+") if p.strip()]
    names = [p.partition(":")[0] for p in parts]
    return {(n if names.count(n) == 1 else p): p for n, p in zip(names, parts, strict=True)}


@torch.no_grad()
def target_answers(target: Any, tok: Any, spec: str, max_new: int) -> list[tuple[torch.Tensor, int]]:
    """(prompt + greedy answer [1, T], prompt length) per prompt of `spec`; an answer ends at the target's eos."""
    eos = getattr(tok, "eos_token_id", None)
    out = []
    for prompt in load_prompts(spec):
        ids = torch.tensor([encode(tok, prompt)])
        seq = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                              pad_token_id=eos if eos is not None else 0)
        out.append((seq, ids.shape[1]))
    return out


# the target's probability p of its own greedy token: band k holds CONFIDENCE[k] <= p < CONFIDENCE[k+1] (the
# last one p = 1 too)
CONFIDENCE = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0)


def target_next(states: torch.Tensor, lm_head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's greedy next token after each row of its final states [1, T, C] ([1, T], as greedy_tokens
    gives it) and its probability of that token ([T]), from one pass over the logits."""
    logits = torch.nn.functional.linear(states[0], lm_head)
    return logits.argmax(-1)[None], torch.softmax(logits.float(), -1).amax(-1)


def first_drafts_by_confidence(first: torch.Tensor, greedy: torch.Tensor, confidence: torch.Tensor,
                               start: int) -> list[list[int]]:
    """[positions, accepted] per CONFIDENCE bucket over the first drafts of chains starting at rows start..T-2:
    first [T] (first[s] guesses the target's token after row s, greedy [T]) and the target's probability of
    that token, confidence [T]."""
    rows = torch.arange(start, len(greedy) - 1)
    ok = first[rows] == greedy[rows]
    bucket = torch.bucketize(confidence[rows], torch.tensor(CONFIDENCE[1:-1]), right=True)
    return [[int((bucket == k).sum()), int(ok[bucket == k].sum())] for k in range(len(CONFIDENCE) - 1)]


def confidence_cells(buckets: list[list[int]]) -> dict[str, str | None]:
    """Table cells per CONFIDENCE bucket: the head's first-draft acceptance there and the bucket's share of the
    positions ("0.462 of 20%")."""
    total = sum(n for n, _ in buckets)
    return {f"conf{k}": f"{ok / n:.3f} of {n / total:.0%}" if n else None for k, (n, ok) in enumerate(buckets)}


def _counts(acc: dict[str, Any]) -> dict[str, Any]:
    """drafts_accepted's means as sums, so answers of any length add up."""
    n = acc["rounds"]
    return {"rounds": n, "accepted": (acc["tokens_per_call"] - 1) * n,
            "at_depth": [d * n for d in acc["accept_at_depth"]]}


# the replayed runs: name -> (with lookup); both with chain's default extension up to an 8-row verify graph
RUNS = {"chain": False, "chain+lookup": True}


def _row(counts: list[dict[str, Any]], gamma: int) -> dict[str, Any]:
    n, tokens = sum(c["rounds"] for c in counts), sum(c["answer_tokens"] for c in counts)
    # every row: the answers' coverage by the head's vocabulary and the replayed runs' tokens per target call
    buckets = [[sum(c["by_confidence"][k][i] for c in counts) for i in (0, 1)] for k in range(len(CONFIDENCE) - 1)]
    also = {"vocab_coverage": sum(c["in_vocab"] for c in counts) / tokens if tokens else None,
            "first_draft_by_confidence": buckets,
            **{f"run:{r}": tokens_per_call([c["runs"][r] for c in counts if "runs" in c]) for r in RUNS}}
    if not n:
        return {"rounds": 0, "tokens_per_call": None, "accept_at_depth": [None] * gamma, **also}
    return {"rounds": n, "tokens_per_call": 1 + sum(c["accepted"] for c in counts) / n,
            "accept_at_depth": [sum(c["at_depth"][k] for c in counts) / n for k in range(gamma)], **also}


def window_answers(spec: str) -> tuple[str, list[tuple[torch.Tensor, int]]]:
    """`FILE[:N]`: N (default 64) evenly spaced answer windows of an on-policy cache, each as (window [1, T],
    its prompt's length), named by the file."""
    path, _, count = spec.rpartition(":")
    if not count.isdigit():
        path, count = spec, "64"
    if int(count) < 1:
        raise BenchError(f"--windows {spec}: give FILE or FILE:N with N >= 1 windows")
    windows, plen = cached_answers(Path(path), "--windows")
    picks = torch.linspace(0, len(windows) - 1, min(int(count), len(windows))).round().long().unique()
    return Path(path).name, [(windows[i : i + 1], plen) for i in picks.tolist()]


def measure(target: Any, tok: Any, heads: dict[str, Any], spec: str, max_new: int, gamma: int,
            progress: Callable[[str], None] = lambda _m: None,
            windows: dict[str, list[tuple[torch.Tensor, int]]] | None = None) -> dict[str, Any]:
    """Rows per (prompt set, head) and per head over all prompt sets ("all"), then per (window set, head):
    tokens per target call, the share of chains accepting at least k drafts, the chains counted, the share of
    the answers' tokens inside the head's draft vocabulary, and the ratio of tokens per call to the first
    head's."""
    lm_head = target.get_output_embeddings().weight
    per: dict[tuple[str, str], list[dict[str, Any]]] = {}
    sets = prompt_sets(spec)
    answers = 0

    def answer_sets():  # the prompt sets' answers generated one set at a time, then the cached windows
        yield from ((name, target_answers(target, tok, part, max_new)) for name, part in sets.items())
        yield from (windows or {}).items()

    for name, seqs in answer_sets():
        answers += len(seqs) if name in sets else 0
        progress(f"{name}: {len(seqs)} answers, {sum(s.shape[1] - p for s, p in seqs)} answer tokens")
        for seq, plen in seqs:
            states, _ = teacher_states(target, seq, float("inf"), 1, lambda _m: None)
            greedy, confidence = target_next(states, lm_head)  # the target's token after each row, its probability
            for label, head in heads.items():
                chains, hidden = draft_chains(head, seq, states, max(gamma, EXTEND_ROWS - 1))
                # the first chain starts at the answer's first token (row plen): the target's prefill gives that
                # token, as in a run and in the training report's held-out count
                counts = _counts(drafts_accepted(chains[:, :gamma], greedy, plen, gamma))
                dist = head_distribution(head, hidden[0])
                counts["runs"] = {r: (seq.shape[1] - plen, replay_chain(seq[0], plen, chains[0], dist, head.vocab_ids,
                                                                        gamma, EXTEND_AT, EXTEND_ROWS - 1, lookup,
                                                                        RUN_MATCH))
                                  for r, lookup in RUNS.items()}
                answer = seq[0, plen + 1 :]  # the tokens a run drafts; one outside the vocabulary is never drafted
                counts.update(answer_tokens=len(answer), in_vocab=int(torch.isin(answer, head.vocab_ids).sum()),
                              by_confidence=first_drafts_by_confidence(chains[0, 0], greedy[0], confidence, plen))
                per.setdefault((name, label), []).append(counts)
    return {"prompts": spec, "answers": answers, "max_new_tokens": max_new, "gamma": gamma,
            "windows": {name: len(seqs) for name, seqs in (windows or {}).items()},
            "rows": table_rows(per, list(sets), list(heads), gamma, list(windows or {}))}


def table_rows(per: dict[tuple[str, str], list[dict[str, Any]]], sets: list[str], heads: list[str],
               gamma: int, after: list[str] = ()) -> list[dict[str, Any]]:
    """One row per (set, head) from each answer's counts, then per head over all `sets`, then per (set of
    `after`, head) (in no "all" row); vs_first is the ratio to the first head's tokens per call in the same set."""
    rows = []
    for name in [*sets, "all", *after]:
        first = None
        for i, label in enumerate(heads):
            counts = per[(name, label)] if name != "all" else [c for s in sets for c in per[(s, label)]]
            row = {"set": name, "head": label, **_row(counts, gamma)}
            tpc = row["tokens_per_call"]
            first = tpc if i == 0 else first  # no chain in the set (answers too short): no ratio, not another base
            row["vs_first"] = tpc / first if tpc is not None and first else None
            rows.append(row)
    return rows
