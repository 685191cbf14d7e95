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


def _spy_calls(monkeypatch) -> list[tuple[int, str]]:
    calls = []
    forward = StepModel.forward

    def spy(self, tokens, *args, **kw):
        calls.append((len(tokens), kw.get("family") or self.family_for(len(tokens))))
        return forward(self, tokens, *args, **kw)

    monkeypatch.setattr(StepModel, "forward", spy)
    return calls


def test_a_short_first_prompt_runs_through_the_decode_graph_alone(tiny_artifact, monkeypatch):
    """No prompt-width session is opened for a 3-token prompt (its start-up and weights cost more
    than three decode calls); the numbers are the windowed prefill's."""
    windowed = StepModel(tiny_artifact)
    windowed.sessions.open_many([s.name for f in ("prefill", "decode") for s in windowed.sessions.chain(f)])
    ref = windowed.prefill(PROMPT[:3])  # a prompt-width session is open: the window path
    model = StepModel(tiny_artifact)
    calls = _spy_calls(monkeypatch)
    last = model.prefill(PROMPT[:3])
    assert calls == [(1, "decode")] * 3
    assert model.sessions.open_names() == {s.name for s in model.sessions.chain("decode")}
    np.testing.assert_allclose(last, ref, atol=1e-4)
    model.prefill(PROMPT)  # a long prompt: windows of the widest graph, opened with the decode graph
    assert calls[3:] == [(3, "prefill"), (4, "prefill"), (4, "prefill")]


def test_open_many_opens_sessions_that_compute_what_lazy_ones_do(tiny_artifact):
    eager, lazy = StepModel(tiny_artifact), StepModel(tiny_artifact)
    names = [s.name for f in eager.widths for s in eager.sessions.chain(f)]
    eager.sessions.open_many(names)
    assert eager.sessions.open_names() == set(names)
    for m in (eager, lazy):
        m.reset()
    np.testing.assert_array_equal(eager.forward(PROMPT[:4], family="prefill"), lazy.forward(PROMPT[:4], family="prefill"))


def test_open_ahead_sessions_are_the_ones_used_and_count_as_open(tiny_artifact, monkeypatch):
    """`mobc run` starts opening the decode graph before loading the tokenizer: the session it
    opened in the background is the one decoding then runs (not a second one), and the short-prompt
    rule sees it as open."""
    ref = StepModel(tiny_artifact).prefill(PROMPT[:3])
    model = StepModel(tiny_artifact)
    opened = []
    real_open = type(model.sessions)._open

    def spy(self, name):
        opened.append(name)
        return real_open(self, name)

    monkeypatch.setattr(type(model.sessions), "_open", spy)
    model.open_ahead()
    decode = {s.name for s in model.sessions.chain("decode")}
    assert model.sessions.open_names() == decode
    np.testing.assert_allclose(model.prefill(PROMPT[:3]), ref, atol=1e-5)
    assert sorted(opened) == sorted(decode)  # each opened once, in the background


def test_bound_calls_commit_stacked_rows_as_unbound_ones_do(tiny_artifact):
    """A bound family's new K/V outputs are views of one array per kind (one copy per commit for every
    layer); greedy decoding through them keeps the cache an unbound model keeps, row for row."""
    bound, plain = StepModel(tiny_artifact), StepModel(tiny_artifact, io_binding=False)
    for model in (bound, plain):
        last = model.prefill(PROMPT)
        for _ in range(5):
            last = model.forward([int(np.argmax(last))])
            model.commit([0])
    family, outs, _ = bound._last
    stacked = outs.stacked["new_key"]
    assert all(np.shares_memory(outs[f"new_key_{i}"], stacked) for i in range(len(bound.cache.keys)))
    for mine, theirs in zip(bound.cache.keys + bound.cache.values, plain.cache.keys + plain.cache.values, strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)
    assert bound.length == plain.length == len(PROMPT) + 5 and bound.cache.keys[0][..., bound.length - 1].any()
