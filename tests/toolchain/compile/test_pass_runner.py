"""run_passes: per-pass verification rows, and loud failure on a pass that breaks numerics."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest
from rich.console import Console

from passes.base import GraphPass, PassConfig
from passes.registry import PASSES, register
from tests.passes.tiny import graphset_for
from toolchain.compile.pass_runner import format_pass_table, run_passes
from toolchain.errors import PassError, RecipeError


class _Scale(PassConfig):
    factor: float = 1.5


if "test_break_mlp" not in PASSES:

    @register("test_break_mlp")
    class BreakMlp(GraphPass):
        """Deliberately wrong: scales layer 1's down_proj weight (changes logits)."""

        Config = _Scale

        def rewrite(self, model):
            for node in model.graph:
                if node.name.startswith("layers.1.mlp.down_proj") and node.op_type == "MatMul":
                    w = node.inputs[1]
                    w.const_value = ir.tensor(w.const_value.numpy() * self.config.factor, name=w.name)
            return True


def test_rows_are_json_and_table_renders():
    gs, feeds = graphset_for("qwen2", (1, 4))
    gs, rows = run_passes(gs, ["fold_constants", "split_lm_head"], 1e-4, feeds, progress=lambda m: None)
    assert [r["pass"] for r in rows] == ["fold_constants", "split_lm_head"]
    json.dumps(rows)  # manifest.json stores them as they are
    r = rows[1]
    assert set(r["max_abs_diff"]) == {"decode", "w4"}
    assert "logits" in r["max_abs_diff"]["decode"] and r["graphs_after"] == sorted(gs.entries)
    assert r["ops_before"]["MatMul"] == r["ops_after"]["MatMul"]
    assert r["weight_bytes_before"] == r["weight_bytes_after"] > 0
    console = Console(record=True, width=160)
    console.print(format_pass_table(rows))
    assert "split_lm_head" in console.export_text()


def test_broken_pass_fails_naming_pass_family_and_output():
    gs, feeds = graphset_for("qwen2", (4,))
    with pytest.raises(PassError, match=r"pass 'test_break_mlp' changed graph 'w4' output 'logits' by"):
        run_passes(gs, ["fold_constants", {"test_break_mlp": {"factor": 3.0}}], 1e-3, feeds)


def test_small_change_within_tolerance_is_recorded():
    gs, feeds = graphset_for("qwen2", (4,))
    _, rows = run_passes(gs, [{"test_break_mlp": {"factor": 1.0 + 1e-6}}], 1.0, feeds)
    assert 0 < rows[0]["worst"]["diff"] < 1e-3
    assert np.isfinite(rows[0]["worst"]["diff"])


def test_bad_specs_are_rejected_before_running():
    gs, feeds = graphset_for("qwen2", (4,))
    with pytest.raises(RecipeError, match="unknown pass 'nope'"):
        run_passes(gs, ["fold_constants", "nope"], 1e-3, feeds)
    with pytest.raises(RecipeError, match="fold_constants.size: unknown option"):
        run_passes(gs, [{"fold_constants": {"size": 1}}], 1e-3, feeds)
    with pytest.raises(PassError, match="no verification inputs for graph family 'w4'"):
        run_passes(gs, ["fold_constants"], 1e-3, {})


def test_pass_order_mistake_is_explained():
    gs, feeds = graphset_for("qwen2", (4,))
    with pytest.raises(PassError, match="list mha_to_sha before linear_to_conv"):
        run_passes(gs, ["linear_to_conv", "mha_to_sha"], 1e-3, feeds)


def test_a_graph_over_the_part_budget_is_checked_part_by_part(monkeypatch, tmp_path):
    """Above RUN_PART_BYTES a graph runs as temporary layer parts, one session each, with the
    whole graph's outputs; its spilled weights are read where they lie."""
    from toolchain.compile import pass_runner
    from toolchain.ir import disk

    gs, feeds = graphset_for("llama", (4,))
    entry = gs.entries["w4"]
    whole = pass_runner.ort_run(entry, feeds["w4"])
    sessions = []
    real = pass_runner._ort_run_whole
    monkeypatch.setattr(pass_runner, "_ort_run_whole", lambda e, f: sessions.append(e.name) or real(e, f))
    monkeypatch.setattr(pass_runner, "RUN_PART_BYTES", 1)
    with disk.spilling(disk.Spill(tmp_path)) as spill:
        for m in [e.model for e in gs.entries.values()]:
            disk.spill_large(m, spill)
        parted = pass_runner.ort_run(entry, feeds["w4"])
    assert len(sessions) == 2  # the tiny model's two layers, one part each
    assert sorted(parted) == sorted(whole)
    for name, want in whole.items():
        np.testing.assert_allclose(parted[name], want, rtol=0, atol=1e-6)
    assert not list(tmp_path.glob("check-*"))  # the temporary graphs are gone


def test_passes_keep_large_weights_on_disk_and_drop_replaced_spill(monkeypatch, tmp_path):
    """While a spill is active, every large weight a pass makes goes to disk (the compile never holds
    a second copy of the model), and scratch files whose tensors a later pass replaced are deleted."""
    from toolchain.ir import disk

    monkeypatch.setattr(disk, "SPILL_BYTES", 1024)
    gs, feeds = graphset_for("llama", (4,))
    with disk.spilling(disk.Spill(tmp_path)) as spill:
        for e in gs.entries.values():
            disk.spill_large(e.model, spill)
        gs, rows = run_passes(gs, ["mha_to_sha", "linear_to_conv"], 1e-4, feeds)
    tensors = [v.const_value for e in gs.entries.values() for v in e.model.graph.initializers.values()]
    assert all(disk.is_on_disk(t) for t in tensors if t is not None and t.nbytes >= 1024)
    live = {t.location for t in tensors if disk.is_on_disk(t)}
    files = {p.name for p in tmp_path.glob("spill*.bin")}
    assert files - live <= {f for f in files if "linear_to_conv" in f}  # only the open section may be unused
    assert not any("mha_to_sha" in f for f in files)  # its head slices became conv weights, then were deleted
    assert rows[-1]["worst"]["diff"] <= 1e-4
