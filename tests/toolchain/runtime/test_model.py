"""StepModel.feed: prompts laid out in windows as onnxruntime-genai lays them out, same numbers."""

from __future__ import annotations

import numpy as np

from toolchain.runtime.model import StepModel

PROMPT = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]  # 11 tokens: windows of 4 hold 3 + 4 + 4


def test_feed_puts_the_remainder_first_in_the_last_rows(tiny_artifact, monkeypatch):
    model = StepModel(tiny_artifact)
    calls = []
    forward = StepModel.forward

    def spy(self, tokens, *args, **kw):
        calls.append((len(tokens), self.family_for(len(tokens)), kw.get("first_row", 0)))
        return forward(self, tokens, *args, **kw)

    monkeypatch.setattr(StepModel, "forward", spy)
    model.prefill(PROMPT)
    assert calls == [(3, "prefill", 1), (4, "prefill", 0), (4, "prefill", 0)]
    assert model.length == len(PROMPT)


def test_feed_computes_what_token_by_token_decoding_computes(tiny_artifact):
    """Rows placed after padding rows are committed to the right slots and see the right past."""
    windows = StepModel(tiny_artifact)
    last = windows.prefill(PROMPT)
    steps = StepModel(tiny_artifact)
    steps.reset()
    for tok in PROMPT:
        ref = steps.forward([tok], family="decode")
        steps.commit([0])
    np.testing.assert_allclose(last, ref[0], atol=1e-4)
    for mine, theirs in zip(windows.cache.keys + windows.cache.values, steps.cache.keys + steps.cache.values, strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)


def test_a_shifted_call_returns_and_commits_its_own_rows(tiny_artifact):
    model = StepModel(tiny_artifact)
    model.reset()
    plain = model.forward(PROMPT[:3], family="prefill")
    shifted = model.forward(PROMPT[:3], family="prefill", first_row=1)
    np.testing.assert_allclose(shifted, plain, atol=1e-5)
    model.commit([0, 2])  # rows 1 and 3 of the call: tokens 0 and 2
    rows = model._last[1]
    np.testing.assert_array_equal(model.cache.keys[0][..., :2], rows["new_key_0"][..., [1, 3]])
