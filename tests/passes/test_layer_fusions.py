"""fuse_attention_prologue and fuse_silu_mul on tiny models: every Llama-style layer's split,
rotations and cache attention become one QKVCacheAttention and its gated MLP one SiluMul, keeping the
graph's numbers and its new_key/new_value outputs; layers in another form (q/k norms, GELU) and layout
chains that move elements differently from the fused op are left alone."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from passes import build
from tests.passes.tiny import feeds_for, graphset_for, tiny
from toolchain import kernels
from toolchain.compile.pass_runner import ort_run, run_passes
from toolchain.ir.graphset import GraphEntry

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler for mobc's CPU kernels")

BEFORE = ["fold_constants", "fuse_projections", "fuse_rmsnorm", "fuse_rotary", "attend_past_in_place",
          "simplify_layout", "cache_attention"]


def _ops(model) -> list[str]:
    return [n.op_type for n in model.graph]


def _prepared(arch: str, width: int):
    layout, model = tiny(arch, width)
    for name in BEFORE:
        build(name)(model)
    return layout, model


def _run(model, layout):
    entry = GraphEntry(name="g", model=model, family="g", role="decode", width=layout.width, context=layout.context)
    return ort_run(entry, feeds_for(layout))


def test_a_wide_graph_attends_through_the_fused_op_with_every_width():
    """A 16-row graph (a prefill's shape: wider than attend_past_in_place's rule admits) with
    `every_width`: each layer ends as one QKVCacheAttention and the numbers hold."""
    gs, feeds = graphset_for("llama", (16,))
    passes = [{"attend_past_in_place": {"every_width": True}} if p == "attend_past_in_place" else p for p in BEFORE]
    out, rows = run_passes(gs, [*passes, "fuse_attention_prologue"], 1e-4, feeds)
    model = next(iter(out.entries.values())).model
    assert _ops(model).count("QKVCacheAttention") == tiny("llama", 16)[0].n_layers
    assert all(r["worst"]["diff"] < 1e-5 for r in rows)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: the fused projection carries biases
def test_every_layer_fuses_and_numerics_hold(arch):
    gs, feeds = graphset_for(arch, (1, 4))
    out, rows = run_passes(gs, [*BEFORE, "fuse_attention_prologue", "fuse_silu_mul"], 1e-4, feeds)
    assert [r["pass"] for r in rows[-2:]] == ["fuse_attention_prologue", "fuse_silu_mul"]
    assert all(r["worst"]["diff"] < 1e-5 for r in rows[-2:])
    layers = tiny(arch, 1)[0].n_layers
    for entry in out.entries.values():
        ops = _ops(entry.model)
        assert ops.count("QKVCacheAttention") == layers and ops.count("SiluMul") == layers
        for gone in ("CacheAttention", "RotaryEmbedding", "Split", "Sigmoid", "Transpose"):
            assert gone not in ops, (entry.name, gone)
        outputs = {v.name: v.producer().op_type for v in entry.model.graph.outputs}
        assert all(outputs[f"new_{kind}_{i}"] == "QKVCacheAttention" for kind in ("key", "value") for i in range(layers))
        build("fuse_attention_prologue").ensures(entry.model)
        build("fuse_silu_mul").ensures(entry.model)


def test_decode_step_loses_most_of_its_nodes():
    layout, model = _prepared("llama", 1)
    before = len(_ops(model))
    build("fuse_attention_prologue")(model)
    build("fuse_silu_mul")(model)
    # per layer, Split, 6 Reshapes, 2 RotaryEmbeddings and CacheAttention become QKVCacheAttention,
    # and Split, Sigmoid and 2 Muls become SiluMul
    assert len(_ops(model)) == before - layout.n_layers * (10 - 1 + 4 - 1)


@pytest.mark.parametrize("arch,silu", [("qwen3", True), ("gemma3", False)])
def test_other_layer_forms_are_left_alone(arch, silu):
    """q/k norms sit between the split and the rotations (Qwen3, Gemma 3); Gemma's MLP is GELU."""
    layout, model = _prepared(arch, 4)
    ops = _ops(model)
    assert not build("fuse_attention_prologue")(model).modified
    assert _ops(model) == ops
    assert build("fuse_silu_mul")(model).modified is silu
    assert _ops(model).count("SiluMul") == (layout.n_layers if silu else 0)


def _q_transpose(model) -> ir.Node:
    """The first layer's Transpose of the queries into [1, H, N, D] (before their rotation)."""
    rot = next(n for n in model.graph if n.op_type == "RotaryEmbedding")
    node = rot.inputs[0].producer()
    assert node.op_type == "Transpose"
    return node


def test_a_chain_that_moves_elements_differently_is_not_fused():
    """The tiny Llama's width-4 call has 4 heads of 4 rows: a Transpose that leaves [1, N, H, D] as is
    still types as [1, H, N, D], but mixes rows with heads; the pass must refuse that layer."""
    layout, model = _prepared("llama", 4)
    bad = _q_transpose(model)
    bad.attributes["perm"] = ir.AttrInt64s("perm", [0, 1, 2, 3])
    want = _run(model, layout)
    build("fuse_attention_prologue")(model)
    ops = _ops(model)
    assert ops.count("QKVCacheAttention") == layout.n_layers - 1 and ops.count("CacheAttention") == 1
    got = _run(model, layout)
    assert max(float(np.abs(want[k] - got[k]).max()) for k in want) < 1e-5


def test_a_value_read_outside_the_pattern_keeps_its_layer_unfused():
    """The queries in head layout also feed a graph output: fusing would drop the node producing them."""
    layout, model = _prepared("llama", 4)
    heads = _q_transpose(model).outputs[0]
    model.graph.outputs.append(heads)
    want = _run(model, layout)
    build("fuse_attention_prologue")(model)
    assert _ops(model).count("QKVCacheAttention") == layout.n_layers - 1
    got = _run(model, layout)
    assert set(got) == set(want) and max(float(np.abs(want[k] - got[k]).max()) for k in want) < 1e-5


def test_an_interleaved_rotation_is_not_fused():
    layout, model = _prepared("llama", 4)
    rot = next(n for n in model.graph if n.op_type == "RotaryEmbedding")
    rot.attributes["interleaved"] = ir.AttrInt64("interleaved", 1)
    build("fuse_attention_prologue")(model)
    assert _ops(model).count("QKVCacheAttention") == layout.n_layers - 1


def test_skip_rmsnorm_takes_every_residual_add_into_its_norm(arch):
    """Each norm of a residual sum becomes one SkipSimplifiedLayerNormalization whose output 3 is
    the sum the next residual Add reads; only norms of something else (the embedding, q/k norms) stay."""
    gs, feeds = graphset_for(arch, (1, 4))
    out, rows = run_passes(gs, ["fold_constants", "fuse_projections", "fuse_rmsnorm", "fuse_skip_rmsnorm"], 1e-4, feeds)
    assert rows[-1]["pass"] == "fuse_skip_rmsnorm" and rows[-1]["worst"]["diff"] < 1e-5
    for entry in out.entries.values():
        fused = [n for n in entry.model.graph if n.op_type == "SkipSimplifiedLayerNormalization"]
        norms_of_sums = [n for n in entry.model.graph if n.op_type == "SimplifiedLayerNormalization"
                         and (p := n.inputs[0].producer()) is not None and p.op_type == "Add"]
        assert len(fused) >= 2 * tiny(arch, 1)[0].n_layers - 1 and not norms_of_sums
        assert all(n.outputs[3].uses() or n.outputs[3].is_graph_output() or n is fused[-1] for n in fused)
        build("fuse_skip_rmsnorm").ensures(entry.model)
