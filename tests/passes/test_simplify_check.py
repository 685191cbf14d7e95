"""simplify_layout and check_htp."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from passes import build
from tests.passes.tiny import graphset_for, tiny
from toolchain.compile.pass_runner import run_passes
from toolchain.errors import PassError
from toolchain.ir.graph import add_initializer, new_node


def test_simplify_layout_collapses_chains_and_keeps_scopes(arch):
    gs, feeds = graphset_for(arch, (4,))
    specs = ["fold_constants", "mha_to_sha", {"linear_to_conv": {"keep_layout": "none"}}, "simplify_layout"]
    gs, rows = run_passes(gs, specs, 1e-5, feeds)
    assert rows[-1]["nodes_after"] < rows[-1]["nodes_before"]
    assert rows[-1]["worst"]["diff"] < 1e-5
    model = gs.entries["w4"].model
    build("simplify_layout").ensures(model)
    assert not [n.name for n in model.graph if n.name.startswith("node_")]
    # layer prefixes survive, so the graph can still be cut into parts
    gs, rows = run_passes(gs, [{"split_layers": {"at": [1]}}], 1e-5, feeds)
    assert len(rows[-1]["graphs_after"]) == 2 and rows[-1]["worst"]["diff"] < 1e-5


def test_check_htp_accepts_exported_graphs_and_changes_nothing(arch):
    _, model = tiny(arch)
    p = build("check_htp")
    assert p.problems(model) == []  # what the exporter emits is in the HTP subset
    before = [(n.name, n.op_type) for n in model.graph]
    result = p(model)
    assert result.modified is False and [(n.name, n.op_type) for n in model.graph] == before


def test_check_htp_names_the_offending_node():
    _, model = tiny("llama")
    g = model.graph
    idx = add_initializer(g, "probe.idx", np.zeros([1, 1], np.int64))
    first = next(iter(g))
    new_node(g, first, "GatherND", [g.initializers["embed_tokens.weight"], idx], "probe/GatherND")
    with pytest.raises(PassError, match="GatherND node probe/GatherND is not supported"):
        build("check_htp")(model)
    _, model = tiny("llama")
    model.graph.inputs[0].type = ir.TensorType(ir.DataType.INT64)
    with pytest.raises(PassError, match="graph I/O input_ids is INT64"):
        build("check_htp")(model)
