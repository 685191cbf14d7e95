"""Hostile inputs end in one clear message and exit code 2, printed literally (issue 17, cases 4-8
and 10-13; 1-3 and 9 are in tests/toolchain/compile/test_emit.py and artifact/test_integrity.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.cli_main import run_main
from toolchain.errors import MobcError

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
SHIPPED_HEAD = RECIPES.parent / "assets" / "heads" / "smollm2-135m"


def _gguf_recipe(tmp_path: Path, blob: bytes) -> Path:
    (tmp_path / "model.gguf").write_bytes(blob)
    recipe = tmp_path / "g.yaml"
    recipe.write_text(
        f"name: g\nsource: {{gguf: {tmp_path / 'model.gguf'}}}\n"
        f"graphs: {{decode: {{width: 1, context: 8}}}}\noutput: {tmp_path / 'out'}\n"
    )
    return recipe


def test_case04_binary_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe binary")
    r = run_main("compile", recipe)
    assert r.clean_error, r.err
    assert "is not a text file" in r.err


def test_case05_truncated_or_garbage_gguf(tmp_path):
    truncated = b"GGUF\x03\x00\x00\x00\x05"  # the magic and version, then nothing
    r = run_main("compile", _gguf_recipe(tmp_path, truncated))
    assert r.clean_error, r.err
    assert "source gguf:" in r.err and "could not load the model" in r.err
    r = run_main("compile", _gguf_recipe(tmp_path, b"\x00" * 64))
    assert r.clean_error and "GGUF" in r.err
    assert not (tmp_path / "out").exists()


def test_case06_empty_prompt(tiny_artifact):
    r = run_main("run", tiny_artifact, "--prompt", "")
    assert r.clean_error, r.err
    assert "--prompt '' has no tokens" in r.err


def test_case07_negative_or_nan_temperature(tiny_artifact):
    for value in ("-1", "nan"):
        r = run_main("run", tiny_artifact, "--prompt", "hi", "--temperature", value)
        assert r.clean_error, r.err
        assert f"--temperature {float(value)}" in r.err


def test_a_policy_setting_out_of_range_is_refused_by_name(tiny_artifact):
    r = run_main("run", tiny_artifact, "--prompt", "hi", "--policy", "chain:extend=2", "--draft", tiny_artifact)
    assert r.clean_error, r.err
    assert "policy chain:extend=2: extend needs a number from 0 to 1" in r.err


def test_case08_adapter_config_that_is_not_json(artifact_copy, tmp_path):
    manifest = json.loads((artifact_copy / "manifest.json").read_text())
    manifest["passes"].append(
        {
            "pass": "lora_inputs",  # as if compiled with lora_inputs (not read further)
            "options": {"targets": ["q_proj"], "max_rank": 4, "slots": 1},
        }
    )
    (artifact_copy / "manifest.json").write_text(json.dumps(manifest))
    peft = tmp_path / "peft"
    peft.mkdir()
    (peft / "adapter_config.json").write_text("{'r': 8,")  # Python, not JSON
    r = run_main("adapter", "pack", artifact_copy, peft)
    assert r.clean_error, r.err
    assert "adapter_config.json is not valid JSON" in r.err


def test_case10_brackets_print_literally(tiny_artifact, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: Bad Name\nsource: {path: x}\ngraphs: {decode: {width: 1, context: 8}}\n")
    r = run_main("compile", recipe)
    assert r.clean_error, r.err
    assert "^[a-z0-9][a-z0-9._-]*$" in r.err
    peft = tmp_path / "peft"
    peft.mkdir()
    r = run_main("adapter", "pack", tiny_artifact, peft)  # compiled without lora_inputs: the fix is shown
    assert r.clean_error, r.err
    assert "{targets: [q_proj, v_proj], max_rank: 16}" in r.err


def test_case11_recipe_path_that_is_a_folder(tmp_path):
    r = run_main("compile", tmp_path)
    assert r.clean_error, r.err
    assert "is a folder, not a recipe file" in r.err and "does not exist" not in r.err


def test_case12_recipes_of_models_mobc_trains_say_how_to_make_them(tmp_path):
    """On a fresh checkout these sources do not exist: the message names the `mobc train` command and
    how long it runs (copies in tmp_path: the relative paths resolve where nothing was trained)."""
    for name, command in (
        ("smollm2-135m-diffusion.yaml", "mobc train diffusion"),
        ("smollm2-135m-draft.yaml", "mobc train draft"),
        ("smollm2-135m-draft-lever.yaml", "mobc train draft"),
    ):
        (tmp_path / "recipes").mkdir(exist_ok=True)
        recipe = shutil.copy(RECIPES / name, tmp_path / "recipes" / name)
        r = run_main("compile", recipe)
        assert r.clean_error, r.err
        assert "does not exist yet" in r.err and command in r.err and "minutes" in r.err


def test_case13_max_new_tokens_beyond_the_context(tiny_artifact):
    r = run_main("run", tiny_artifact, "--prompt", "def f(x):", "--max-new-tokens", "100")
    assert r.clean_error, r.err
    assert "--max-new-tokens 100" in r.err and "context of 32" in r.err
    r = run_main("run", tiny_artifact, "--prompt", "def f(x):")  # the default fits what there is room for
    assert r.code == 0, r.err


def test_case13_verify_prints_no_check_mark_for_a_failed_checksum(artifact_copy):
    with open(artifact_copy / "decode.onnx", "ab") as f:
        f.write(b"\0")
    r = run_main("verify", artifact_copy)
    assert r.clean_error, r.err
    assert "decode.onnx" in r.err and "✓ file checksums" not in r.out + r.err


def test_case13_inspect_warns_on_a_tampered_artifact(artifact_copy):
    with open(artifact_copy / "weights.bin", "r+b") as f:
        f.write(b"\1\2\3\4")
    r = run_main("inspect", artifact_copy)
    assert r.clean_error, r.err
    assert "warning:" in r.out and "weights.bin changed since the compile" in r.out + r.err
    assert "identical to generate" not in r.out


def test_case13_hub_compile_on_a_folder_that_is_not_an_artifact(tmp_path, monkeypatch):
    monkeypatch.setenv("QAIHUB_CLIENT_INI", str(tmp_path / "missing.ini"))  # and no token either
    r = run_main("hub", "compile", tmp_path)
    assert r.clean_error, r.err
    assert "no manifest.json" in r.err and "token" not in r.err


def test_head_training_shares_are_checked_before_any_work(tmp_path):
    """A budget share that leaves the teacher pass and the training nothing is refused at once."""
    out = tmp_path / "head"
    (junk := tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    for args, named in ((("--app-share", "0.9"), "--app-share 0.9"), (("--self-chat", "-1"), "--self-chat -1"),
                        (("--unroll", "0"), "--unroll 0"), (("--precision", "fp16"), "--precision 'fp16'"),
                        (("--answer-batch", "0"), "--answer-batch 0"), (("--generate-only",), "--onpolicy-cache FILE"),
                        (("--onpolicy-round", "1"), "--onpolicy-round 1: give K >= 1 with --generate-only"),
                        (("--unroll-mode", "tree"), "--unroll-mode 'tree': choose shift or chain"),
                        (("--onpolicy-extra", tmp_path / "r1.pt"), "r1.pt: no such file"),
                        (("--teacher-precision", "fp16"), "--teacher-precision 'fp16': choose fp32 or bf16"),
                        (("--generate-only", "--teacher-cache", tmp_path / "t.pt"), "--teacher-cache: the teacher pass"),
                        (("--generate-only", "--onpolicy-cache", tmp_path / "g.pt", "--until-end-of-turn"),
                         "--until-end-of-turn: it changes what a training run learns"),
                        (("--generate-only", "--onpolicy-extra", RECIPES / "smollm2-135m.yaml"),
                         "read by a training run"),
                        (("--steps", "100", "--minutes", "5"), "--steps 100: give N >= 1 training steps, without --minutes"),
                        (("--steps", "0"), "--steps 0: give N >= 1"),
                        (("--weight-decay", "-0.1"), "--weight-decay -0.1: give a decay from 0"),
                        (("--weight-decay", "1.5"), "--weight-decay 1.5: give a decay from 0"),
                        (("--extra-held-out", "8"), "--extra-held-out 8: give N >= 0 windows, with the --onpolicy-extra"),
                        (("--extra-held-out", "-1", "--onpolicy-extra", RECIPES / "smollm2-135m.yaml"),
                         "--extra-held-out -1: give N >= 0"),
                        (("--head-layers", "0"), "--head-layers 0: give 1 to 4 layers"),
                        (("--head-layers", "5"), "--head-layers 5: give 1 to 4 layers"),
                        (("--head-layers", "2", "--generate-only", "--onpolicy-cache", "x.pt"),
                         "--head-layers: it shapes the trained head"),
                        (("--dropout", "0.5"), "--dropout 0.5: give a rate from 0"),
                        (("--dropout", "-0.1"), "--dropout -0.1: give a rate from 0"),
                        (("--dropout", "0.1", "--generate-only", "--onpolicy-cache", "x.pt"),
                         "--dropout: it shapes the trained head"),
                        (("--argmax-weight", "-1"), "--argmax-weight -1.0: give a weight from 0"),
                        (("--argmax-weight", "11"), "--argmax-weight 11.0: give a weight from 0"),
                        (("--argmax-weight", "1", "--generate-only", "--onpolicy-cache", "x.pt"),
                         "--argmax-weight: it shapes the trained head"),
                        (("--checkpoint", "c.pt"), "--checkpoint c.pt: a run resumes step for step, so give it "
                         "with --steps N"),
                        (("--init", tmp_path / "nohead"), "nohead: no head there"),
                        (("--lr", "0"), "--lr 0.0: give a learning rate above 0"),
                        (("--init", SHIPPED_HEAD, "--head-layers", "1"), "--head-layers 1: --init "
                         f"{SHIPPED_HEAD} has 2 layers"),
                        (("--init", junk), "junk.safetensors: not a head this command wrote"),
                        (("--init", SHIPPED_HEAD, "--generate-only", "--onpolicy-cache", "x.pt"),
                         "--init: it shapes the trained head")):
        r = run_main("train", "draft", RECIPES / "smollm2-135m.yaml", "--kind", "head", "--out", out, *args)
        assert r.clean_error, r.err
        assert named in r.err
    assert not out.exists()
    r = run_main("train", "draft", RECIPES / "smollm2-135m.yaml", "--kind", "head")
    assert r.clean_error and "--out DIR" in r.err
    r = run_main("train", "draft", RECIPES / "smollm2-135m.yaml", "--out", out, "--steps", "10")
    assert r.clean_error and "--steps: a fixed step count is for --kind head" in r.err and not out.exists()
    r = run_main("train", "draft", RECIPES / "smollm2-135m.yaml", "--out", out, "--weight-decay", "0.1")
    assert r.clean_error and "--weight-decay: it is for --kind head" in r.err and not out.exists()
    r = run_main("train", "draft", RECIPES / "smollm2-135m.yaml", "--out", out, "--extra-held-out", "4")
    assert r.clean_error and "--extra-held-out: it is for --kind head" in r.err and not out.exists()
    r = run_main("train", "draft", RECIPES / "smollm2-135m.yaml", "--out", out, "--head-layers", "2")
    assert r.clean_error and "--head-layers: it is for --kind head" in r.err and not out.exists()
    r = run_main("train", "draft", RECIPES / "smollm2-135m.yaml", "--out", out, "--dropout", "0.1")
    assert r.clean_error and "--dropout: it is for --kind head" in r.err and not out.exists()
    r = run_main("train", "draft", RECIPES / "smollm2-135m.yaml", "--out", out, "--argmax-weight", "1")
    assert r.clean_error and "--argmax-weight: it is for --kind head" in r.err and not out.exists()
    r = run_main("train", "draft", RECIPES / "smollm2-135m.yaml", "--out", out, "--checkpoint", "c.pt")
    assert r.clean_error and "--checkpoint: it is for --kind head" in r.err and not out.exists()
    r = run_main("train", "draft", RECIPES / "smollm2-135m.yaml", "--kind", "head", "--generate-only")
    assert r.clean_error and "--onpolicy-cache FILE" in r.err  # generation alone writes no draft: no --out needed


_EXTRA = ("--onpolicy-extra", RECIPES / "smollm2-135m.yaml")  # a file that exists; never read here


@pytest.mark.parametrize("field, runs", [
    ("extra_held_out", [((*_EXTRA, "--extra-held-out", "8"), 8), ((*_EXTRA, "--extra-held-out", "0"), 0), (_EXTRA, 64)]),
    ("head_layers", [(("--head-layers", "2"), 2), ((), 1)]),
    ("dropout", [(("--dropout", "0.1"), 0.1), ((), 0.0)]),
    ("init", [(("--init", SHIPPED_HEAD), str(SHIPPED_HEAD)), ((), None)]),
    ("lr", [(("--lr", "3e-4"), 3e-4), ((), 1e-3)]),
    ("argmax_weight", [(("--argmax-weight", "0.5"), 0.5), ((), 0.0)]),
])
def test_head_options_reach_the_head_training(tmp_path, monkeypatch, field, runs):
    """--extra-held-out N, --head-layers N, --dropout P, --init, --lr and --argmax-weight W are the HeadConfig the
    training runs with (defaults without them)."""
    seen = []

    def stop(_recipe, _out, cfg, log=None):
        seen.append(cfg)
        raise MobcError("stopped before any work")

    monkeypatch.setattr("toolchain.train.head.train_head", stop)
    for args, _ in runs:
        r = run_main("train", "draft", RECIPES / "smollm2-135m.yaml", "--kind", "head", "--out", tmp_path / "h", *args)
        assert r.clean_error and "stopped before any work" in r.err, r.err
    assert [getattr(cfg, field) for cfg in seen] == [want for _, want in runs]
