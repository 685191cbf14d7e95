"""expose_features: a step graph also outputs `hidden`, the residual entering the final norm, which the
model's own final norm and lm_head turn into the graph's logits; nothing else changes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from passes import build
from tests.passes.tiny import feeds_for, hf_model, tiny
from toolchain.compile.pass_runner import ort_run
from toolchain.errors import PassError
from toolchain.ir.graphset import GraphEntry


def _run(model, layout):
    entry = GraphEntry(name="g", model=model, family="g", role="decode", width=layout.width,
                       context=layout.context)
    return ort_run(entry, feeds_for(layout))


def _head(arch: str, hidden: np.ndarray) -> np.ndarray:
    """The HF model's final norm, lm_head and soft-capping applied to `hidden`."""
    model = hf_model(arch)
    with torch.no_grad():
        logits = model.lm_head(model.model.norm(torch.from_numpy(hidden)))
        cap = getattr(model.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
    return logits.numpy()


@pytest.mark.parametrize("fused_first", [False, True])
def test_hidden_is_what_the_final_norm_reads(arch, fused_first):
    layout, model = tiny(arch, 4)
    before = _run(model, layout)
    if fused_first:  # the CPU form's order: after fuse_rmsnorm, the norm is one node
        build("fuse_rmsnorm")(model)
    p = build("expose_features")
    assert p(model).modified
    p.ensures(model)
    after = _run(model, layout)
    assert "hidden" not in before and after["hidden"].shape == (1, layout.width, layout.hidden)
    for name, ref in before.items():
        assert np.abs(after[name] - ref).max() < 1e-5, name  # the logits path is untouched
    np.testing.assert_allclose(_head(arch, after["hidden"]), after["logits"], atol=1e-4, rtol=1e-4)
    assert not build("expose_features")(model).modified  # a second run finds it exposed


def test_a_graph_without_the_exporters_norm_scope_is_refused():
    layout, model = tiny("llama", 1)
    for node in model.graph:
        if node.name.startswith("norm/"):
            node.name = "renamed/" + node.name
    with pytest.raises(PassError, match="expose_features.*'norm'"):
        build("expose_features")(model)
