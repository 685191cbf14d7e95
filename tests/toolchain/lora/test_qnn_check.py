"""The QNN HTP build still works with adapter and forecast inputs: a tiny step graph with
mha_to_sha + lora_inputs + forecast_inputs + linear_to_conv finalizes and matches the CPU EP
with a non-zero adapter and forecast rows bound."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from passes import build
from tests.lora_tiny import MAX_RANK, SLOTS, lora_feeds, random_adapter
from tests.passes.tiny import feeds_for, tiny
from toolchain.qnn import context as qnn
from toolchain.runtime.adapters import Adapter


@pytest.mark.qnn
def test_lora_and_forecast_graph_builds_on_htp(tmp_path):
    layout, base = tiny("llama")
    model = base.clone()
    for spec in ("scale_rmsnorm", "mha_to_sha",
                 {"lora_inputs": {"targets": ["q_proj", "v_proj"], "max_rank": MAX_RANK, "slots": SLOTS}},
                 {"forecast_inputs": {"m": 2}}, "linear_to_conv"):
        build(spec)(model)
    path = tmp_path / "decode.onnx"
    ir.save(model, path, external_data="decode.bin")
    ad = random_adapter(base, ["q_proj", "v_proj"], rank=MAX_RANK, seed=1)
    feeds = lora_feeds(model, feeds_for(layout), [ad, None], [0, 0, None, 1])
    rng = np.random.default_rng(0)
    feeds["forecast_embeds"] = rng.standard_normal((2, layout.hidden)).astype(np.float32) * 0.5
    feeds["forecast_select"] = np.zeros((1, layout.width, 2), np.float32)
    feeds["forecast_select"][0, 3, 1] = 1.0
    (rec,) = qnn.emit_qnn({"decode": str(path)}, tmp_path / "out", qnn.QnnSpec(max_abs=0.05), {"decode": feeds})
    assert rec["status"] == "verified", rec
    assert rec["verify"]["argmax_agreement"]["logits"] == 1.0


LORA_QNN_PASSES = """passes:
  - scale_rmsnorm
  - mha_to_sha
  - lora_inputs: {targets: [q_proj, v_proj], max_rank: 4, slots: 2}
  - linear_to_conv
  - split_lm_head
  - split_layers: {at: [1]}
  - check_htp
qnn: {soc_model: 57, htp_arch: 75, max_abs: 0.05}
"""


@pytest.mark.qnn
def test_recipe_binaries_keep_adapter_inputs_and_match_cpu_with_an_adapter(tmp_path):
    """A lora_inputs recipe with a qnn: section (split into parts and lm_head): every context binary
    keeps its lora_* inputs, and an adapter packed after the compile runs on them (greedy requests
    and a CTG call mixing adapter rows) with the CPU EP's argmax on every row."""
    import onnx

    from tests.tiny import save_tiny, write_recipe
    from toolchain.compile.pipeline import compile_recipe
    from toolchain.lora.qnn_check import check_adapters
    from toolchain.runtime.model import StepModel

    src = save_tiny(tmp_path / "src", "llama")
    graphs = "  decode: {width: 1, context: 64}\n  ctg: {width: 4, context: 64, role: tree}\n"
    recipe = write_recipe(tmp_path / "r.yaml", src, "tiny-lora-qnn", graphs, LORA_QNN_PASSES)
    art = compile_recipe(recipe).out_dir
    manifest = StepModel(art).manifest
    assert {r["graph"] for r in manifest.qnn} == {g.name for g in manifest.graphs}
    for g in manifest.graphs:
        (rec,) = [r for r in manifest.qnn if r["graph"] == g.name]
        assert rec["status"] == "verified"
        ctx = onnx.load(art / "qnn" / rec["context_model"], load_external_data=False)
        assert [n.op_type for n in ctx.graph.node] == ["EPContext"]
        assert {i.name for i in ctx.graph.input} == set(g.input_names)
        if g.role != "lm_head":
            assert any(i.name.startswith("lora_B.") for i in ctx.graph.input), g.name

    rng = np.random.default_rng(1)
    ins = {i.name: i.shape for g in manifest.graphs for i in g.inputs}
    weights = {}
    for name, shape in ins.items():
        if name.startswith("lora_A."):
            proj = name[7:]
            heads = [s for n, s in ins.items() if n.split(".head")[0] == f"lora_B.{proj}"]
            out = sum(s[1] for s in heads)
            weights[proj] = (
                rng.standard_normal((shape[0], 4)).astype(np.float32) * 0.5,
                rng.standard_normal((4, out)).astype(np.float32) * 0.5,
            )
    Adapter("rand1", 4, weights).save(art / "adapters" / "rand1.npz")

    res = check_adapters(art, ["rand1"], tokens=3, ctg_steps=2, log=lambda _: None)
    base, ad = res["requests"]
    assert ad["adapter_effect_max_abs"] > 0.5  # the adapter changes the logits ...
    for run in (base, ad, res["ctg"]):
        assert run["argmax_agreement"] == 1.0, run
        assert run["logits_max_abs"] < 0.05, run  # ... by far more than fp16 HTP differs from CPU
    # the prompt chunks and the mixed-row steps ran on the ctg binaries
    assert res["ctg"]["calls_by_family"]["ctg"] >= 3
    assert (art / "qnn" / "adapters_qnn.json").is_file()
