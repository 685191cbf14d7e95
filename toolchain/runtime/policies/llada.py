"""llada: multi-block speculative diffusion decoding, optionally with dual-path revision.

The engine is policies/diffusion.py with `speculate` on (see its docstring for the window,
revisable tokens and keep threshold); `revise` adds the CPU revision path of
toolchain/runtime/revision.py. With `speculate` and `revise` off it is the baseline it names
by `rule` (steps = LLaDA, threshold = Fast-dLLM), token for token.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from toolchain.runtime.model import StepModel
from toolchain.runtime.policies.diffusion import (
    MASK,
    PROVISIONAL,
    REVISABLE,
    DiffusionOptions,
    DiffusionPolicy,
)
from toolchain.runtime.revision import RevisionJob, RevisionPath, overlap


class LLaDA(DiffusionPolicy):
    name = "llada"
    defaults: dict[str, Any] = {"rule": "threshold", "speculate": True}

    def __init__(self, target: StepModel, draft: StepModel | None = None, options: DiffusionOptions | None = None,
                 **kw: Any):
        super().__init__(target, None, options, **kw)
        self.path: RevisionPath | None = None

    def generate(self, prompt, max_new_tokens, sampler):  # type: ignore[override]
        if self.opts.revise:
            if self.path is None or not self.path.alive:
                self.path = RevisionPath(self.target.folder, self.family, self.banned, self.opts.keep_threshold)
            self.path.reset()
            self.path.spans.clear()
            self.path.wait_s = 0.0
        yield from super().generate(prompt, max_new_tokens, sampler)

    def _collect_revisions(self) -> tuple[list[int], list[int]]:
        if self.path is None or not self.opts.revise:
            return [], []
        res = self.path.collect()
        # a position may have changed since it was submitted (e.g. committed): apply only to live ones
        live = [p for p in res.remask if self.flag[p] == PROVISIONAL]
        return live, [p for p in res.confirm if self.flag[p] == PROVISIONAL]

    def _submit_revisions(self, lo: int, hi: int) -> None:
        if self.path is None or not self.opts.revise:
            return
        pos = np.arange(lo, hi)
        prov = [int(p) for p in pos if self.flag[p] == PROVISIONAL]
        if not prov:
            return
        hidden = (self.toks[pos] == MASK) | (self.flag[pos] == REVISABLE) | (self.flag[pos] == PROVISIONAL)
        feed = np.where(hidden, self.mask_id, self.toks[pos])
        ends = self._block_ends(pos)
        job = RevisionJob(L=lo, feed=feed, block_ids=ends, positions=prov,
                          tokens=[int(self.toks[p]) for p in prov], carry=self.carry.copy())
        self.path.submit(self.target, job)

    def _block_ends(self, pos: np.ndarray) -> np.ndarray:
        """Block index of each window position relative to the window's first block (block-causal mask)."""
        P = self.prompt_len
        ids = (pos - P) // self.B
        return (ids - ids[0]).astype(np.int64)

    def _start(self, prompt) -> None:  # type: ignore[override]
        self.prompt_len = len(prompt)
        super()._start(prompt)

    def _close(self) -> None:
        if self.path is not None and self.opts.revise:
            self.path.collect()  # a check still in flight finishes before the figures are read
            self.dstats.revision = {**overlap(self.forward_spans, self.path.spans), "wait_s": self.path.wait_s}

    def close(self) -> None:
        """Stop the revision thread (joins it)."""
        if self.path is not None:
            self.path.close()
            self.path = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
