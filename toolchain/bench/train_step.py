"""`mobc bench train-step`: the draft head's training step, by matmul precision and malloc setting.

The step `mobc train draft --kind head` runs (training_loss, then AdamW with a clipped gradient) on real
answer windows of an on-policy cache and their teacher states, for four variants in alternating blocks
of steps in one process, so machine load hits every variant alike:
  precision  fp32, or the matmuls under bf16 autocast (--precision bf16)
  malloc     default: glibc's mmap and trim thresholds at their start value (128 KB), so every activation
             block above it is a fresh mapping faulted in page by page; pinned: the training loop's
             setting (reuse_freed_memory: freed blocks up to 1 GB are reused)
Per variant: median seconds per step over the blocks, minor page faults per step, and steps per minute
against fp32 with the default malloc.
"""

from __future__ import annotations

import ctypes
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from toolchain.train.draft import teacher_states
from toolchain.train.head import HeadConfig, new_head, training_loss
from toolchain.train.loop import (
    GLIBC_DEFAULT_THRESHOLD,
    adamw_step,
    reuse_freed_memory,
    set_malloc_thresholds,
)

VARIANTS = (("fp32", "default"), ("fp32", "pinned"), ("bf16", "default"), ("bf16", "pinned"))


def set_malloc(mode: str) -> bool:
    """glibc's thresholds as a process starts (default) or as the training loop pins them (pinned). default also
    hands the free heap's pages back (malloc_trim), as a fresh process has none: a block the last pinned block
    freed would otherwise serve this block's allocations without a fault."""
    if mode == "pinned":
        return reuse_freed_memory()
    ok = set_malloc_thresholds(GLIBC_DEFAULT_THRESHOLD, GLIBC_DEFAULT_THRESHOLD)
    if ok:
        ctypes.CDLL(None).malloc_trim(0)
    return ok


def measure(target: Any, tok: Any, windows: torch.Tensor, rounds: int, steps: int, cfg: HeadConfig | None = None,
            progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Seconds and minor page faults per step of each variant: `rounds` rounds of one block of `steps` steps per
    variant (after one unmeasured block that allocates the optimizer's state), on `windows` [n, T], with the
    head's training settings (`cfg`: batch, unroll, draft vocabulary; HeadConfig's defaults)."""
    cfg = cfg or HeadConfig()
    states, _ = teacher_states(target, windows, float("inf"), cfg.batch, progress)
    head = new_head(target, tok, windows, cfg.draft_vocab)
    params = head.trainable()
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    rows = torch.Generator().manual_seed(cfg.seed)
    head.train()

    def block(precision: str) -> tuple[float, int]:
        run = replace(cfg, precision=precision)
        faults, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        for _ in range(steps):
            pick = torch.randint(len(windows), (cfg.batch,), generator=rows)
            adamw_step(opt, params, lambda p=pick: training_loss(head, windows[p], states[p], run), clip=1.0)
        return time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults

    glibc = set_malloc("default")
    block("fp32")  # warm-up: AdamW's state and the first allocations
    samples: dict[tuple[str, str], list[tuple[float, int]]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        for precision, malloc in VARIANTS:
            set_malloc(malloc)
            samples[(precision, malloc)].append(block(precision))
        progress(f"round {r + 1}/{rounds}: " + ", ".join(
            f"{p} {m} {samples[(p, m)][-1][0] / steps:.3f} s/step" for p, m in VARIANTS))
    set_malloc("pinned")  # as the training loop leaves the process
    rows_out = []
    for precision, malloc in VARIANTS:
        per_step = [s / steps for s, _ in samples[(precision, malloc)]]
        rows_out.append({"precision": precision, "malloc": malloc, "median_s": statistics.median(per_step),
                         "min_s": min(per_step), "max_s": max(per_step),
                         "faults_per_step": statistics.median(f / steps for _, f in samples[(precision, malloc)])})
    base = rows_out[0]["median_s"]
    for row in rows_out:
        row["steps_per_minute_vs_base"] = base / row["median_s"]
    return {"windows": list(windows.shape), "batch": cfg.batch, "unroll": cfg.unroll, "rounds": rounds,
            "steps_per_block": steps, "glibc": glibc, "rows": rows_out,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
