"""`mobc bundle genai`: onnxruntime-genai itself loads the bundle and generates what mobc generates."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

from tests.cli_main import run_main
from toolchain.bundle import genai_stages
from toolchain.bundle.genai import CONFIG, write_bundle
from toolchain.bundle.genai_check import check_structure
from toolchain.bundle.genai_run import verify_bundle
from toolchain.errors import ArtifactError

# shorter than, exactly, and longer than one prompt window of the tiny artifact (width 4, context 32)
PROMPTS = [[5, 9, 11], [17, 3, 4, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]


def _compiled(tmp_path, source, name: str, extra: str = "", context: int = 32):
    """A tiny artifact with decode (N=1) and prefill (N=4) graphs, compiled without the greedy check."""
    from tests.tiny import write_recipe
    from toolchain.compile.pipeline import compile_recipe

    graphs = f"  decode: {{width: 1, context: {context}}}\n  prefill: {{width: 4, context: {context}}}\n"
    recipe = write_recipe(tmp_path / f"{name}.yaml", source, name=name, graphs=graphs, extra=extra)
    recipe.write_text(recipe.read_text().replace("greedy_tokens: 12", "greedy_tokens: 0"))
    return compile_recipe(recipe).out_dir


def test_genai_generates_what_mobc_generates(tiny_artifact, tmp_path):
    summary = write_bundle(tiny_artifact, tmp_path / "b")
    check = verify_bundle(summary.folder, PROMPTS, tokens=16)
    assert check.identical, [(r.genai.tokens, r.mobc.tokens) for r in check.results]
    assert all(len(r.mobc.tokens) == 16 for r in check.results)
    # weights are hard links into the artifact, not copies
    assert os.stat(summary.folder / "weights.bin").st_ino == os.stat(tiny_artifact / "weights.bin").st_ino
    assert summary.copied_bytes == 0 and summary.written_bytes < summary.linked_bytes
    config = json.loads((summary.folder / CONFIG).read_text())["model"]
    assert config["type"] == "decoder-pipeline" and config["context_length"] == 32
    assert config["decoder"]["sliding_window"]["window_size"] == 4
    assert all(not r.problem for r in check_structure(summary.folder))


def test_a_bundle_whose_masks_are_wrong_is_caught(tiny_artifact, tmp_path, monkeypatch):
    """An additive mask of 0 lets every row see empty slots and later rows: verify must notice."""
    monkeypatch.setattr(genai_stages, "MASK_MIN", 0.0)
    summary = write_bundle(tiny_artifact, tmp_path / "b")
    assert not verify_bundle(summary.folder, PROMPTS, tokens=8).identical


def test_sliding_window_layers_gemma3(tmp_path):
    """Gemma 3's sliding layers (window 8) over 30+ tokens: the position processor's sliding mask."""
    from tests.tiny import save_tiny

    artifact = _compiled(tmp_path, save_tiny(tmp_path / "hf", "gemma3"), "g", context=48)
    summary = write_bundle(artifact, tmp_path / "b")
    prompts = [list(range(30, 43)), [7, 8]]
    check = verify_bundle(summary.folder, prompts, tokens=24)
    assert check.identical, [(r.genai.tokens, r.mobc.tokens) for r in check.results]


def test_stages_hand_the_step_graph_mobcs_own_cache_inputs(tiny_artifact):
    """The position processor's masks and RoPE rows for a window equal KVCache's for the same state."""
    import onnxruntime as ort

    from toolchain.artifact.manifest import Manifest
    from toolchain.runtime.cache import KVCache
    from toolchain.runtime.sessions import ArtifactSessions

    sessions = ArtifactSessions(tiny_artifact)
    layout = Manifest.load(tiny_artifact).model.layout(4, 32)
    proc = genai_stages.position_processor(layout, sessions.rope)
    sess = ort.InferenceSession(proc.SerializeToString())
    cache = KVCache(layout, sessions.rope)
    cache.length = 6  # 6 tokens cached; this call: 1 padding row, then 3 real tokens at positions 6..8
    genai_mask = np.zeros((1, 32), np.int32)
    genai_mask[0, 28 - 6 : 28] = 1  # right-aligned count of cached tokens
    genai_mask[0, 29:] = 1
    outs = dict(zip([o.name for o in proc.graph.output],
                    sess.run(None, {"attention_mask_window": genai_mask,
                                    "position_ids": np.array([[0, 6, 7, 8]], np.int32)}), strict=True))
    # mobc lays a prompt window out as genai does (StepModel.feed): the real rows are bit-identical
    ours = cache.step_inputs([1, 2, 3], 4, first_row=1)
    np.testing.assert_array_equal(outs["attention_mask"][0, 0, 1:], ours["attention_mask"][0, 0, 1:])
    assert (outs["attention_mask"][0, 0, 1:, 28] < 0).all()  # nobody sees the padding row
    for name in ("position_cos", "position_sin"):
        np.testing.assert_array_equal(outs[name][0, 0, 1:], ours[name][0, 0, 1:])


def test_user_errors(tiny_artifact, tmp_path):
    with pytest.raises(ArtifactError, match="no QNN context binaries"):
        write_bundle(tiny_artifact, tmp_path / "q", target="qnn")
    with pytest.raises(ArtifactError, match="choose one of cpu, qnn"):
        write_bundle(tiny_artifact, tmp_path / "x", target="gpu")
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep me")
    with pytest.raises(ArtifactError, match="not a mobc artifact"):
        write_bundle(tiny_artifact, user, force=True)
    assert (user / "notes.txt").read_text() == "keep me"
    first = write_bundle(tiny_artifact, tmp_path / "b").folder
    with pytest.raises(ArtifactError, match="--force"):
        write_bundle(tiny_artifact, first)
    write_bundle(tiny_artifact, first, force=True)  # a bundle may be replaced
    summary = write_bundle(tiny_artifact, tmp_path / "c")
    with pytest.raises(ArtifactError, match="does not fit the context"):
        verify_bundle(summary.folder, [list(range(1, 30))], tokens=8)


def _edited_copy(tiny_artifact, tmp_path, edit) -> object:
    art = tmp_path / "a"
    shutil.copytree(tiny_artifact, art)
    manifest = json.loads((art / "manifest.json").read_text())
    edit(manifest)
    (art / "manifest.json").write_text(json.dumps(manifest))
    return art


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(graphs=[g for g in m["graphs"] if g["role"] != "prefill"]), "no a prefill graph"),
    (lambda m: m.update(graphs=[g for g in m["graphs"] if g["role"] != "decode"]), "no a decode graph of width 1"),
    (lambda m: m["model"].update(diffusion={"mask_token_id": 3}), "diffusion artifact"),
    (lambda m: [g["inputs"].append({"name": "lora_a_0", "shape": [1, 4], "dtype": "float32"})
                for g in m["graphs"]], "lora_a_0"),
])
def test_artifacts_genai_cannot_run_are_refused_by_name(tiny_artifact, tmp_path, edit, message):
    art = _edited_copy(tiny_artifact, tmp_path, edit)
    with pytest.raises(ArtifactError, match=message):
        write_bundle(art, tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_structure_check_names_a_stage_whose_io_differs(tiny_artifact, tmp_path):
    folder = write_bundle(tiny_artifact, tmp_path / "b").folder
    config = json.loads((folder / CONFIG).read_text())
    stages = config["model"]["decoder"]["pipeline"][0]
    stages["token_decode"]["inputs"] = stages["token_decode"]["inputs"][:-1]
    (folder / CONFIG).write_text(json.dumps(config))
    bad = [r for r in check_structure(folder) if r.problem]
    assert [r.name for r in bad] == ["token_decode"] and "inputs" in bad[0].problem


def test_cli_bundle_and_verify(tiny_artifact, tmp_path):
    from toolchain.cli.main import app

    out = tmp_path / "b"
    res = CliRunner().invoke(app, ["bundle", "genai", str(tiny_artifact), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "structure: 8 stages in pipeline order" in res.output
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\n---\nimport os\n")
    res = CliRunner().invoke(app, ["bundle", "verify", str(out), "--prompts", f"file:{prompts}", "--tokens", "8"])
    assert res.exit_code == 0, res.output
    assert "identical on 2/2 prompts" in res.output
    missing = run_main("bundle", "genai", str(tmp_path / "nothing"))
    assert missing.clean_error and "nothing" in missing.err


@pytest.mark.qnn
def test_qnn_bundle_wraps_every_binary_with_its_graphs_io(tiny_source, tmp_path):
    """--target qnn: each step-graph stage is the artifact's EPContext model over its HTP binary,
    with exactly the CPU graph's inputs and outputs (onnxruntime-genai's Python wheel has no QNN
    EP, so this structure is what can be proven here)."""
    from toolchain.artifact.manifest import Manifest

    artifact = _compiled(tmp_path, tiny_source, "q", "passes: [scale_rmsnorm, split_lm_head]\n"
                                                     "qnn: {soc_model: 57, htp_arch: 75, max_abs: 0.05}\n")
    folder = write_bundle(artifact, tmp_path / "b", target="qnn").folder
    rows = check_structure(folder)
    assert all(not r.problem for r in rows), [r.problem for r in rows if r.problem]
    graphs = Manifest.load(artifact).graphs
    assert sum(r.kind == "epcontext" for r in rows) == len(graphs) == 4  # 2 widths x (body, lm_head)
    stages = json.loads((folder / CONFIG).read_text())["model"]["decoder"]["pipeline"][0]
    for g in graphs:
        entry = stages[f"{'prompt' if g.width > 1 else 'token'}_{g.name}"]
        assert entry["inputs"] == g.input_names and entry["outputs"] == g.output_names
        assert entry["session_options"]["provider_options"][0]["qnn"]["backend_path"] == "libQnnHtp.so"
        assert entry.get("is_lm_head", False) == (g.role == "lm_head")


def test_quantized_artifact_bundles_beside_its_float_artifact(tiny_source, tmp_path):
    """A W4A16 artifact's QDQ graphs (int8 KV cache encodings inside) in onnxruntime-genai: the
    same tokens as mobc running the quantized artifact."""
    quant = ("quantize:\n  weights: int4\n  activations: int16\n  kv_cache: int8\n"
             "  calibration: {samples: 2}\n  eval_tokens: 0\n")
    quantized = _compiled(tmp_path, tiny_source, "w", quant) / "quantized"
    summary = write_bundle(quantized)
    assert summary.folder == quantized.parent.parent / "w-quantized-genai"
    import onnx

    token_graph = onnx.load(str(summary.folder / "decode.onnx"), load_external_data=False)
    assert sum(n.op_type == "DequantizeLinear" for n in token_graph.graph.node) > 10  # QDQ, not float
    check = verify_bundle(summary.folder, PROMPTS, tokens=12)
    assert check.identical, [(r.genai.tokens, r.mobc.tokens) for r in check.results]


@pytest.mark.qnn
def test_qnn_bundle_runs_in_onnxruntime_genai_on_the_htp(tmp_path, tiny_source):
    """onnxruntime-genai drives the EPContext stages through onnxruntime-qnn's plugin EP (the HTP
    emulator here): the fp16 binaries reproduce the float CPU tokens on the tiny model."""
    artifact = _compiled(tmp_path, tiny_source, "q", "passes: [scale_rmsnorm]\n"
                                                     "qnn: {soc_model: 57, htp_arch: 75, max_abs: 0.05}\n")
    folder = write_bundle(artifact, tmp_path / "b", target="qnn").folder
    check = verify_bundle(folder, PROMPTS, tokens=8)
    assert check.summary()["agreement"] >= 0.75, [(r.genai.tokens, r.mobc.tokens) for r in check.results]


def test_an_artifact_with_mobcs_own_cpu_op_is_refused(tiny_artifact, tmp_path):
    """A decode graph compiled with matmul_nbits' kernel_rows runs mobc's MatMulQ4, which
    onnxruntime-genai cannot load: the bundle says so instead of writing a pipeline that fails."""
    import onnx

    from toolchain.artifact.integrity import sha256_path

    art = _edited_copy(tiny_artifact, tmp_path, lambda m: None)
    manifest = json.loads((art / "manifest.json").read_text())
    decode = next(g["file"] for g in manifest["graphs"] if g["role"] == "decode")
    model = onnx.load(str(art / decode), load_external_data=False)
    node = next(n for n in model.graph.node if n.op_type == "MatMul")
    node.op_type, node.domain = "MatMulQ4", "mobc.cpu"
    onnx.save(model, str(art / decode))
    manifest["files"][decode] = sha256_path(art / decode)  # as a compile would have recorded it
    manifest["sizes"][decode] = (art / decode).stat().st_size
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="kernel_rows"):
        write_bundle(art, tmp_path / "b")
    assert not (tmp_path / "b").exists()
