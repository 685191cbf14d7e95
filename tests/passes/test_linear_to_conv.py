"""linear_to_conv on tiny Llama, Qwen2, Qwen3, Gemma3 (tied lm_head via Transpose), alone and after SHA."""

from __future__ import annotations

import pytest

from passes import build
from tests.passes.tiny import graphset_for
from toolchain.compile.pass_runner import run_passes
from toolchain.ir.graph import shape_of


@pytest.fixture(scope="module")
def conv_sets():
    cache = {}

    def get(arch, specs):
        key = (arch, str(specs))
        if key not in cache:
            gs, feeds = graphset_for(arch, (1, 4) if arch == "qwen2" else (4,))
            cache[key] = run_passes(gs, specs, 1e-5, feeds)
        return cache[key]

    return get


def _check(gs):
    p = build("linear_to_conv")
    for e in gs.entries.values():
        p.ensures(e.model)  # no MatMul/Gemm with a constant 2-D weight
        for n in e.model.graph:
            if n.op_type == "Conv":
                w = n.inputs[1]
                assert w.is_initializer() and shape_of(w)[2:] == [1, 1]
                assert shape_of(n.inputs[0])[2] == 1  # NCHW with H = 1: [1, C, 1, T]


def test_every_projection_becomes_a_conv(arch, conv_sets):
    gs, rows = conv_sets(arch, ["fold_constants", "linear_to_conv"])
    assert rows[-1]["worst"]["diff"] < 1e-5
    assert rows[-1]["ops_after"]["Conv"] == rows[0]["ops_after"]["MatMul"] - rows[-1]["ops_after"].get(
        "MatMul", 0
    )
    _check(gs)


def test_after_sha_and_mlp_stays_nchw(arch, conv_sets):
    gs, rows = conv_sets(arch, ["fold_constants", "mha_to_sha", "linear_to_conv"])
    assert rows[-1]["worst"]["diff"] < 1e-5
    _check(gs)
    model = next(iter(gs.entries.values())).model
    # gate/up -> activation -> product -> down: no layout change in between
    down = next(n for n in model.graph if n.op_type == "Conv" and "down_proj" in n.name)
    prod = down.inputs[0].producer()
    assert prod.op_type == "Mul" and shape_of(prod.outputs[0])[2] == 1
    assert all(v.producer().op_type != "Transpose" for v in prod.inputs)


def _run(arch, widths, specs):
    gs, feeds = graphset_for(arch, widths)
    return run_passes(gs, specs, 1e-5, feeds)


def test_decode_width_uses_reshapes_only():
    gs, _ = _run("qwen2", (1,), ["fold_constants", "linear_to_conv"])
    model = gs.entries["decode"].model
    conv_inputs = [n.inputs[0].producer() for n in model.graph if n.op_type == "Conv"]
    assert all(p.op_type in ("Reshape", "Mul", "Sigmoid") for p in conv_inputs)


def test_qkv_bias_is_folded_into_conv():
    gs, _ = _run("qwen2", (4,), ["fold_constants", "linear_to_conv"])
    convs = [n for n in gs.entries["w4"].model.graph if n.op_type == "Conv" and "_proj" in n.name]
    with_bias = [n.name for n in convs if len(n.inputs) == 3]
    assert len(with_bias) == 3 * 2  # q, k, v in both layers


def test_keep_layout_none_wraps_each_conv():
    specs = ["fold_constants", {"linear_to_conv": {"keep_layout": "none"}}]
    gs, _ = _run("llama", (4,), specs)
    model = gs.entries["w4"].model
    down = next(n for n in model.graph if n.op_type == "Conv" and "down_proj" in n.name)
    assert down.inputs[0].producer().op_type == "Transpose"


def test_weight_bytes_unchanged_even_for_tied_lm_head(conv_sets):
    # gemma3's lm_head is Transpose(embedding): its conv weight has the embedding's bytes, which
    # the artifact stores once, and the per-pass row reports bytes the same way
    _, rows = conv_sets("gemma3", ["fold_constants", "linear_to_conv"])
    grew = rows[-1]["weight_bytes_after"] - rows[-1]["weight_bytes_before"]
    assert 0 <= grew < 1024  # only the new int64 reshape targets


def test_widths_get_identical_conv_weights(conv_sets):
    gs, _ = conv_sets("qwen2", ["fold_constants", "mha_to_sha", "linear_to_conv"])
    a, b = gs.entries["decode"].model.graph, gs.entries["w4"].model.graph
    wa = {n.inputs[1].name: n.inputs[1].const_value.tobytes() for n in a if n.op_type == "Conv"}
    wb = {n.inputs[1].name: n.inputs[1].const_value.tobytes() for n in b if n.op_type == "Conv"}
    assert wa == wb and len(wa) == 2 * (4 + 2 + 2 + 1 + 3) + 1  # per layer: q/k/v heads, o, mlp; lm_head
