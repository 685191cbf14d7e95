"""Calibration: profiles (AI Hub JSON, onnxruntime trace, QNN EP CSV) -> a device profile the cost model reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toolchain.cost.calibrate import calibrate, measure, read_latency
from toolchain.cost.model import CostModel, DeviceProfile, GraphCost, load_profile, save_profile
from toolchain.errors import MobcError

FIXTURES = Path(__file__).parent.parent / "fixtures"
MB = 1_000_000

# 20 GB/s DRAM peak, 10 TOPS int8, 1 ms per call: round numbers for hand-checked fits.
BASE = DeviceProfile(
    name="toy",
    flash_read_gbps=1.0,
    dram_peak_gbps=20.0,
    dram_efficiency=0.5,
    npu_int8_tops=10.0,
    npu_efficiency=0.1,
    call_overhead_ms=1.0,
)
LAYERS = {i: 90 * MB for i in range(4)}
DECODE = GraphCost(layer_weight_bytes=LAYERS, shared_weight_bytes=40 * MB, flops_per_token=1e9, width=1)
PREFILL = GraphCost(layer_weight_bytes=LAYERS, shared_weight_bytes=40 * MB, flops_per_token=1e9, width=128)

QNN_CSV = """Msg Timestamp,Message,Time,Unit of Measurement,Timing Source,Event Level,Event Identifier
0,BACKEND,70000,US,BACKEND,ROOT,QNN (execute) time
0,BACKEND,69000,US,BACKEND,ROOT,Accelerator (execute) time
0,NODE,5000,CYCLES,BACKEND,SUB-EVENT,/model/layers.0/mlp/MatMul
0,BACKEND,65000,US,BACKEND,ROOT,QNN (execute) time
0,BACKEND,64000,US,BACKEND,ROOT,Accelerator (execute) time
0,BACKEND,64000,US,BACKEND,ROOT,QNN (execute) time
0,BACKEND,66000,US,BACKEND,ROOT,QNN (execute) time
"""


def test_reads_the_ai_hub_profile_fixture():
    """The fixture is HAND-WRITTEN (round numbers, four layers), not downloaded from a real AI Hub
    job: no device run is available to the suite. The next test keeps its schema in step with the
    installed qai-hub's own conversion of a profile, so a schema change there fails here."""
    latency, runs, units = read_latency(FIXTURES / "aihub_profile_decode.json")
    assert latency == pytest.approx(0.026)  # estimated_inference_time is in microseconds
    assert runs == 5
    assert units == {"NPU": 4}


def test_profile_fixture_has_qai_hubs_documented_schema(tmp_path):
    """qai-hub's download_profile() returns `_profile_pb_to_python_dict` of the job's ProfileDetail
    (profile schema 1.2: execution_summary with all_*_times, execution_detail per layer). Build one
    from the protobuf with the fixture's numbers: same keys as the fixture, and the parser reads it."""
    import json

    from qai_hub import client as hub_client

    fixture = json.loads((FIXTURES / "aihub_profile_decode.json").read_text())
    summary = fixture["execution_summary"]
    pb = hub_client.api_pb.ProfileDetail(major_version=1, minor_version=2,
                                         execution_time=summary["estimated_inference_time"])
    pb.all_execution_times.extend(summary["all_inference_times"])
    for layer in fixture["execution_detail"]:
        d = pb.layer_details.add(name=layer["name"], layer_type_name=layer["type"],
                                 execution_time=layer["execution_time"],
                                 execution_cycles=layer["execution_cycles"])
        d.compute_unit = hub_client.api_pb.ComputeUnit.Value(f"COMPUTE_UNIT_{layer['compute_unit']}")
    real = hub_client._profile_pb_to_python_dict(pb)
    assert set(real) == set(fixture)
    assert set(real["execution_summary"]) == set(summary)
    assert real["execution_detail"] == fixture["execution_detail"]
    path = tmp_path / "from_qai_hub.json"
    path.write_text(json.dumps(real))
    assert read_latency(path) == read_latency(FIXTURES / "aihub_profile_decode.json")


def test_reads_qnn_csv_and_ort_trace(tmp_path):
    csv_path = tmp_path / "qnn.csv"
    csv_path.write_text(QNN_CSV)
    latency, runs, _ = read_latency(csv_path)
    # QNN (execute) time over 4 runs; the first (70 ms, warm-up) is dropped; median(65, 64, 66)
    assert (latency, runs) == (pytest.approx(0.065), 4)

    trace = [
        {"cat": "Session", "name": "session_initialization", "dur": 9000},
        {"cat": "Session", "name": "model_run", "dur": 500},
        {"cat": "Node", "name": "MatMul_0_kernel_time", "dur": 90},
        {"cat": "Session", "name": "model_run", "dur": 120},
        {"cat": "Session", "name": "model_run", "dur": 100},
    ]
    ort_path = tmp_path / "ort.json"
    ort_path.write_text(json.dumps(trace))
    assert read_latency(ort_path)[0] == pytest.approx(110e-6)


def test_calibration_fits_dram_from_decode_and_npu_from_prefill(tmp_path):
    csv_path = tmp_path / "prefill.csv"
    csv_path.write_text(QNN_CSV)
    ms = [
        measure("decode", FIXTURES / "aihub_profile_decode.json", DECODE),
        measure("prefill", csv_path, PREFILL),
    ]
    fitted = calibrate(BASE, ms, name="toy-measured")
    # decode: 400 MB in 26 - 1 = 25 ms = 16 GB/s = 0.8 of the 20 GB/s peak
    assert fitted.dram_efficiency == pytest.approx(0.8)
    # prefill: 128 GFLOP in 65 - 1 = 64 ms = 2 TOPS = 0.2 of 10 TOPS
    assert fitted.npu_efficiency == pytest.approx(0.2)
    recs = {r["graph"]: r for r in fitted.calibration["measurements"]}
    assert recs["decode"]["bound"] == "dram" and recs["prefill"]["bound"] == "compute"
    assert recs["decode"]["predicted_after_ms"] == pytest.approx(26.0)
    assert recs["prefill"]["predicted_after_ms"] == pytest.approx(65.0)
    # the fitted profile reproduces the measurements
    cm = CostModel(fitted, 1.0)
    assert cm.call_latency(DECODE).total_s == pytest.approx(0.026)
    assert cm.call_latency(PREFILL).total_s == pytest.approx(0.065)


def test_calibrated_profile_round_trips_through_yaml(tmp_path):
    base = load_profile("snapdragon-8-gen-3")
    fitted = calibrate(base, [measure("decode", FIXTURES / "aihub_profile_decode.json", DECODE)])
    out = save_profile(fitted, tmp_path / "s24.yaml", base=base.name)
    text = out.read_text()
    assert text.startswith("base: snapdragon-8-gen-3")
    again = load_profile(out)
    assert again.dram_efficiency == fitted.dram_efficiency
    assert again.npu_efficiency == base.npu_efficiency  # no compute-bound graph: kept
    assert any("npu_efficiency kept" in n for n in again.calibration["notes"])


def test_implausible_fits_are_capped_and_explained():
    fast = GraphCost(layer_weight_bytes={0: 4000 * MB}, flops_per_token=1.0)
    fitted = calibrate(BASE, [measure("decode", FIXTURES / "aihub_profile_decode.json", fast)])
    assert fitted.dram_efficiency == 1.0
    assert any("exceeds the peak" in n for n in fitted.calibration["notes"])


def test_bad_profile_files_are_clear_errors(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(MobcError, match="not an AI Hub profile JSON"):
        read_latency(bad)
    with pytest.raises(MobcError, match="does not exist"):
        read_latency(tmp_path / "missing.json")
    broken = tmp_path / "y.json"
    broken.write_text('{"execution_summary": {}}')
    with pytest.raises(MobcError, match="cannot read a latency"):
        read_latency(broken)
    with pytest.raises(MobcError, match="nothing to calibrate"):
        calibrate(BASE, [])
