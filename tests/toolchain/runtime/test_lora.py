"""Runtime on a tiny artifact compiled with mha_to_sha + lora_inputs + forecast_inputs:
per-request and per-row adapters, CTG == sequential runs, DS2D == greedy AR."""

from __future__ import annotations

import numpy as np
import pytest

from tests.lora_tiny import M
from tests.tiny import tiny_tokenizer
from tests.toolchain.runtime.speculative import chi2_of, target_second_token
from tests.toolchain.runtime.test_sampling import CHI2_5DOF_P001
from toolchain.runtime.adapters import Adapter
from toolchain.runtime.model import StepModel
from toolchain.runtime.policies import Sampler, make_policy
from toolchain.runtime.policies.ctg import bind_adapters, sequential_styles
from toolchain.runtime.policies.ds2d import DS2D


@pytest.fixture
def artifact(lora_artifact):
    return lora_artifact[0]


def _adapter(model: StepModel, seed: int, rank: int = 4) -> Adapter:
    """A random adapter in graph layout, shaped from the artifact's inputs."""
    rng = np.random.default_rng(seed)
    ins = {i.name: i.shape for i in model.manifest.graphs[0].inputs}
    weights = {}
    for name, shape in ins.items():
        if name.startswith("lora_A."):
            proj = name[7:]
            out = sum(s[1] for n, s in ins.items() if n == f"lora_B.{proj}" or n.startswith(f"lora_B.{proj}.head"))
            weights[proj] = (rng.standard_normal((shape[0], rank)).astype(np.float32) * 0.5,
                             rng.standard_normal((rank, out)).astype(np.float32) * 0.5)
    return Adapter(f"rand{seed}", rank, weights)


def _prompt() -> list[int]:
    return tiny_tokenizer()("def main(argv):\n    return").input_ids


def _greedy(model: StepModel, n: int = 10) -> list[int]:
    pol = make_policy("ar", model)
    return [t for chunk in pol.generate(_prompt(), n, Sampler()) for t in chunk]


def test_adapter_per_request_changes_output_without_recompile(artifact):
    model = StepModel(artifact)
    base = _greedy(model)
    x, y = _adapter(model, 1), _adapter(model, 2)
    bind_adapters(model, [x])
    out_x = _greedy(model)
    bind_adapters(model, [y])
    out_y = _greedy(model)
    bind_adapters(model, [])
    assert _greedy(model) == base  # zero adapters: the base model again
    assert out_x != base and out_y != base and out_x != out_y


def test_mixed_batch_rows_match_single_adapter_calls(artifact):
    """One ctg call with rows [x, y, base] equals three calls with one adapter each."""
    model = StepModel(artifact)
    x, y = _adapter(model, 1), _adapter(model, 2)
    prompt = _prompt()
    rows_want = []
    for ad in (x, y, None):
        bind_adapters(model, [ad] if ad else [], None)  # shared prefix on the base model
        model.prefill(prompt[:-1])
        bind_adapters(model, [ad] if ad else [], 0 if ad else None, ["ctg"])
        rows_want.append(model.forward([prompt[-1]], family="ctg")[0])
    bind_adapters(model, [x, y], None)
    model.prefill(prompt[:-1])
    bind_adapters(model, [x, y], [0, 1, None], ["ctg"])
    depth = [0, 0, 0]  # three copies of the last token at the same position, each seeing only itself
    got = model.forward([prompt[-1]] * 3, np.eye(3, dtype=bool), depth, family="ctg")
    for j in range(3):
        np.testing.assert_allclose(got[j], rows_want[j], atol=1e-4)


def test_ctg_equals_sequential_runs(artifact):
    model = StepModel(artifact)
    styles = [_adapter(model, 1), _adapter(model, 2), None, _adapter(model, 3)]
    pol = make_policy("ctg", model, styles=styles)
    steps = list(pol.generate(_prompt(), 8, Sampler()))
    assert len(steps[0]) == 4 and pol.stats.n_target_calls == len(steps)
    seq = sequential_styles(model, _prompt(), styles, 8, Sampler())
    assert pol.outputs == seq
    assert len({tuple(o) for o in seq}) == 4  # the styles really differ


def test_sampled_ctg_styles_each_follow_their_model(artifact):
    """Two base-model styles sampled at temperature 0.1: each style's second token follows the model's
    distribution (chi-square, 5 dof, p = 0.001) and the two styles draw independently (equal second
    tokens about as often as two independent draws, measured 0.08, not always)."""
    model = StepModel(artifact)
    ids = tiny_tokenizer()("def f(x):\n    return").input_ids  # first token nearly fixed at 0.1 (p 0.94)
    mode, top, probs = target_second_token(StepModel(artifact), ids, 0.1)
    pol = make_policy("ctg", model, styles=[None, None])
    seconds: list[list[int]] = [[], []]
    same = both = 0
    for seed in range(150):
        list(pol.generate(ids, 2, Sampler(0.1, seed=seed)))
        firsts = [o[0] == mode for o in pol.outputs]
        for j, o in enumerate(pol.outputs):
            if firsts[j]:
                seconds[j].append(o[1])
        if all(firsts):
            both += 1
            same += pol.outputs[0][1] == pol.outputs[1][1]
    for j in range(2):
        r = chi2_of(seconds[j], top, probs)
        assert r["chi2"] < CHI2_5DOF_P001, (j, r)
    expected_same = float((probs[:5] ** 2).sum())  # a lower bound on P(equal) for independent draws
    assert both > 100 and same / both < expected_same + 0.2, (same, both, expected_same)


def test_ds2d_refuses_sampling(artifact):
    from toolchain.errors import MobcError

    model = StepModel(artifact)
    forecast = np.zeros((M, model.manifest.model.hidden), np.float32)
    with pytest.raises(MobcError, match="ds2d verifies greedily; use --temperature 0"):
        list(make_policy("ds2d", model, forecast=forecast).generate(_prompt(), 4, Sampler(0.5)))


def test_ctg_rejects_more_adapters_than_slots(artifact):
    model = StepModel(artifact)
    ads = [_adapter(model, s) for s in range(4)]
    with pytest.raises(Exception, match="slots"):
        list(make_policy("ctg", model, styles=ads).generate(_prompt(), 2, Sampler()))


class _Oracle(DS2D):
    """Drafts from the known greedy continuation, the last one corrupted: exercises full and partial acceptance."""

    ref: list[int] = []

    def _round(self, pending, drafts):
        a, nxt, _ = super()._round(pending, drafts)
        done = self.stats.tokens + a + 1
        new = list(self.ref[done : done + self.k])
        if len(new) == self.k and done % 3 == 0:
            new[-1] = (new[-1] + 1) % self.target.vocab
        return a, nxt, new


def test_ds2d_equals_greedy_ar(artifact):
    model = StepModel(artifact)
    rng = np.random.default_rng(0)
    forecast = rng.standard_normal((M, model.manifest.model.hidden)).astype(np.float32)
    for prompt_text in ("def main(argv):\n    return", "import os\nclass Path", "x = [i for i in"):
        prompt = tiny_tokenizer()(prompt_text).input_ids
        ar = [t for c in make_policy("ar", model).generate(prompt, 16, Sampler()) for t in c]
        for depth in (None, 1):  # k = m drafts per round (width 9), and k = 1 (width 4)
            ds = make_policy("ds2d", model, forecast=forecast, depth=depth)
            assert [t for c in ds.generate(prompt, 16, Sampler()) for t in c] == ar
        oracle = _Oracle(model, None, forecast)
        oracle.ref = ar
        assert [t for c in oracle.generate(prompt, 16, Sampler()) for t in c] == ar
        assert max(oracle.stats.accepted) == M and 0 < np.mean(oracle.stats.accepted) < M
    # a prompt that leaves no room for a forecast round: the rest comes from plain target steps
    prompt = list(rng.integers(3, 500, size=model.context - 12))
    ar = [t for c in make_policy("ar", model).generate(prompt, 100, Sampler()) for t in c]
    ds = make_policy("ds2d", model, forecast=forecast)
    assert [t for c in ds.generate(prompt, 100, Sampler()) for t in c] == ar and len(ar) < 100
    assert ds.stats.tokens == len(ar)
