"""The CPU-form fusions on tiny models of every architecture: fuse_projections, fuse_rmsnorm and
attend_past_in_place each keep the graph's numbers, do what they promise to its structure, and
leave alone what their rules exclude."""

from __future__ import annotations

import numpy as np
import pytest

from passes import build
from tests.passes.test_matmul_nbits import _on_grids
from tests.passes.tiny import feeds_for, graphset_for, tiny
from toolchain.compile.pass_runner import ort_run, run_passes
from toolchain.ir.graphset import GraphEntry

CPU_FUSIONS = ["fuse_projections", "fuse_rmsnorm", "fuse_rotary", "attend_past_in_place"]


def _run(model, layout):
    entry = GraphEntry(name="g", model=model, family="g", role="decode", width=layout.width,
                       context=layout.context)
    return ort_run(entry, feeds_for(layout))


def _worst(a: dict, b: dict) -> float:
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def _ops(model) -> list[str]:
    return [n.op_type for n in model.graph]


@pytest.mark.parametrize("width", [1, 4])
def test_each_fusion_keeps_the_numbers(arch, width):
    layout, model = tiny(arch, width)
    before = _run(model, layout)
    for name in CPU_FUSIONS:
        p = build(name)
        assert p(model).modified, name
        p.ensures(model)
        assert _worst(before, _run(model, layout)) < 1e-5, name


def test_fuse_projections_groups_qkv_and_gate_up(arch):
    layout, model = tiny(arch, 4)
    layers = layout.n_layers
    matmuls = _ops(model).count("MatMul")
    build("fuse_projections")(model)
    names = [n.name for n in model.graph if n.op_type == "MatMul"]
    assert sum("q_proj_k_proj_v_proj" in n for n in names) == layers
    assert sum("gate_proj_up_proj" in n for n in names) == layers
    assert _ops(model).count("MatMul") == matmuls - 3 * layers  # 3 of 7 projections per layer are gone
    assert _ops(model).count("Split") >= 2 * layers


def test_fused_grid_weights_still_convert_exactly():
    """Concatenated columns keep every block on its GGUF grid: matmul_nbits converts the fused weights."""
    gs, feeds = graphset_for("llama", (1, 4))
    _on_grids(gs)
    out, rows = run_passes(gs, ["fold_constants", "fuse_projections", "matmul_nbits"], 1e-4, feeds)
    assert rows[-1]["worst"]["diff"] < 1e-4
    for entry in out.entries.values():
        ops = _ops(entry.model)
        assert ops.count("MatMulNBits") == 4 * 2 + 1  # qkv, o, gate_up, down per layer; the lm_head
        assert not any(n.op_type == "MatMul" and "proj" in n.name and "block_offset" not in n.name
                       for n in entry.model.graph)


def test_fuse_rmsnorm_replaces_every_norm(arch):
    layout, model = tiny(arch, 4)
    norms = _ops(model).count("ReduceMean")
    build("fuse_rmsnorm")(model)
    ops = _ops(model)
    assert ops.count("SimplifiedLayerNormalization") == norms
    assert "Pow" not in ops and "ReduceMean" not in ops and "Reciprocal" not in ops


def test_fuse_rmsnorm_leaves_a_norm_whose_unweighted_output_is_shared():
    layout, model = tiny("llama", 4)
    pow_node = next(n for n in model.graph if n.op_type == "Pow")
    from passes.fuse_rmsnorm import match

    m = match(pow_node)
    normed = m["muls"][0].outputs[0]
    out = model.graph.outputs[0]
    model.graph.outputs.append(normed)  # a second use of x*r: fusing would drop it
    build("fuse_rmsnorm")(model)
    assert normed in model.graph.outputs and normed.producer() is not None
    assert _ops(model).count("ReduceMean") == 1
    assert out in model.graph.outputs


def test_attend_past_in_place_drops_the_cache_copies(arch):
    layout, model = tiny(arch, 1)
    build("attend_past_in_place")(model)
    for node in model.graph:
        if node.op_type == "Concat":
            assert not any(v is not None and v.name.startswith(("past_key_", "past_value_")) for v in node.inputs)
    assert sum(1 for n in model.graph if n.name.endswith("/attend_past")) == layout.n_layers


def test_attend_past_in_place_keeps_wide_graphs():
    """A 16-row graph's scores (16 rows x 4 heads) outweigh the cache (2 x 2 heads x 16): left as it is."""
    layout, model = tiny("llama", 16)
    assert not build("attend_past_in_place")(model).modified


def test_attend_past_in_place_every_width_rewrites_wide_graphs_too():
    """The same 16-row graph with `every_width` (for recipes whose cache_attention takes the layer over
    next): every layer rewritten, numbers kept (checked end to end in test_layer_fusions)."""
    layout, model = tiny("llama", 16)
    assert build({"attend_past_in_place": {"every_width": True}})(model).modified
    assert sum(1 for n in model.graph if n.name.endswith("/attend_past")) == layout.n_layers


def test_check_htp_refuses_the_cpu_form():
    from toolchain.errors import PassError

    _, model = tiny("llama", 4)
    build("fuse_rmsnorm")(model)
    with pytest.raises(PassError, match="onnxruntime CPU op"):
        build("check_htp")(model)


def test_fuse_rotary_replaces_every_q_and_k_rotation(arch):
    layout, model = tiny(arch, 4)
    build("fuse_rotary")(model)
    ops = _ops(model)
    assert ops.count("RotaryEmbedding") == 2 * layout.n_layers
    assert "Neg" not in ops  # rotate_half's Neg is gone everywhere
    caches = {n.inputs[2].name for n in model.graph if n.op_type == "RotaryEmbedding"}
    assert len(caches) == len(layout.rope_kinds)  # one cos table per RoPE kind (Gemma 3: global, sliding)
