"""CpuPrices.measure: the keys a decision compares are timed in turn, round by round, median per key."""

from __future__ import annotations

from toolchain.cost.prices import CpuPrices


class Recording(CpuPrices):
    """CpuPrices whose clock is a script: each key's calls return its listed times in order."""

    def __init__(self, script: dict[str, list[float]]):
        super().__init__(model=None)
        self.script = {k: list(v) for k, v in script.items()}
        self.order: list[str] = []

    def _time_once(self, key: str) -> float:
        self.order.append(key)
        return self.script[key].pop(0)


def test_measure_interleaves_the_keys_and_keeps_each_ones_median():
    # first call of each key is the warm-up (discarded); then three rounds
    p = Recording({"decode": [9.0, 1.0, 5.0, 1.2], "verify3": [9.0, 1.1, 1.3, 7.0]})
    p.measure(["decode", "verify3", "decode"], rounds=3)  # a repeated key is timed once per round
    assert p.order == ["decode", "verify3"] * 4
    assert p.seconds("decode") == 1.2 and p.seconds("verify3") == 1.3


def test_cpu_lever_prices_every_key_it_compares_side_by_side(tree_artifacts, monkeypatch):
    from toolchain.runtime.model import StepModel
    from toolchain.runtime.policies.lever import Lever, LeverConfig

    def one_by_one(self, key):
        raise AssertionError(f"{key} priced on its own, not beside the keys it is compared with")

    monkeypatch.setattr(CpuPrices, "_price", one_by_one)
    target_dir, draft_dir = tree_artifacts
    lever = Lever(StepModel(target_dir), StepModel(draft_dir), LeverConfig(cost="cpu"))
    keys = lever._verify_keys()
    assert {"decode", "tree4", "tree8"} <= set(keys) and any(k.startswith("body:") for k in keys)
    assert all(lever.builder.verify.by_width[w] > 0 for w in (1, 4, 8))
