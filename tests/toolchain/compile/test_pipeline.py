"""The compile spine end to end on a tiny model: artifacts, CLI, atomic writes, determinism."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import onnx_ir as ir
import pytest
from typer.testing import CliRunner

from passes.base import GraphPass, PassConfig
from passes.registry import PASSES, register
from tests.tiny import save_tiny, write_recipe
from toolchain.cli.main import app
from toolchain.compile.pipeline import compile_recipe
from toolchain.errors import ArtifactError, PassError, SourceError, VerificationError

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("model") / "tiny-llama", "llama")


@pytest.fixture(scope="module")
def compiled(tiny_dir, tmp_path_factory):
    recipe = write_recipe(tmp_path_factory.mktemp("r") / "tiny.yaml", tiny_dir)
    result = compile_recipe(recipe)
    return recipe, result


def test_artifact_layout_and_manifest(compiled):
    _, result = compiled
    out = result.out_dir
    names = {p.name for p in out.iterdir()}
    assert {"decode.onnx", "prefill.onnx", "weights.bin", "manifest.json", "report.md", "rope.npz",
            "tokenizer"} <= names
    m = json.loads((out / "manifest.json").read_text())
    assert [g["name"] for g in m["graphs"]] == ["decode", "prefill"]
    decode = m["graphs"][0]
    assert decode["width"] == 1 and decode["context"] == 64 and decode["role"] == "decode"
    ins = {i["name"]: i for i in decode["inputs"]}
    assert ins["input_ids"]["dtype"] == "int32" and ins["input_ids"]["shape"] == [1, 1]
    assert ins["past_key_0"]["shape"] == [2, 1, 16, 63]  # [n_kv, 1, D, CL-N]
    assert ins["past_value_1"]["shape"] == [2, 1, 63, 16]
    outs = {o["name"]: o for o in m["graphs"][1]["outputs"]}
    assert outs["logits"]["shape"] == [1, 8, 512] and outs["new_key_0"]["shape"] == [2, 1, 16, 8]
    assert len(decode["sha256"]) == 64 and "torch" in m["tools"] and m["source"]["fingerprint"]
    # both widths share every weight: the shared file holds one copy
    assert m["weights"]["bytes_saved_by_sharing"] > 0.9 * decode["weight_bytes"]
    v = m["verification"]
    assert all(f["worst_max_abs"] <= 1e-3 for f in v["families"].values())
    assert v["greedy"]["identical"] and len(v["greedy"]["ours"]) == 12
    assert "Verification against transformers" in (out / "report.md").read_text()


def test_inspect_and_verify_cli(compiled):
    _, result = compiled
    r = runner.invoke(app, ["inspect", str(result.out_dir)], terminal_width=160)
    assert r.exit_code == 0, r.output
    assert "decode" in r.output and "prefill" in r.output and "past_key_{0..1}" in r.output
    r = runner.invoke(app, ["verify", str(result.out_dir)], terminal_width=160)
    assert r.exit_code == 0, r.output
    assert "verified" in r.output


def test_verify_detects_tampering(compiled, tmp_path):
    import shutil

    _, result = compiled
    copy = tmp_path / "copy"
    shutil.copytree(result.out_dir, copy)
    with open(copy / "decode.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ArtifactError, match="decode.onnx"):
        from toolchain.compile.pipeline import Reporter
        from toolchain.compile.reverify import reverify

        reverify(copy, Reporter())


def test_deterministic_recompile(compiled, tmp_path):
    recipe, first = compiled
    second = compile_recipe(recipe, out=tmp_path / "again")
    a = {g.name: g.sha256 for g in first.manifest.graphs}
    b = {g.name: g.sha256 for g in second.manifest.graphs}
    assert a == b
    assert first.manifest.weights["sha256"] == second.manifest.weights["sha256"]


def test_existing_output_needs_force(compiled):
    recipe, _ = compiled
    with pytest.raises(ArtifactError, match="--force"):
        compile_recipe(recipe)


def test_failed_verification_leaves_nothing(tiny_dir, tmp_path):
    recipe = write_recipe(tmp_path / "t.yaml", tiny_dir, name="strict",
                          extra="tolerance: {max_abs: 1.0e-12}\n")
    from toolchain.compile.pipeline import Reporter

    class Recording(Reporter):
        def __init__(self):
            self.done_stages: list[str] = []

        def done(self, stage, seconds, detail=""):
            self.done_stages.append(stage)

    reporter = Recording()
    with pytest.raises(VerificationError, match=r"graph 'decode': output .* tolerance.max_abs 1e-12"):
        compile_recipe(recipe, reporter=reporter)
    # the failing check is never reported as a finished (checked) stage
    assert "emit" in reporter.done_stages
    assert not [s for s in reporter.done_stages if s.startswith("verify decode")]
    out_parent = tmp_path / "out"
    assert not (out_parent / "strict").exists()
    assert not list(out_parent.glob(".strict*"))  # no staging leftovers


class _NanConfig(PassConfig):
    value: float = float("nan")


if "test_poison_lm_head" not in PASSES:

    @register("test_poison_lm_head")
    class PoisonLmHead(GraphPass):
        """Deliberately wrong: writes `value` (NaN by default) into one row of the lm_head weight."""

        Config = _NanConfig

        def rewrite(self, model):
            for node in model.graph:
                if node.name.startswith("lm_head") and node.op_type == "MatMul":
                    w = node.inputs[1]
                    arr = w.const_value.numpy().copy()
                    arr[:, 7] = self.config.value
                    w.const_value = ir.tensor(arr, name=w.name)
                    return True
            raise AssertionError("no lm_head MatMul in the graph")


@pytest.mark.parametrize("value", [float("nan"), 100.0], ids=["nan", "wrong"])
def test_a_pass_that_breaks_numerics_fails_the_compile_and_leaves_nothing(tiny_dir, tmp_path, value):
    recipe = write_recipe(tmp_path / "p.yaml", tiny_dir, name="poisoned",
                          graphs="  decode: {width: 1, context: 64}\n",
                          extra=f"passes: [{{test_poison_lm_head: {{value: {value}}}}}]\n")
    recipe.write_text(recipe.read_text().replace("greedy_tokens: 12", "greedy_tokens: 0"))
    with pytest.raises(PassError, match=r"pass 'test_poison_lm_head' changed graph 'decode' output 'logits' by "
                                        r"(inf|[0-9.]+)"):
        compile_recipe(recipe)
    assert not (tmp_path / "out" / "poisoned").exists()
    assert not list((tmp_path / "out").glob(".poisoned*"))


def test_a_source_model_with_nan_logits_fails_verification(tmp_path):
    """NaN in transformers' own logits as well as the graph's: a NaN difference must still fail
    (without a greedy check to catch it, as in the diffusion recipes)."""
    import torch

    hf = save_tiny(tmp_path / "hf", "llama")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf)
    with torch.no_grad():
        model.lm_head.weight[7] = float("nan")
    model.save_pretrained(hf)
    recipe = write_recipe(tmp_path / "n.yaml", hf, name="nanmodel", graphs="  decode: {width: 1, context: 64}\n")
    recipe.write_text(recipe.read_text().replace("greedy_tokens: 12", "greedy_tokens: 0"))
    with pytest.raises(VerificationError, match="output logits has non-finite values"):
        compile_recipe(recipe)
    assert not (tmp_path / "out" / "nanmodel").exists()


def test_user_errors_exit_2_without_traceback(tmp_path):
    r = runner.invoke(app, ["compile", str(tmp_path / "missing.yaml")])
    # CliRunner bypasses main(); run the real console script for the exit code
    proc = subprocess.run([sys.executable, "-m", "toolchain.cli.main", "compile", str(tmp_path / "missing.yaml")],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "recipe file" in proc.stderr and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert r.exit_code != 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nsource: {path: /nonexistent}\ngraphs: {decode: {width: 1, context: 8}}\n")
    proc = subprocess.run([sys.executable, "-m", "toolchain.cli.main", "compile", str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "source.path" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_path_source_message(tmp_path):
    from toolchain.compile.recipe import SourceSpec
    from toolchain.compile.source import load

    with pytest.raises(SourceError, match="source.gguf: file .* does not exist"):
        load(SourceSpec(gguf=str(tmp_path / "x.gguf")))
    with pytest.raises(SourceError, match="not in the local Hugging Face cache"):
        load(SourceSpec(hub="nobody/definitely-not-cached-model"))


def test_killed_compile_leaves_no_manifest(tiny_dir, tmp_path):
    recipe = write_recipe(tmp_path / "k.yaml", tiny_dir, name="killed")
    out_parent = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "toolchain.cli.main", "compile", str(recipe)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    deadline = time.time() + 240
    # kill as soon as the staging folder holds the first graph: mid-way through emit/verify
    while time.time() < deadline and proc.poll() is None:
        staged = list(out_parent.glob(".killed.partial-*/decode.onnx"))
        if staged:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "compile finished before it could be killed"
    assert not (out_parent / "killed" / "manifest.json").exists()
    assert not (out_parent / "killed").exists()


@pytest.mark.qnn
def test_recipe_qnn_section_builds_verified_binaries(tiny_dir, tmp_path):
    # without onnxruntime-qnn: fails on Linux x86_64 (a declared dependency), skips elsewhere (tests/conftest.py)
    recipe = write_recipe(
        tmp_path / "q.yaml", tiny_dir, name="withqnn",
        graphs="  decode: {width: 1, context: 64}\n",
        extra="passes: [scale_rmsnorm, {split_layers: {at: [1]}}]\n"
              "qnn: {soc_model: 57, htp_arch: 75, max_abs: 0.05}\n",
    )
    result = compile_recipe(recipe)
    records = result.manifest.qnn
    assert {r["graph"] for r in records} == {g.name for g in result.manifest.graphs}
    assert len(records) == 2  # both parts of the split decode graph
    for r in records:
        assert r["status"] == "verified" and r["verify"]["worst_max_abs"] <= 0.05
        for name in r["binaries"]:
            assert (result.out_dir / "qnn" / name).stat().st_size > 0
    lock = result.manifest.qnn_lockstep  # the gate's greedy run through the HTP decode binaries
    assert lock["tokens"] == 8 and lock["argmax_agreement"] == 1.0 and lock["prompt_tokens"] >= 2
    r = runner.invoke(app, ["inspect", str(result.out_dir)], terminal_width=160)
    assert "QNN HTP context binaries" in r.output and "verified" in r.output
    assert "Greedy lockstep through the HTP decode binaries: 8 tokens" in r.output


@pytest.mark.qnn
def test_diffusion_recipe_qnn_section_builds_every_block_part(tiny_dir, tmp_path):
    """A diffusion LM's block graph gets its HTP binaries inside mobc compile (every part, gated on
    the bidirectional verification block with mask tokens), with no AR lockstep run."""
    from tests.tiny import save_tiny
    from toolchain.diffusion.form import DiffusionForm, write_form

    hf = save_tiny(tmp_path / "hf", "llama", seed=3)
    write_form(hf, DiffusionForm(mask_token_id=3))
    recipe = write_recipe(
        tmp_path / "d.yaml", hf, name="dlm-qnn",
        graphs="  diffusion: {width: 8, context: 64, role: diffusion}\n",
        extra="passes: [scale_rmsnorm, {split_layers: {at: [1]}}]\n"
              "qnn: {soc_model: 57, htp_arch: 75}\n",
    )
    recipe.write_text(recipe.read_text().replace("greedy_tokens: 12", "greedy_tokens: 0"))
    result = compile_recipe(recipe)
    records = result.manifest.qnn
    assert {r["graph"] for r in records} == {g.name for g in result.manifest.graphs} and len(records) == 2
    assert all(r["status"] == "verified" for r in records)
    assert result.manifest.qnn_lockstep is None


@pytest.mark.qnn
def test_qnn_lockstep_gate_fails_binaries_that_pick_other_tokens(tiny_dir, tmp_path, monkeypatch):
    """With the per-graph bounds switched off, the lockstep run alone must catch HTP binaries that
    decode other tokens (here: built from a copy whose lm_head weight is negated)."""
    from toolchain.errors import MobcError
    from toolchain.qnn import context as qnn

    real_build = qnn.build_context_binary

    def broken_build(path, out_dir, *args, **kwargs):
        model = ir.load(path)
        for value in model.graph.initializers.values():
            if "lm_head" in value.name or "embed_tokens" in value.name:
                value.const_value = ir.tensor(-value.const_value.numpy(), name=value.name)
        copy = Path(out_dir).parent / f"broken-{Path(path).stem}.onnx"
        ir.save(model, copy, external_data=f"{copy.stem}.bin")
        return real_build(copy, out_dir, *args, **kwargs)

    monkeypatch.setattr(qnn, "build_context_binary", broken_build)
    recipe = write_recipe(
        tmp_path / "q.yaml", tiny_dir, name="badqnn",
        graphs="  decode: {width: 1, context: 64}\n",
        extra="passes: [scale_rmsnorm]\n"
              "qnn: {soc_model: 57, htp_arch: 75, min_top1: 0, max_rel: null}\n",
    )
    with pytest.raises(MobcError, match="min_lockstep"):
        compile_recipe(recipe)
    assert not (tmp_path / "out" / "badqnn" / "manifest.json").exists()  # nothing that looks complete


def test_recipe_assets_are_copied_into_the_artifact_and_checked_before_any_work(tiny_dir, tmp_path, monkeypatch):
    """assets: shipped trained files land in the artifact under their names, hashed like every file;
    a missing one fails at once with the command that re-creates it, and leaves nothing."""
    from toolchain.artifact.manifest import Manifest
    from toolchain.errors import RecipeError

    shipped = tmp_path / "assets" / "pred.json"
    shipped.parent.mkdir()
    shipped.write_text('{"weights": [1, 2, 3]}')
    extra = "assets:\n  predictor.json: {file: assets/pred.json, made_by: mobc train predictor X}\n"
    recipe = write_recipe(tmp_path / "a.yaml", tiny_dir, name="withassets", extra=extra)
    recipe.write_text(recipe.read_text().replace("greedy_tokens: 12", "greedy_tokens: 0"))
    out = compile_recipe(recipe).out_dir
    assert (out / "predictor.json").read_text() == shipped.read_text()
    assert "predictor.json" in Manifest.load(out).files
    (out / "predictor.json").write_text('{"weights": [0]}')  # a damaged asset is caught like any file
    with pytest.raises(ArtifactError, match="predictor.json"):
        Manifest.load(out)

    (tmp_path / "m").mkdir()
    missing = write_recipe(tmp_path / "m" / "b.yaml", tiny_dir, name="missing", extra=extra)

    def no_model_load(*a, **k):
        raise AssertionError("the model was loaded before the missing asset was reported")

    monkeypatch.setattr("toolchain.compile.pipeline.load", no_model_load)
    with pytest.raises(RecipeError, match=r"assets.predictor.json.file: .*does not exist.*mobc train predictor X"):
        compile_recipe(missing)
    assert not (tmp_path / "m" / "out" / "missing").exists()
    for name in ("weights.bin", "decode.onnx", "../x.json"):
        bad = write_recipe(tmp_path / "c.yaml", tiny_dir, name="bad", extra=extra.replace("predictor.json", name))
        with pytest.raises(RecipeError, match="plain file name"):
            compile_recipe(bad)
