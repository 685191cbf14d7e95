"""Checks shared by the speculative-policy tests: what a draft or target cache must hold after a round."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from toolchain.runtime.model import StepModel

_FRESH: dict = {}  # folder -> a StepModel of its own for the from-scratch reference (sessions are slow to open)


def assert_cache_holds(model: StepModel, text: Sequence[int], committed: int | None = None,
                       atol: float = 1e-4) -> None:
    """The model's cache rows are those of `text` fed from scratch, and there are at most `committed`
    of them (default len(text)): a rejected token left behind by a missing rollback, a scratch row
    kept or a row not moved shows up here. `text` may run past what was emitted (ar's continuation)."""
    n = model.length
    committed = len(text) if committed is None else committed
    assert n <= committed, f"{model.name} holds {n} rows but only {committed} tokens are committed"
    if n == 0:
        return
    fresh = _FRESH.get(model.folder) or _FRESH.setdefault(model.folder, StepModel(model.folder))
    fresh.prefill(list(text[:n]))
    for i in range(model.cache.layout.n_layers):
        np.testing.assert_allclose(model.cache.keys[i][..., :n], fresh.cache.keys[i][..., :n], atol=atol,
                                   err_msg=f"{model.name} key rows of layer {i}")
        np.testing.assert_allclose(model.cache.values[i][:, :, :n], fresh.cache.values[i][:, :, :n],
                                   atol=atol, err_msg=f"{model.name} value rows of layer {i}")
