"""Diffusion-LM decoding over one fixed-width diffusion-block graph with a prefix KV cache.

The model is a masked diffusion LM with a shifted head (toolchain/diffusion/form.py): the row
of position i predicts token i+1. Text is block-causal: the prompt is fed in W-wide chunks
(bidirectional inside a chunk), then each block of B generated tokens starts as mask tokens and
is denoised with a bidirectional mask inside the block while the committed text is read from
the KV cache (Fast-dLLM's prefix cache). One compiled graph of width W >= B serves every call.

A *call* feeds the window [L, L+n) where L = cache length (committed text). The token at L is
predicted by `carry` (the logits of row L-1, saved when L-1 was committed), the token at L+i by
row i-1. Decision rules (toolchain/runtime/diffusion_schedule.py):
- rule "steps"     LLaDA low-confidence remasking, a fixed S steps per block;
- rule "threshold" Fast-dLLM parallel decoding (every mask above a threshold, at least one).

When a block has no masks left, one more call feeds its final tokens and commits their rows, so
the cache holds exactly what a full recompute would (the "refresh" call; the last block skips
it). That is the baseline semantics, equal to the torch reference (toolchain/diffusion/reference.py).

Multi-block speculation (`speculate`, policy llada) changes three things: once the current
block has at most `spec_masks` masks, its decided prefix is committed early and the window
slides over the next block (in-window mask stays block-causal), so the graph's spare width
denoises the next block; next-block tokens above `spec_threshold` are decided early but flagged
*revisable* (still fed as masks, so their later check is not leaked by their own input); when
that block becomes current, each revisable token is kept if its probability is still >=
`keep_threshold`, else re-masked. The refresh call disappears: the first call of the next block
carries the finished block's tail. With `speculate` off nothing of this runs, so the policy
reproduces the baseline token for token by construction (and the tests check it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from toolchain.errors import MobcError
from toolchain.runtime.diffusion_schedule import (
    due_now,
    low_confidence_pick,
    softmax_conf,
    threshold_pick,
    token_prob,
    transfer_counts,
)
from toolchain.runtime.model import StepModel
from toolchain.runtime.policies.base import Policy
from toolchain.runtime.policies.sampling import Sampler

MASK = -1  # "undecided" in the policy's own token array (fed to the graph as the mask token)
DECIDED, REVISABLE, PROVISIONAL = 0, 1, 2


@dataclass
class DiffusionOptions:
    block: int = 0  # B; 0 = the graph's width
    rule: str = "steps"  # "steps" (LLaDA) or "threshold" (Fast-dLLM)
    steps: int = 8  # S, steps per block for rule "steps"
    threshold: float = 0.9  # Fast-dLLM confidence threshold
    speculate: bool = False  # multi-block speculation (policy llada)
    spec_masks: int = 4  # speculate once the current block has at most this many masks
    spec_threshold: float = 0.9  # decide a next-block token early only above this
    keep_threshold: float = 0.5  # a revisable / provisional token survives its check at >= this
    revise: bool = False  # dual-path revision on a CPU thread (policy llada)
    revise_below: float = 0.9  # with revise: tokens decided below this confidence are provisional
    revise_threshold: float = 0.7  # with revise and rule "threshold": the main path's (lower) threshold


@dataclass
class DiffusionStats:
    block_calls: list[int] = field(default_factory=list)  # model calls spent while each block was current
    spec_decided: int = 0  # next-block tokens decided early
    spec_kept: int = 0  # ... of which kept when their block became current
    spec_remasked: int = 0
    provisional: int = 0  # tokens sent to the revision path
    revised: int = 0  # ... of which it re-masked
    revision: dict[str, float] = field(default_factory=dict)  # overlap figures (revision.py)


def diffusion_setup(model: StepModel) -> tuple[str, int, int]:
    """(family, width, mask token id) of an artifact's diffusion-block graph."""
    form = model.manifest.model.diffusion
    if not form:
        raise MobcError(f"{model.name} is not a diffusion LM (no diffusion form in its manifest); compile a "
                        "checkpoint made by `mobc train diffusion` (it carries diffusion.json)")
    fams = [f for f in model.widths if model.sessions.chain(f)[0].role == "diffusion"]
    fam = max(fams, key=lambda f: model.widths[f]) if fams else max(model.widths, key=model.widths.get)
    return fam, model.widths[fam], int(form["mask_token_id"])


def transfer_counts_padded(n: int, steps: int) -> list[int]:
    """The baseline's per-step counts, padded with zeros for steps past S."""
    return transfer_counts(n, steps) + [0] * (n + 2)


class DiffusionPolicy(Policy):
    """The engine; `dllm` (LLaDA steps) and `fastdllm` (threshold) are it with speculation off."""

    name = "dllm"
    defaults: dict[str, Any] = {"rule": "steps"}

    def __init__(self, target: StepModel, draft: StepModel | None = None, options: DiffusionOptions | None = None,
                 **kw: Any):
        super().__init__(target, None)
        self.opts = options or DiffusionOptions(**{**self.defaults, **kw})
        self.family, self.width, self.mask_id = diffusion_setup(target)
        self.B = self.opts.block or self.width
        if not 1 <= self.B <= self.width:
            raise MobcError(f"block {self.B} must be between 1 and the diffusion graph's width {self.width}")
        if self.opts.rule not in ("steps", "threshold"):
            raise MobcError(f"rule {self.opts.rule!r}: use steps (LLaDA) or threshold (Fast-dLLM)")
        self.banned = [self.mask_id]
        self.dstats = DiffusionStats()
        self.forward_spans: list[tuple[float, float]] = []  # main-path call intervals (overlap figures)

    # ---- the graph --------------------------------------------------------------------------
    def _call(self, feed: Sequence[int], block_ids: np.ndarray) -> np.ndarray:
        allowed = block_ids[None, :] <= block_ids[:, None]  # block-causal inside the window
        t = time.perf_counter()
        logits = self.target.forward(list(feed), allowed_new=allowed, depths=range(len(feed)), family=self.family)
        self.forward_spans.append((t, time.perf_counter()))
        return logits

    def _prefill(self, prompt: Sequence[int]) -> None:
        """Prompt in W-wide chunks from position 0, bidirectional inside a chunk (as trained)."""
        for s in range(0, len(prompt), self.width):
            chunk = list(prompt[s : s + self.width])
            logits = self._call(chunk, np.zeros(len(chunk), dtype=np.int64))
            self.target.commit(range(len(chunk)))
            self.carry = logits[-1]

    # ---- hooks for the revision path (policy llada) --------------------------------------------
    def _collect_revisions(self) -> tuple[list[int], list[int]]:
        """(positions to re-mask, positions confirmed) from the revision path."""
        return [], []

    def _submit_revisions(self, lo: int, hi: int) -> None: ...

    def _close(self) -> None: ...

    # ---- decoding ---------------------------------------------------------------------------
    def _pick(self, conf: np.ndarray, due: int) -> list[int]:
        if self.opts.rule == "steps":
            return low_confidence_pick(conf, min(due, len(conf)))
        thr = self.opts.revise_threshold if self.opts.revise else self.opts.threshold
        return threshold_pick(conf, thr)

    def generate(self, prompt: Sequence[int], max_new_tokens: int, sampler: Sampler) -> Iterator[list[int]]:
        if not sampler.greedy:
            raise MobcError("diffusion policies decode by confidence (greedy); use --temperature 0")
        self._start(prompt)
        self.dstats = DiffusionStats()
        self.forward_spans = []
        P, B, W, ctx = len(prompt), self.B, self.width, self.target.context
        n_blocks = min(math.ceil(max_new_tokens / B), (ctx - W - P) // B + 1 if ctx - W >= P else 0)
        if n_blocks <= 0:
            raise MobcError(f"prompt of {P} tokens leaves no room for a block in context {ctx}")
        self._prefill(prompt)
        self._end_prefill()
        limit = P + n_blocks * B
        self.toks = np.full(limit + W, MASK, dtype=np.int64)
        self.toks[:P] = prompt
        self.flag = np.zeros(limit + W, dtype=np.int8)
        self.revised = np.zeros(limit + W, dtype=bool)
        emitted = 0
        try:
            for cur in range(P, limit, B):
                block, stop = self._run_block(cur, limit)
                block, clip = self._clip(block, max_new_tokens - emitted)
                emitted += len(block)
                self.stats.tokens = emitted
                yield block
                if stop or clip:
                    return
        finally:
            self._close()
            self._finish()

    def _run_block(self, cur: int, limit: int) -> tuple[list[int], bool]:
        """Denoise block [cur, cur+B) until it is final; returns (its tokens, saw end-of-sequence).

        Without speculation a block ends with its refresh call committed (cache length = its end).
        With speculation it ends as soon as its tokens are final; its uncommitted tail rides in
        the next block's first call (block-causal in the window, so that call's rows for the tail
        are exactly the refresh rows) and is committed after it.
        """
        B, W, o = self.B, self.width, self.opts
        end = cur + B
        nxt_end = min(end + B, limit)
        last = end >= limit
        sched = transfer_counts_padded(B, o.steps)
        calls, first, spec = 0, True, False
        while True:
            L = self.target.length
            hi = min(L + W, nxt_end if spec else end)
            pos = np.arange(L, hi)
            fed_mask = (self.toks[pos] == MASK) | (self.flag[pos] == REVISABLE)
            feed = np.where(fed_mask, self.mask_id, self.toks[pos])
            logits = self._call(feed, (pos >= cur).astype(np.int64) + (pos >= end))
            calls += 1
            # rows predicting each window position: L from carry, L+i from row i-1
            pred = np.concatenate([self.carry[None], logits[:-1]], axis=0)
            remask, confirm = self._collect_revisions()
            for p in remask:
                self.toks[p], self.flag[p] = MASK, DECIDED
                self.revised[p] = True  # revised once: its next decision is final (progress)
                self.dstats.revised += 1
            for p in confirm:
                self.flag[p] = DECIDED
            in_cur = (pos >= cur) & (pos < end)
            if first:  # revisable tokens face their check once, as the current block
                for i in np.nonzero(in_cur & (self.flag[pos] == REVISABLE))[0]:
                    p = pos[i]
                    if token_prob(pred[i : i + 1], [self.toks[p]], self.banned)[0] >= o.keep_threshold:
                        self.flag[p] = DECIDED
                        self.dstats.spec_kept += 1
                    else:
                        self.toks[p], self.flag[p] = MASK, DECIDED
                        self.dstats.spec_remasked += 1
                first = False
            best, conf = softmax_conf(pred, self.banned)
            masked = np.nonzero(in_cur & (self.toks[pos] == MASK))[0]
            if len(masked):
                n_masked = int((self.toks[cur:end] == MASK).sum())
                left = o.steps - calls + 1
                # the baseline's schedule, or more when masks must still finish within S steps
                due = max(sched[calls - 1], due_now(n_masked, left)) if left > 0 else n_masked
                for j in self._pick(conf[masked], due):
                    i = masked[j]
                    self.toks[pos[i]] = best[i]
                    if o.revise and conf[i] < o.revise_below and not self.revised[pos[i]]:
                        self.flag[pos[i]] = PROVISIONAL
                        self.dstats.provisional += 1
            if spec:  # the spare width: confident next-block tokens, decided early but revisable
                for i in np.nonzero((pos >= end) & (self.toks[pos] == MASK) & (conf > o.spec_threshold))[0]:
                    self.toks[pos[i]], self.flag[pos[i]] = best[i], REVISABLE
                    self.dstats.spec_decided += 1
            self._submit_revisions(L, hi)
            masks_left = int((self.toks[cur:end] == MASK).sum())
            final = not masks_left and not (self.flag[cur:end] == PROVISIONAL).any()
            if o.speculate and not last and masks_left <= o.spec_masks:
                spec = True
            # rows computed from decided inputs; the previous block's tail always is. A token the
            # revision path re-masked during this call was fed as a token but is undecided now: its
            # row must not be committed (it would bury a mask under the cache and never finish)
            ok = (pos < end) & ~fed_mask & (self.flag[pos] != PROVISIONAL) & (self.toks[pos] == feed)
            c = int(np.argmin(ok)) if not ok.all() else len(ok)
            if not spec:  # baseline: within the block only once all of it was fed final
                c = min(c, int((pos < cur).sum())) if not (final and ok[in_cur].all()) else c
            if c:
                self.target.commit(range(c))
                self.carry = logits[c - 1]
            if final and (last or spec or self.target.length >= end):
                break
            if calls > 4 * (B + o.steps):  # every call decides or commits something: this is a bug
                raise RuntimeError(f"diffusion block at {cur} did not converge after {calls} calls "
                                   f"({masks_left} masks left, cache at {self.target.length})")
        self.dstats.block_calls.append(calls)
        out = [int(t) for t in self.toks[cur:end]]
        return out, any(t in self.target.eos_ids for t in out)

    def extra_stats(self) -> dict[str, Any]:
        d = self.dstats
        return {"block_calls": d.block_calls, "spec_decided": d.spec_decided, "spec_kept": d.spec_kept,
                "spec_remasked": d.spec_remasked, "provisional": d.provisional, "revised": d.revised,
                "revision": d.revision}


class FastDLLM(DiffusionPolicy):
    """Fast-dLLM threshold parallel decoding (speculation off)."""

    name = "fastdllm"
    defaults = {"rule": "threshold"}
