"""`mobc hub compile|profile|calibrate` over a tiny artifact, with the recording fake in place of AI Hub."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from toolchain.artifact.manifest import Manifest, ModelInfo
from toolchain.compile.emit import write_graphs
from toolchain.errors import ArtifactError, MobcError
from toolchain.hub.client import HubError, HubJobFailedError, HubNotConfiguredError
from toolchain.hub.fake import FakeQaiHub, RecordingHubClient
from toolchain.hub.jobs import compile_options, hub_calibrate, hub_compile, hub_profile, input_specs
from toolchain.ir.graphset import GraphEntry, GraphSet

S24 = "Samsung Galaxy S24 (Family)"
SLUG = "samsung-galaxy-s24-family"


def _graph(width: int, quantized: bool) -> ir.Model:
    """ids [1,W] -> Gather(embed) -> MatMul(layers.0 weight) -> logits, plus a KV output."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(
            rng.standard_normal((64, 16)).astype(np.float32), "model.embed_tokens.weight"
        ),
        numpy_helper.from_array(
            rng.standard_normal((16, 64)).astype(np.float32), "model.layers.0.mlp.weight"
        ),
    ]
    nodes = [helper.make_node("Gather", ["model.embed_tokens.weight", "input_ids"], ["h"])]
    src = "h"
    if quantized:
        inits += [
            numpy_helper.from_array(np.array(0.05, np.float32), "s"),
            helper.make_tensor("z", TensorProto.UINT16, [], [32768]),
        ]
        nodes += [
            helper.make_node("QuantizeLinear", ["h", "s", "z"], ["hq"]),
            helper.make_node("DequantizeLinear", ["hq", "s", "z"], ["hd"]),
        ]
        src = "hd"
    nodes += [
        helper.make_node("MatMul", [src, "model.layers.0.mlp.weight"], ["logits"]),
        helper.make_node("Identity", ["h"], ["new_key_0"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT32, [1, width]),
            helper.make_tensor_value_info("attention_mask", TensorProto.FLOAT, [1, 1, width, 32]),
        ],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, width, 64]),
            helper.make_tensor_value_info("new_key_0", TensorProto.FLOAT, [1, width, 16]),
        ],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    return ir.from_proto(onnx.shape_inference.infer_shapes(model))


def make_artifact(folder: Path, quantized: bool = False) -> Path:
    gs = GraphSet()
    gs.add(GraphEntry("decode", _graph(1, quantized), "decode", "decode", 1, 32))
    gs.add(GraphEntry("prefill", _graph(4, quantized), "prefill", "prefill", 4, 32))
    folder.mkdir(parents=True)
    records, weights = write_graphs(folder, gs)
    model = ModelInfo(family="toy", n_layers=1, n_heads=1, n_kv=1, head_dim=16, hidden=16, vocab=64,
                      layer_kinds=["full"], rope_per_kind=False)
    manifest = Manifest(name="toy", source={}, model=model, graphs=records, weights=weights, rope={})
    if quantized:
        for r in records:
            r.encodings = f"{r.name}.encodings.json"
            (folder / r.encodings).write_text(json.dumps({"version": "0.6.1", "activation_encodings": {}}))
        manifest.quantization = {"scheme": "w8a16"}
    manifest.write(folder)
    return folder


def _snapshot(folder: Path) -> dict[str, float]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*")}


def test_options_and_specs_follow_the_manifest(tmp_path):
    m = Manifest.load(make_artifact(tmp_path / "a"))
    decode = m.graphs[0]
    assert input_specs(decode) == {
        "input_ids": ((1, 1), "int32"),
        "attention_mask": ((1, 1, 1, 32), "float32"),
    }
    assert compile_options(decode, "qnn_context_binary", quantized=False) == (
        "--target_runtime qnn_context_binary --qnn_graph_name decode --output_names logits,new_key_0"
    )
    assert compile_options(decode, "precompiled_qnn_onnx", quantized=True, extra="--qairt_version 2.40") == (
        "--target_runtime precompiled_qnn_onnx --output_names logits,new_key_0 --quantize_io --qairt_version 2.40"
    )


def test_float_artifact_compiles_links_and_records(tmp_path):
    art = make_artifact(tmp_path / "a")
    hub = RecordingHubClient()
    rec = hub_compile(art, S24, hub, say=lambda *_: None)
    calls = [c[0] for c in hub.calls]
    assert calls == ["get_devices", "submit_compile_job", "submit_compile_job", "submit_link_job"]
    c_decode, c_prefill = hub.calls[1][1], hub.calls[2][1]
    # linked: each width compiles to a DLC named after its graph; the link makes one context binary
    assert (
        c_decode["options"]
        == "--target_runtime qnn_dlc --qnn_graph_name decode --output_names logits,new_key_0"
    )
    assert c_prefill["input_specs"] == {
        "input_ids": ((1, 4), "int32"),
        "attention_mask": ((1, 1, 4, 32), "float32"),
    }
    assert c_decode["name"] == "toy_decode" and c_decode["device"].name == S24
    # the upload is the graph re-saved with its own .data next to it (not the shared weights.bin)
    uploaded = Path(c_decode["model"])
    assert uploaded.name == "decode" and not uploaded.exists()  # staged in a temp folder, now removed
    assert hub.calls[3][1]["name"] == "toy_stage0" and len(hub.calls[3][1]["models"]) == 2
    assert rec["linked"] and set(rec["models"]) == {"decode", "prefill"}
    assert rec["models"]["decode"]["file"] == f"hub/{SLUG}/toy_stage0.bin"
    # downloaded and recorded in the manifest, whose checksums now cover the binary
    m = Manifest.load(art)
    assert m.hub[SLUG]["compile"]["decode"]["options"] == c_decode["options"]
    assert m.hub[SLUG]["compile"]["decode"]["input_specs"]["input_ids"] == [[1, 1], "int32"]
    assert f"hub/{SLUG}/toy_stage0.bin" in m.files and (art / "hub" / SLUG / "toy_stage0.bin").is_file()
    assert not [p for p in (art / "hub").iterdir() if p.name.startswith(".")]


def test_quantized_artifact_uploads_aimet_folders_without_linking(tmp_path, monkeypatch):
    art = make_artifact(tmp_path / "q", quantized=True)
    hub = RecordingHubClient()
    seen: dict[str, list[str]] = {}
    real_submit = hub.fake.submit_compile_job

    def spy(model, device, **kw):  # look at the staged upload while it still exists
        seen[Path(model).name] = sorted(p.name for p in Path(model).iterdir())
        return real_submit(model, device, **kw)

    monkeypatch.setattr(hub.fake, "submit_compile_job", spy)
    rec = hub_compile(art, S24, hub, link=False, say=lambda *_: None)
    assert seen == {
        "decode.aimet": ["decode.data", "decode.encodings", "decode.onnx"],
        "prefill.aimet": ["prefill.data", "prefill.encodings", "prefill.onnx"],
    }
    opts = [c[1]["options"] for c in hub.calls if c[0] == "submit_compile_job"]
    assert opts[0] == (
        "--target_runtime qnn_context_binary --qnn_graph_name decode "
        "--output_names logits,new_key_0 --quantize_io"
    )
    assert not rec["linked"] and rec["quantized"]
    assert rec["models"]["prefill"]["file"] == f"hub/{SLUG}/prefill.bin"


def test_no_token_fails_fast_and_touches_nothing(tmp_path, monkeypatch):
    art = make_artifact(tmp_path / "a")
    before = _snapshot(art)
    hub = RecordingHubClient(configured=False)
    with pytest.raises(HubNotConfiguredError, match="qai-hub configure --api_token"):
        hub_compile(art, S24, hub)
    assert hub.calls == [] and _snapshot(art) == before

    # through the CLI, with the real client and no client.ini: exit code 2 and the same message
    monkeypatch.setenv("QAIHUB_CLIENT_INI", str(tmp_path / "missing.ini"))
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from toolchain.cli.main import main; main()",
            "hub",
            "compile",
            str(art),
            "--device",
            S24,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "qai-hub configure --api_token" in proc.stderr and "Traceback" not in proc.stderr
    assert _snapshot(art) == before


def test_failed_compile_writes_nothing(tmp_path):
    art = make_artifact(tmp_path / "a")
    before = _snapshot(art)
    hub = RecordingHubClient(fail_jobs={"toy_prefill": "Failed to compile: GatherND unsupported"})
    with pytest.raises(HubJobFailedError, match="GatherND"):
        hub_compile(art, S24, hub, say=lambda *_: None)
    assert _snapshot(art) == before


def test_link_refused_on_a_device_without_weight_sharing(tmp_path):
    art = make_artifact(tmp_path / "a")
    with pytest.raises(HubError, match="does not support weight sharing"):
        hub_compile(art, "Samsung Galaxy S21", RecordingHubClient(), link=True)
    rec = hub_compile(art, "Samsung Galaxy S21", RecordingHubClient(), say=lambda *_: None)
    assert not rec["linked"]  # auto: no weight sharing, no link


def test_profile_then_calibrate(tmp_path):
    art = make_artifact(tmp_path / "a")
    fake = FakeQaiHub(profile_us={"toy_decode_profile": 300.0, "toy_prefill_profile": 400.0})
    hub = RecordingHubClient(fake)
    hub_compile(art, S24, hub, say=lambda *_: None)
    profiles = hub_profile(art, S24, hub, say=lambda *_: None)
    inf = [c[1] for c in hub.calls if c[0] == "submit_inference_job"]
    assert [c["options"] for c in inf] == [
        "--qnn_options context_enable_graphs=decode",
        "--qnn_options context_enable_graphs=prefill",
    ]
    assert all(c["profile"] is True for c in inf)
    assert profiles["decode"]["latency_ms"] == pytest.approx(0.3)
    assert (art / profiles["decode"]["file"]).is_file()

    fitted, path = hub_calibrate(art, S24)
    assert path == art / "hub" / SLUG / "device_profile.yaml"
    assert path.read_text().startswith("base: snapdragon-8-gen-3")
    recs = {r["graph"]: r for r in fitted.calibration["measurements"]}
    assert recs["decode"]["measured_ms"] == pytest.approx(0.3)
    assert Manifest.load(art).hub[SLUG]["calibration"]["file"] == f"hub/{SLUG}/device_profile.yaml"


def test_calibrate_from_local_profiles(tmp_path):
    art = make_artifact(tmp_path / "a")
    trace = tmp_path / "ort.json"
    trace.write_text(json.dumps([{"cat": "Session", "name": "model_run", "dur": d} for d in (900, 400, 420)]))
    out = tmp_path / "local.yaml"
    fitted, path = hub_calibrate(art, profiles={"decode": trace}, base="snapdragon-8-elite", out=out)
    assert path == out and fitted.calibration["base"] == "snapdragon-8-elite"
    assert fitted.calibration["measurements"][0]["measured_ms"] == pytest.approx(0.41)
    with pytest.raises(HubError, match="no graph named tree"):
        hub_calibrate(art, profiles={"tree": trace}, base="snapdragon-8-elite", out=out)
    with pytest.raises(HubError, match="--base"):
        hub_calibrate(art, profiles={"decode": trace}, out=out)


def test_profile_needs_a_compile_first(tmp_path):
    art = make_artifact(tmp_path / "a")
    with pytest.raises(HubError, match="run `mobc hub compile"):
        hub_profile(art, S24, RecordingHubClient())


def test_not_an_artifact(tmp_path):
    with pytest.raises(ArtifactError):
        hub_compile(tmp_path, S24, RecordingHubClient())


def test_cli_dry_run_prints_calls_and_writes_nothing(tmp_path):
    from toolchain.cli.hub import app as hub_app

    art = make_artifact(tmp_path / "a")
    before = _snapshot(art)
    runner = CliRunner()
    res = runner.invoke(hub_app, ["compile", str(art), "--device", S24, "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "submit_compile_job" in res.output and "submit_link_job" in res.output
    res = runner.invoke(hub_app, ["profile", str(art), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "context_enable_graphs=decode" in res.output
    assert _snapshot(art) == before
    res = runner.invoke(hub_app, ["calibrate", str(art), "--profile", "decode"])
    assert isinstance(res.exception, MobcError) and "GRAPH=FILE" in str(res.exception)


def test_calibrate_finds_the_base_profile_by_chipset(tmp_path):
    art = make_artifact(tmp_path / "a")
    qrd = "Snapdragon 8 Elite QRD"
    fake = FakeQaiHub(devices={qrd: ("15", ("chipset:qualcomm-snapdragon-8-elite", "framework:qnn"))})
    hub = RecordingHubClient(fake)
    hub_compile(art, qrd, hub, say=lambda *_: None)
    hub_profile(art, qrd, hub, say=lambda *_: None)
    fitted, _ = hub_calibrate(art, qrd)
    assert fitted.calibration["base"] == "snapdragon-8-elite"
