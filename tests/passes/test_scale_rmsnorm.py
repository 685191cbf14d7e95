"""scale_rmsnorm on tiny models of every architecture: the invariant, and numerics on the CPU EP."""

from __future__ import annotations

import numpy as np
import pytest

from passes import build
from tests.passes.tiny import feeds_for, tiny
from toolchain.compile.pass_runner import ort_run
from toolchain.errors import RecipeError
from toolchain.ir.graphset import GraphEntry
from toolchain.qnn.diagnose import htp_findings


def _run(model, layout, feeds):
    entry = GraphEntry(
        name="g", model=model, family="g", role="decode", width=layout.width, context=layout.context
    )
    return ort_run(entry, feeds)


def _norm_count(model) -> int:
    return sum(1 for n in model.graph if n.op_type == "ReduceMean")


@pytest.mark.parametrize("scale", ["dynamic", 2.0**-8])
def test_scale_rmsnorm_rewrites_every_norm_exactly(arch, scale):
    layout, model = tiny(arch)
    feeds = feeds_for(layout)
    before = _run(model, layout, feeds)
    norms = _norm_count(model)
    assert len(htp_findings(model)) == norms > 0  # the raw export squares with Pow everywhere
    p = build({"scale_rmsnorm": {"scale": scale}})
    assert p(model).modified
    p.ensures(model)
    assert htp_findings(model) == []
    assert not any(n.op_type == "Pow" for n in model.graph)
    squares = [n for n in model.graph if "/Mul_square" in n.name]
    assert len(squares) == norms
    scaled = [n for n in model.graph if "/Div_scale" in n.name or "/Mul_scale" in n.name]
    head_norms = sum(1 for n in squares if "q_norm" in n.name or "k_norm" in n.name)
    assert len(scaled) == norms - head_norms  # q/k norms are rewritten with s = 1
    after = _run(model, layout, feeds)
    for name, ref in before.items():
        diff = float(np.abs(after[name] - ref).max())
        if scale == "dynamic":
            assert diff < 1e-5, (name, diff)
        else:
            assert diff == 0.0, (name, diff)  # a power-of-two scale is bit-exact


def test_scale_rmsnorm_is_idempotent():
    _, model = tiny("llama")
    p = build("scale_rmsnorm")
    assert p(model).modified
    assert not p(model).modified
    p.ensures(model)


def test_dynamic_scale_holds_at_fp16_breaking_magnitudes():
    """Inputs scaled to SmolLM2-like magnitudes (|x| ~ 2e4) and tiny ones stay exact on CPU."""
    layout, model = tiny("llama")
    emb = model.graph.initializers["embed_tokens.weight"]
    base = emb.const_value.numpy().copy()
    feeds = feeds_for(layout)
    for factor in (1e4, 1e-3):
        import onnx_ir as ir

        emb.const_value = ir.tensor(base * factor, name=emb.name)
        ref = _run(model, layout, feeds)
        rewritten = model.clone()
        build("scale_rmsnorm")(rewritten)
        got = _run(rewritten, layout, feeds)
        for name in ref:
            scale = max(1.0, float(np.abs(ref[name]).max()))
            assert float(np.abs(got[name] - ref[name]).max()) / scale < 1e-5, (factor, name)


def test_scale_must_be_a_power_of_two():
    with pytest.raises(RecipeError, match="power of two"):
        build({"scale_rmsnorm": {"scale": 0.003}})
    with pytest.raises(RecipeError, match="unknown option"):
        build({"scale_rmsnorm": {"factor": 2}})
