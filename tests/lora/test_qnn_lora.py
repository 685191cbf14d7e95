"""The QNN HTP build still works with adapter and forecast inputs: a tiny step graph with
mha_to_sha + lora_inputs + forecast_inputs + linear_to_conv finalizes and matches the CPU EP
with a non-zero adapter and forecast rows bound."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from passes import build
from tests.lora.test_lora_inputs import MAX_RANK, SLOTS, lora_feeds, random_adapter
from tests.passes.tiny import feeds_for, tiny
from toolchain import qnn

AVAILABLE, REASON = qnn.availability()


@pytest.mark.qnn
@pytest.mark.skipif(not AVAILABLE, reason=f"onnxruntime-qnn unavailable: {REASON}")
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
