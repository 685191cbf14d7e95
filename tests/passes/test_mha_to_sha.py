"""mha_to_sha on tiny Llama, Qwen2 (qkv bias), Qwen3 (q/k norm), Gemma3 (q/k norm, 1 KV head, sliding)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from passes import build
from tests.passes.tiny import graphset_for, hf_model
from toolchain.compile.pass_runner import run_passes
from toolchain.ir.graph import shape_of


@pytest.fixture(scope="module")
def sha_sets():
    cache = {}

    def get(arch):
        if arch not in cache:
            gs, feeds = graphset_for(arch, (1, 4) if arch == "qwen2" else (4,))
            io = {e.name: ([(v.name, v.shape) for v in e.model.graph.inputs],
                           [(v.name, v.shape) for v in e.model.graph.outputs]) for e in gs.entries.values()}  # fmt: skip
            gs, rows = run_passes(gs, ["fold_constants", "mha_to_sha"], 1e-5, feeds)
            cache[arch] = gs, rows, io
        return cache[arch]

    return get


def test_numerics_and_kv_io_unchanged(arch, sha_sets):
    gs, rows, io = sha_sets(arch)
    assert rows[-1]["worst"]["diff"] < 1e-5
    for e in gs.entries.values():
        assert ([(v.name, v.shape) for v in e.model.graph.inputs],
                [(v.name, v.shape) for v in e.model.graph.outputs]) == io[e.name]  # fmt: skip


def test_every_attention_matmul_is_single_head(arch, sha_sets):
    gs, _, _ = sha_sets(arch)
    cfg = hf_model(arch).config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for e in gs.entries.values():
        model = e.model
        build("mha_to_sha").ensures(model)
        ops = {n.op_type for n in model.graph}
        assert not ops & {"Expand", "Tile"}, "GQA must not repeat KV heads"
        dynamic_mm = [
            n
            for n in model.graph
            if n.op_type == "MatMul"
            and "self_attn" in n.name
            and all(v.const_value is None for v in n.inputs)
        ]
        assert len(dynamic_mm) == 2 * cfg.num_attention_heads * cfg.num_hidden_layers
        for n in dynamic_mm:
            assert math.prod(shape_of(n.outputs[0])[:-2]) == 1
        projs = [n for n in model.graph if n.op_type == "MatMul" and "_proj.head" in n.name]
        assert len(projs) == (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.num_hidden_layers
        for n in projs:  # per-head weights are initializers, never sliced at run time
            w = n.inputs[1]
            assert w.is_initializer() and shape_of(w) == [cfg.hidden_size, head_dim]
            assert all(u.op_type != "Slice" for u, _ in w.uses())
        # the KV cache keeps one tensor per layer at the boundary
        for i in range(cfg.num_hidden_layers):
            for kind in ("key", "value"):
                out = next(v for v in model.graph.outputs if v.name == f"new_{kind}_{i}")
                assert shape_of(out)[0] == cfg.num_key_value_heads


def test_per_width_graphs_share_weight_bytes(sha_sets):
    gs, _, _ = sha_sets("qwen2")
    a, b = gs.entries["decode"].model.graph, gs.entries["w4"].model.graph
    big = {n: v for n, v in a.initializers.items() if v.const_value.size > 64}
    assert any(".h1" in n for n in big)
    for name, v in big.items():
        assert name in b.initializers, name
        np.testing.assert_array_equal(v.const_value.numpy(), b.initializers[name].const_value.numpy())


def test_composes_with_scaled_qk_norms():
    # scale_rmsnorm (dynamic) on the per-head q/k norms adds Abs/ReduceMax/Clip/Div: they stay
    # per head, so the only Splits are the two KV-cache inputs of each layer
    gs, feeds = graphset_for("qwen3", (4,))
    specs = ["fold_constants", {"scale_rmsnorm": {"unscaled": []}}, "mha_to_sha"]
    gs, rows = run_passes(gs, specs, 1e-5, feeds)
    model = gs.entries["w4"].model
    build("mha_to_sha").ensures(model)
    splits = [n for n in model.graph if n.op_type == "Split"]
    assert sorted(n.inputs[0].name for n in splits) == sorted(
        f"past_{k}_{i}" for i in range(2) for k in ("key", "value")
    )
