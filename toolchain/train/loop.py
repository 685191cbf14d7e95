"""The timed optimisation loop the CPU trainers share: AdamW, grad-norm clip, a loss line every few steps.

A trainer supplies the loss of one step (its own batch sampling and forward pass); this runs
steps until the wall-clock budget is spent, with the module in train mode, and says what it did.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from toolchain.train.checkpoint import Checkpoint


@dataclass
class LoopResult:
    steps: int
    seconds: float
    losses: list[float]

    def first(self, n: int = 10) -> float | None:
        """Mean loss of the first n steps (None when no step ran)."""
        return float(np.mean(self.losses[:n])) if self.losses else None

    def last(self, n: int = 10) -> float | None:
        """Mean loss of the last n steps (None when no step ran)."""
        return float(np.mean(self.losses[-n:])) if self.losses else None


def _warmup_cosine(lr: float, frac: float, warmup: float, floor: float) -> float:
    """lr at `frac` of the schedule: linear warmup over the first `warmup` share, then a cosine down to floor * lr."""
    if frac < warmup:
        return lr * max(frac / warmup, 1.0 / 64)
    cos = 0.5 * (1.0 + np.cos(np.pi * (frac - warmup) / (1.0 - warmup)))
    return lr * (floor + (1.0 - floor) * cos)


def cosine_by_time(lr: float, seconds: float, warmup: float = 0.03, floor: float = 0.1,
                   clock: Callable[[], float] = time.perf_counter) -> Callable[[int], float]:
    """An `lr_at` for a wall-clock budget: linear warmup over the first `warmup` share of `seconds`,
    then a cosine from `lr` down to `floor * lr` at the end of the budget. The clock starts at the
    first call (the loop's first step), so time spent before the loop does not shorten the schedule."""
    start: list[float] = []

    def lr_at(step: int) -> float:
        now = clock()
        if not start:
            start.append(now)
        return _warmup_cosine(lr, min(1.0, (now - start[0]) / seconds) if seconds > 0 else 1.0, warmup, floor)

    return lr_at


def cosine_by_steps(lr: float, steps: int, warmup: float = 0.03, floor: float = 0.1) -> Callable[[int], float]:
    """cosine_by_time's schedule over a fixed number of steps: the same lr at the same step on any machine."""
    return lambda step: _warmup_cosine(lr, min(1.0, step / steps) if steps > 0 else 1.0, warmup, floor)


GLIBC_DEFAULT_THRESHOLD = 128 * 1024  # glibc's mmap and trim thresholds at a process's start


def set_malloc_thresholds(mmap_bytes: int, trim_bytes: int) -> bool:
    """Pin glibc's mmap threshold (blocks above it are fresh mappings, unmapped on free) and trim threshold (free
    heap above it goes back to the OS). Pinning either stops glibc from moving the mmap threshold itself.
    False where there is no glibc (nothing changed)."""
    try:  # the process's own symbols: glibc's when it is the C library, without a search for the file
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, mmap_bytes)) and bool(mallopt(m_trim_threshold, trim_bytes))


def reuse_freed_memory(limit: int = 1 << 30) -> bool:
    """Make glibc's malloc keep freed blocks of up to `limit` bytes for reuse instead of handing them back to the
    OS. A training step allocates and frees tens of MB of activations; above glibc's mmap threshold (128 KB at
    start, raised only by some frees) each one is a fresh mapping that faults in page by page (`mobc bench
    train-step` measures both settings). Pinning is process-wide and also stops the threshold from moving."""
    return set_malloc_thresholds(limit, 2 * limit)


def adamw_step(opt: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter],
               step_loss: Callable[[], torch.Tensor], clip: float) -> float:
    """One step: loss = step_loss(), backward, clip the gradients' total norm to `clip`, optimizer step."""
    loss = step_loss()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    return loss.item()


def timed_adamw_loop(
    module: torch.nn.Module,
    params: Sequence[torch.nn.Parameter],
    step_loss: Callable[[], torch.Tensor],
    *,
    lr: float,
    seconds: float,
    log: Callable[[str], None],
    label: str,
    every: int,
    clip: float = 1.0,
    lr_at: Callable[[int], float] | None = None,
    max_steps: int | None = None,
    weight_decay: float = 0.0,
    checkpoint: Checkpoint | None = None,
) -> LoopResult:
    """AdamW on `params` for `seconds` of wall clock (or `max_steps` steps, if that comes first: a fixed
    amount of work, whatever the machine's load). `weight_decay` (decoupled, scaled by each step's lr)
    applies to the matrices only: norm gains and biases set scales and offsets, and shrinking them
    regularizes nothing.

    Each step: lr from `lr_at(step)` if given (step counts from 0), loss = step_loss(), backward,
    clip the gradients' total norm to `clip`, optimizer step. Every `every` steps it logs
    "step N: <label> <mean of the last `every` losses> (<elapsed> s)". `module` is in train mode
    during the loop and in eval mode after it. With a `checkpoint` the loop starts where the checkpoint's
    file left off (checkpoint.py) and writes it whenever it is due; `seconds` then counts this run's time.
    """
    reuse_freed_memory()
    matrices = [p for p in params if p.ndim >= 2]
    others = [p for p in params if p.ndim < 2]
    groups = [{"params": matrices, "weight_decay": weight_decay}, {"params": others, "weight_decay": 0.0}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr)
    module.train()
    t0 = time.perf_counter()
    step, losses = checkpoint.resume(module, opt) if checkpoint else (0, [])
    if step:
        log(f"resumed from {checkpoint.path} at step {step}")
    while time.perf_counter() - t0 < seconds and (max_steps is None or step < max_steps):
        if lr_at is not None:
            for g in opt.param_groups:
                g["lr"] = float(lr_at(step))  # a plain float: a numpy one would not load back from a checkpoint
        losses.append(adamw_step(opt, params, step_loss, clip))
        step += 1
        if step % every == 0:
            log(f"step {step}: {label} {np.mean(losses[-every:]):.3f} ({time.perf_counter() - t0:.0f} s)")
        if checkpoint and checkpoint.due():
            checkpoint.save(module, opt, step, losses)
    module.eval()
    return LoopResult(step, time.perf_counter() - t0, losses)
