"""Weight prefetch across parts: load the next part while the current one runs.

A model split into parts (passes/split_layers.py) runs as a chain: part k's residual output is
part k+1's input. When the weights do not all fit the app's DRAM budget (llada.cpp's
"swap-optimized" runtime), parts outside the resident set are read from flash on every call; a
serial runtime reads part k, then computes it. With prefetch, part k+1's read is issued while
part k computes (a double buffer), so a call costs about max(compute, read) per part instead of
compute + read.

Two halves:
- `PartStreamer`: a real CPU runtime of that scheme. It keeps at most `resident` part sessions
  alive (the DRAM budget, in parts) and, with prefetch, builds the next part's session on a
  thread while the current part runs — on this machine "load" = read the part's weight file and
  prepare an onnxruntime session, the CPU analogue of a flash read + NPU graph load.
- `predict`: the phone-side effect from the cost model (toolchain/cost/model.py): per-part
  flash, DRAM and compute times under a DRAM budget, for serial loading and for prefetch, with
  the staging buffer a double buffer needs taken out of the resident budget.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from toolchain.cost.model import CostModel, GraphCost, Residency
from toolchain.runtime.sessions import ArtifactSessions, session_options


# ---- prediction ------------------------------------------------------------------------------
def split_cost(cost: GraphCost, n_parts: int) -> list[GraphCost]:
    """A whole-model call cost cut into n parts of whole layers with about equal weight bytes.

    FLOPs and KV bytes are shared out by layer count; shared weights (embedding, lm_head, final
    norm) ride in the last part, where the head runs.
    """
    layers = sorted(cost.layer_weight_bytes)
    n_parts = max(1, min(n_parts, len(layers)))
    total = sum(cost.layer_weight_bytes.values())
    groups: list[list[int]] = [[] for _ in range(n_parts)]
    acc = 0
    for layer in layers:
        k = min(n_parts - 1, int(acc * n_parts / max(total, 1)))
        groups[k].append(layer)
        acc += cost.layer_weight_bytes[layer]
    groups = [g for g in groups if g]
    parts = []
    per_layer_flops = cost.flops_per_token / max(len(layers), 1)
    for i, g in enumerate(groups):
        last = i == len(groups) - 1
        share = len(g) / len(layers)
        parts.append(replace(
            cost, layer_weight_bytes={j: cost.layer_weight_bytes[j] for j in g},
            shared_weight_bytes=cost.shared_weight_bytes if last else 0,
            flops_per_token=per_layer_flops * len(g), kv_bytes=int(cost.kv_bytes * share),
            io_bytes=int(cost.io_bytes * share), calls=1, name=f"{cost.name}_part{i}"))
    return parts


def _part_times(cm: CostModel, part: GraphCost, residency: Residency) -> tuple[float, float]:
    """(flash read seconds, on-chip seconds incl. call overhead) of one part."""
    p = cm.profile
    resident, flash = residency.split(part)
    dram_b = resident + flash + part.kv_bytes + part.io_bytes
    on_chip = max(dram_b / p.dram_bytes_per_s, part.flops / p.ops_per_s(part.precision) if part.flops else 0.0)
    return flash / p.flash_bytes_per_s, on_chip + part.calls * p.call_overhead_ms * 1e-3


def _plan(parts: list[GraphCost], budget: float) -> Residency:
    """Whole parts resident from the first, shared weights with the part that holds them."""
    left, resident, shared = budget, set(), False
    for part in parts:
        if part.weight_bytes > left:
            break
        resident |= set(part.layer_weight_bytes)
        shared = shared or part.shared_weight_bytes > 0
        left -= part.weight_bytes
    return Residency(frozenset(resident), shared, budget)


def predict(cost: GraphCost, device: str, dram_budget: float, n_parts: int, calls: int = 8) -> dict[str, Any]:
    """Predicted phone seconds per call, serial loading vs prefetch, under a DRAM budget.

    dram_budget: a fraction of the weights (<= 1) or bytes. Prefetch needs a staging buffer as
    large as the largest streamed part (two for prefetch, one for serial loading), taken from
    the budget before parts are made resident.
    Steady state over `calls` consecutive calls (part 0 of the next call is prefetched during
    the last part of this one).
    """
    cm = CostModel(device, dram_budget)
    parts = split_cost(cost, n_parts)
    budget = cm.budget_bytes(cost)
    # a streamed part needs a staging buffer: one for serial loading, two for prefetch (double buffer)
    staging = max(p.weight_bytes for p in parts) if budget < cost.weight_bytes else 0
    serial_res = _plan(parts, max(0.0, budget - staging))
    serial = sum(sum(_part_times(cm, p, serial_res)) for p in parts)
    pre_res = _plan(parts, max(0.0, budget - 2 * staging))
    times = [_part_times(cm, p, pre_res) for p in parts] * calls
    load_done = compute_end = compute_start = 0.0
    ends = []
    for i, (read, run) in enumerate(times):
        start_read = load_done if i == 0 else max(load_done, compute_start)  # double buffer: read k+1 while k runs
        load_done = start_read + read
        compute_start = max(compute_end, load_done)
        compute_end = compute_start + run
        ends.append(compute_end)
    k = len(parts)
    prefetch = (ends[-1] - ends[-1 - k]) if calls > 1 else ends[-1]
    streamed = [i for i, p in enumerate(parts) if not set(p.layer_weight_bytes) <= pre_res.resident_layers]
    return {"device": cm.profile.name if hasattr(cm.profile, "name") else device, "dram_budget": dram_budget,
            "budget_bytes": budget, "parts": len(parts), "weight_bytes": cost.weight_bytes,
            "streamed_parts_serial": sum(1 for p in parts if not set(p.layer_weight_bytes) <= serial_res.resident_layers),
            "streamed_parts_prefetch": len(streamed), "serial_ms": 1e3 * serial, "prefetch_ms": 1e3 * prefetch,
            "speedup": serial / prefetch if prefetch else None}


# ---- a real part-streaming runtime on CPU ------------------------------------------------------
@dataclass
class StreamStats:
    calls: int = 0
    seconds: float = 0.0
    load_s: float = 0.0  # session builds (on the critical path when not prefetched)
    wait_s: float = 0.0  # time the chain waited for a prefetched part


class PartStreamer:
    """Runs a family's part chain keeping at most `resident` sessions alive; optional prefetch."""

    def __init__(self, folder: str | Path, family: str, resident: int = 1, prefetch: bool = True,
                 threads: int | None = None):
        self.sessions = ArtifactSessions(folder, threads=threads)
        self.chain = self.sessions.chain(family)
        self.resident = max(1, resident)
        self.prefetch = prefetch
        self.threads = threads
        self._live: dict[str, ort.InferenceSession] = {}
        self._order: list[str] = []
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mobc-prefetch")
        self._next: tuple[str, Future] | None = None
        self._lock = threading.Lock()
        self.stats = StreamStats()

    def _build(self, name: str) -> ort.InferenceSession:
        path = self.sessions.folder / self.sessions.stages[name].file
        return ort.InferenceSession(str(path), session_options(self.threads), providers=["CPUExecutionProvider"])

    def _get(self, name: str) -> ort.InferenceSession:
        if name in self._live:
            return self._live[name]
        t = time.perf_counter()
        if self._next and self._next[0] == name:
            sess = self._next[1].result()
            self.stats.wait_s += time.perf_counter() - t
            self._next = None
        else:
            sess = self._build(name)
            self.stats.load_s += time.perf_counter() - t
        self._admit(name, sess)
        return sess

    def _admit(self, name: str, sess: ort.InferenceSession) -> None:
        # the DRAM budget: evict the least recently used parts beyond `resident`
        self._live[name] = sess
        self._order.append(name)
        while len(self._order) > self.resident:
            self._live.pop(self._order.pop(0), None)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        t = time.perf_counter()
        values = dict(feeds)
        for i, stage in enumerate(self.chain):
            sess = self._get(stage.name)
            if self.prefetch and len(self.chain) > self.resident:
                nxt = self.chain[(i + 1) % len(self.chain)].name  # wraps: the next call's first part
                if nxt not in self._live and not (self._next and self._next[0] == nxt):
                    self._next = (nxt, self._pool.submit(self._build, nxt))
            outs = sess.run(stage.output_names, {k: values[k] for k in stage.input_names})
            values.update(zip(stage.output_names, outs, strict=True))
        self.stats.calls += 1
        self.stats.seconds += time.perf_counter() - t
        produced = {o for s in self.chain for o in s.output_names}
        consumed = {i for s in self.chain for i in s.input_names}
        return {k: values[k] for k in produced - consumed}

    def close(self) -> None:
        if self._next:
            self._next[1].result()
            self._next = None
        self._pool.shutdown(wait=True)
        self._live.clear()
