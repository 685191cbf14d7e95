"""Dual-path progressive revision: a second path (a CPU thread) re-checks provisional tokens.

The main path (the NPU on a phone) decides aggressively: tokens below `revise_below` confidence
are committed to the block *provisionally* and fed as real tokens, so the next calls already
condition on them. The revision path re-runs the same window on its own session with every
provisional token masked out again, which gives each one an unleaked probability (with the
token in the input, bidirectional attention lets the model copy it); a token below the keep
threshold is re-masked on the main path.

Determinism: a check submitted after main call t is applied right after main call t+1's
forward (the main path waits if the worker is late), so thread timing never changes the
tokens, only the wall clock. The worker's run overlaps main call t+1; the overlap is measured
from the two paths' recorded intervals.

The worker owns a separate StepModel (own sessions, own cache, IO binding off); the main thread
copies the committed KV prefix into it only while the worker is idle (between collect and submit).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from toolchain.runtime.diffusion_schedule import token_prob
from toolchain.runtime.model import StepModel
from toolchain.runtime.spans import overlapped_seconds

_STOP = object()


@dataclass
class RevisionJob:
    L: int
    feed: np.ndarray  # window tokens with provisional positions (and masks) as the mask token
    block_ids: np.ndarray
    positions: list[int]  # absolute positions of provisional tokens to check
    tokens: list[int]
    carry: np.ndarray  # logits predicting position L


@dataclass
class RevisionResult:
    remask: list[int] = field(default_factory=list)
    confirm: list[int] = field(default_factory=list)


class RevisionPath:
    """A worker thread over its own StepModel; `submit` / `collect` alternate, `close` joins."""

    def __init__(self, folder: Any, family: str, banned: list[int], keep: float, threads: int = 1):
        self.model = StepModel(folder, threads=threads, io_binding=False)
        self.family = family
        self.banned = banned
        self.keep = keep
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._results: queue.Queue[Any] = queue.Queue()
        self._pending = False
        self._synced = 0  # committed rows already copied into the worker's cache
        self.spans: list[tuple[float, float]] = []
        self.wait_s = 0.0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="mobc-revision", daemon=True)
        self._thread.start()

    # ---- worker side --------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            t = time.perf_counter()
            try:
                res = self._check(job)
            except BaseException as exc:  # surfaced on the main thread at collect()
                res = exc
            self.spans.append((t, time.perf_counter()))
            self._results.put(res)

    def _check(self, job: RevisionJob) -> RevisionResult:
        allowed = job.block_ids[None, :] <= job.block_ids[:, None]
        logits = self.model.forward(list(job.feed), allowed_new=allowed, depths=range(len(job.feed)),
                                    family=self.family)
        pred = np.concatenate([job.carry[None], logits[:-1]], axis=0)
        idx = [p - job.L for p in job.positions]
        probs = token_prob(pred[idx], job.tokens, self.banned)
        res = RevisionResult()
        for p, pr in zip(job.positions, probs, strict=True):
            (res.confirm if pr >= self.keep else res.remask).append(p)
        return res

    # ---- main side ----------------------------------------------------------------------------
    def sync(self, main: StepModel) -> None:
        """Copy newly committed KV rows of the main cache (worker idle: called between jobs)."""
        lo, hi = self._synced, main.cache.length
        if hi < lo:
            lo = 0
        mc, wc = main.cache, self.model.cache
        for i in range(len(mc.keys)):
            wc.keys[i][..., lo:hi] = mc.keys[i][..., lo:hi]
            wc.values[i][:, :, lo:hi] = mc.values[i][:, :, lo:hi]
        wc.length = hi
        self._synced = hi

    def submit(self, main: StepModel, job: RevisionJob) -> None:
        assert not self._pending, "collect() the previous check first"
        self.sync(main)
        self._pending = True
        self._jobs.put(job)

    def collect(self) -> RevisionResult:
        if not self._pending:
            return RevisionResult()
        t = time.perf_counter()
        res = self._results.get()
        self.wait_s += time.perf_counter() - t
        self._pending = False
        if isinstance(res, BaseException):
            raise res
        return res

    def reset(self) -> None:
        if self._pending:
            self.collect()
        self._synced = 0
        self.model.reset()

    def close(self, timeout: float = 30.0) -> None:
        if self._thread.is_alive():
            if self._pending:
                try:
                    self.collect()
                except BaseException:
                    pass
            self._jobs.put(_STOP)
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def overlap(main: list[tuple[float, float]], side: list[tuple[float, float]]) -> dict[str, float]:
    """Seconds the side path ran, and how much of that ran while the main path was in a call."""
    busy = sum(e - s for s, e in side)
    both = overlapped_seconds(main, side)
    return {"revision_s": busy, "overlapped_s": both, "overlap": both / busy if busy else 0.0}
