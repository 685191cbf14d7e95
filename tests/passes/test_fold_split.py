"""fold_constants, split_lm_head and split_layers on tiny models of every architecture."""

from __future__ import annotations

import numpy as np
import pytest

from passes import build
from tests.passes.tiny import graphset_for, tiny
from toolchain.artifact.chain import run_chain
from toolchain.compile.pass_runner import ort_run, run_passes
from toolchain.errors import PassError, RecipeError


def _outputs(gs, feeds):
    return {f: run_chain(gs.chain(f), feeds[f], ort_run) for f in gs.families()}


def test_fold_constants_folds_and_prunes(arch):
    _, model = tiny(arch)
    # a foldable chain and an unused initializer the pass must remove
    from toolchain.ir.graph import add_initializer, new_node

    g = model.graph
    a = add_initializer(g, "probe.a", np.ones([4], np.float32))
    node = new_node(g, None, "Neg", [a], "probe/Neg")
    add_initializer(g, "probe.unused", np.zeros([3], np.float32))
    p = build("fold_constants")
    p(model)
    names = {n.name for n in model.graph}
    assert "probe/Neg" not in names and node.outputs[0].name not in model.graph.initializers
    assert "probe.unused" not in model.graph.initializers
    p.ensures(model)


def test_fold_constants_keeps_tied_transpose_under_default_limits():
    _, model = tiny("gemma3")
    build("fold_constants")(model)
    assert any(n.op_type == "Transpose" and n.name.startswith("lm_head") for n in model.graph)


def test_split_lm_head_and_parts_match_unsplit(arch):
    gs, feeds = graphset_for(arch, (4,))
    ref = _outputs(gs, feeds)
    specs = [{"split_layers": {"at": [1]}}, "split_lm_head"]
    gs, rows = run_passes(gs, specs, 1e-5, feeds)
    chain = gs.chain("w4")
    assert [e.role for e in chain] == ["w4", "part", "lm_head"]
    assert chain[0].meta["layers"] == [0, 1] and chain[1].meta["layers"][0] == 1
    assert chain[1].input_names[0] == "residual_1" and "residual_1" in chain[0].output_names
    assert chain[2].input_names == ["hidden"] and chain[2].output_names == ["logits"]
    got = _outputs(gs, feeds)["w4"]
    for name, want in ref["w4"].items():
        np.testing.assert_allclose(got[name], want, atol=1e-5)
    assert all(r["worst"]["diff"] <= 1e-5 for r in rows)


def test_split_lm_head_without_norm_and_tied_weights_shared():
    gs, feeds = graphset_for("gemma3", (4,))
    gs, _ = run_passes(gs, [{"split_lm_head": {"include_norm": False}}], 1e-5, feeds)
    body, head = gs.chain("w4")
    assert not any(n.name.startswith("norm/") for n in head.model.graph)
    # tied embedding: the head's projection weight is the very tensor the body gathers from
    body_t = {id(v.const_value) for v in body.model.graph.initializers.values()}
    assert any(id(v.const_value) in body_t for v in head.model.graph.initializers.values())


def test_split_parts_by_budget_tiles_layers():
    gs, feeds = graphset_for("gemma3", (4,))
    gs, _ = run_passes(gs, [{"split_layers": {"max_part_bytes": 1.0}}], 1e-5, feeds)
    ranges = [e.meta["layers"] for e in gs.chain("w4")]
    assert ranges == [[0, 1], [1, 2], [2, 3]]


def test_split_parts_alias_uses_the_budget():
    gs, feeds = graphset_for("gemma3", (4,))
    gs, rows = run_passes(gs, [{"split_parts": {"max_part_bytes": 1.0}}], 1e-5, feeds)
    assert [e.meta["layers"] for e in gs.chain("w4")] == [[0, 1], [1, 2], [2, 3]]
    assert rows[0]["pass"] == "split_parts"


def test_split_layers_rejects_bad_boundaries():
    gs, feeds = graphset_for("llama", (4,))
    with pytest.raises(PassError, match="outside 1..1"):
        run_passes(gs, [{"split_layers": {"at": [5]}}], 1e-5, feeds)


def test_unknown_pass_and_option_messages():
    with pytest.raises(RecipeError, match="unknown pass 'fold'; valid passes: .*fold_constants"):
        build("fold", 2)
    with pytest.raises(
        RecipeError, match=r"passes.0.split_layers.budget: unknown option; valid options: at, max_part_bytes"
    ):
        build({"split_layers": {"budget": 3}})
