"""Prices of graph calls for tree policies: predicted phone seconds or measured CPU seconds.

A StepModel counts its calls under keys: a family name (every stage of it), `body:<family>`
(every stage but its lm_head) and `stage:<graph>` (one stage). `PhonePrices` prices each key
with the cost model (one residency for the whole model, placed on its decode family, as the
bench does); `CpuPrices` times the calls on this machine. Tree policies read the same
prices to decide (tree width, depth, batch, path-only logits) and the bench reads them to
report predicted phone time, so the decision and the report agree.
"""

from __future__ import annotations

import time
from collections import Counter
from functools import cache
from typing import TYPE_CHECKING

import numpy as np

from toolchain.cost.model import CostModel, GraphCost

if TYPE_CHECKING:  # prices read a model's call counters; the runtime imports this module, not back
    from toolchain.runtime.model import StepModel


@cache
def _stage_cost(path: str, name: str, width: int) -> GraphCost:
    from toolchain.cost.onnx_graph import graph_cost

    return graph_cost(path, width=width, name=name)  # parts take residual_k, not input_ids: say the width


def _sum(costs: list[GraphCost]) -> GraphCost:
    total = costs[0]
    for c in costs[1:]:
        total = total + c
    return total


class Prices:
    """seconds(key) for one model; subclasses say how a key's stages are priced."""

    def __init__(self, model: StepModel):
        self.model = model
        self._memo: dict[str, float] = {}

    def stages(self, key: str) -> list:
        s = self.model.sessions
        kind, _, rest = key.partition(":")
        if not rest:
            return s.chain(key)
        if kind == "body":
            return [st for st in s.chain(rest) if st.role != "lm_head"]
        if kind == "stage":
            return [s.stages[rest]]
        if kind == "tail":  # stages from a part onward, e.g. tail:tree16:1 (pruned verification)
            fam, _, start = rest.rpartition(":")
            return [st for st in s.chain(fam) if st.role != "lm_head" and st.stage >= int(start)]
        if kind == "head":  # stages up to (excluding) a part, e.g. head:tree32:1
            fam, _, stop = rest.rpartition(":")
            return [st for st in s.chain(fam) if st.stage < int(stop)]
        raise KeyError(key)

    def seconds(self, key: str) -> float:
        if key not in self._memo:
            self._memo[key] = self._price(key)
        return self._memo[key]

    def _price(self, key: str) -> float:
        raise NotImplementedError

    def total(self, calls: Counter[str]) -> float:
        return sum(n * self.seconds(k) for k, n in calls.items())


class PhonePrices(Prices):
    def __init__(self, model: StepModel, device: str, dram_budget: float):
        super().__init__(model)
        self.device = device
        self.dram_budget = dram_budget
        self.cost_model = CostModel(device, dram_budget)
        self.cost_model.place(self.cost(model.decode_family))

    def cost(self, key: str) -> GraphCost:
        return _sum([_stage_cost(str(self.model.folder / st.file), st.name, st.width) for st in self.stages(key)])

    def _price(self, key: str) -> float:
        return self.cost_model.call_latency(self.cost(key)).total_s

    def flops(self, key: str) -> float:
        return self.cost(key).flops


class CpuPrices(Prices):
    """Each key timed on this machine (best of `repeats` calls on an empty cache, zero inputs)."""

    def __init__(self, model: StepModel, repeats: int = 2):
        super().__init__(model)
        self.repeats = repeats

    def _price(self, key: str) -> float:
        best = float("inf")
        for _ in range(self.repeats):
            best = min(best, self._time_once(key))
        return best

    def _time_once(self, key: str) -> float:
        t = time.perf_counter()
        for st in self.stages(key):
            feeds = {}
            for name in st.input_names:
                shape, dtype = st.input_shape(name)
                feeds[name] = np.zeros(shape, np.dtype(dtype))
            self.model.sessions.run_stage(st, feeds)
        return time.perf_counter() - t

    def measure(self, keys: list[str], rounds: int = 5) -> None:
        """Price these keys together: one call of each per round, in turn, the median per key. A
        decision compares keys (a 3-row verify against a decode step), and timing each key's calls
        back to back let the machine's drift decide: best-of-2 put the 3-row verify at 0.94x-1.22x a
        decode step in three start-ups of the same process (this way: 1.04x-1.13x)."""
        times: dict[str, list[float]] = {k: [] for k in dict.fromkeys(keys)}
        for k in times:
            self._time_once(k)  # warm: first calls allocate
        for _ in range(rounds):
            for k in times:
                times[k].append(self._time_once(k))
        self._memo.update({k: float(np.median(v)) for k, v in times.items()})
