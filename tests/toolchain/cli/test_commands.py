"""Commands through the CLI on tiny artifacts: user errors exit 2 with one line and no traceback
(the real `main()`, not CliRunner, which bypasses it), and run --policy lever|ahasd|dllm, eval ppl,
train forecast|predictor and adapter train|verify end to end."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from tests.tiny import save_tiny, tiny_tokenizer, write_recipe
from toolchain.cli.main import app, main
from toolchain.runtime.model import StepModel
from toolchain.runtime.policies import Sampler, make_policy

runner = CliRunner()
PROMPT = "def f(x):\n    return"


def mobc(capsys, monkeypatch, *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `mobc args...` through the console script's entry point."""
    monkeypatch.setattr(sys, "argv", ["mobc", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def assert_user_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err and err.strip().startswith("error:"), err
    for needle in needles:
        assert needle in err, (needle, err)


# ---- user errors ---------------------------------------------------------------------------


def test_run_with_an_unknown_policy(tree_artifacts, capsys, monkeypatch):
    target, _ = tree_artifacts
    code, _, err = mobc(capsys, monkeypatch, "run", str(target), "--prompt", "x", "--policy", "nosuch")
    assert_user_error(code, err, "unknown policy 'nosuch'", "chain", "lever")


def test_run_with_a_missing_artifact(tmp_path, capsys, monkeypatch):
    code, _, err = mobc(capsys, monkeypatch, "run", str(tmp_path / "nothing"), "--prompt", "x")
    assert_user_error(code, err, "nothing", "mobc compile")


def test_run_lever_without_a_draft(tree_artifacts, capsys, monkeypatch):
    target, _ = tree_artifacts
    code, _, err = mobc(capsys, monkeypatch, "run", str(target), "--prompt", "x", "--policy", "lever")
    assert_user_error(code, err, "--draft")


def _bench_decode(capsys, monkeypatch, artifacts, *args: str):
    """`mobc bench decode TARGET --draft DRAFT ARGS...` without llama.cpp, 8 new tokens."""
    target, draft = artifacts
    return mobc(capsys, monkeypatch, "bench", "decode", str(target), "--draft", str(draft), *args,
                "--no-llamacpp", "--max-new-tokens", "8")


@pytest.mark.parametrize(
    ("spec", "needle"),
    [("nonsense:3", "use humaneval:N, chat:N or file:PATH"), ("file:{tmp}/missing.txt", "missing.txt")],
    ids=["kind", "file"],
)
def test_bench_with_bad_prompts(tree_artifacts, tmp_path, capsys, monkeypatch, spec, needle):
    code, _, err = _bench_decode(capsys, monkeypatch, tree_artifacts, "--prompts", spec.format(tmp=tmp_path))
    assert_user_error(code, err, needle)


def test_bench_decode_with_an_unknown_policy(tree_artifacts, tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPT)
    code, _, err = _bench_decode(capsys, monkeypatch, tree_artifacts, "--policies", "ar,nosuch",
                                 "--prompts", f"file:{prompts}")
    assert_user_error(code, err, "unknown policy 'nosuch'")


def test_bench_decode_reports_prompt_processing_per_row(tree_artifacts, tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPT)
    out_json = tmp_path / "b.json"
    code, out, err = _bench_decode(capsys, monkeypatch, tree_artifacts, "--policies", "ar,chain",
                                   "--prompts", f"file:{prompts}", "--json", str(out_json))
    assert code == 0, err
    assert "prompt ms" in out
    rows = json.loads(out_json.read_text())["rows"]
    assert all(r["prompt_ms_median"] > 0 for r in rows)  # time to each policy's first new token


# ---- policies through `mobc run` -------------------------------------------------------------


def _run(*args: str, speculative: bool = False) -> str:
    res = runner.invoke(app, ["run", *args])
    assert res.exit_code == 0, (res.output, res.exception)
    # the closing stats line on stderr reports verify calls only for a policy that drafted
    assert ("tokens per target call" in res.stderr) == speculative, res.stderr
    return res.stdout


def test_run_lever_and_ahasd_print_ars_text(tree_artifacts, near_draft):
    target, _ = tree_artifacts
    common = [str(target), "--prompt", PROMPT, "--max-new-tokens", "16"]
    ar = _run(*common)
    assert ar.startswith(PROMPT) and len(ar) > len(PROMPT)
    for policy in ("lever", "ahasd"):
        assert _run(*common, "--policy", policy, "--draft", str(near_draft), speculative=True) == ar, policy


@pytest.fixture(scope="module")
def dlm(tmp_path_factory):
    from toolchain.compile.pipeline import compile_recipe
    from toolchain.diffusion.form import DiffusionForm, write_form

    root = tmp_path_factory.mktemp("cli_dlm")
    hf = save_tiny(root / "hf", "llama", seed=5)
    write_form(hf, DiffusionForm(mask_token_id=3))
    recipe = write_recipe(
        root / "d.yaml", hf, name="tiny-dlm", graphs="  diffusion: {width: 8, context: 64, role: diffusion}\n"
    )
    recipe.write_text(recipe.read_text().replace("greedy_tokens: 12", "greedy_tokens: 0"))
    return compile_recipe(recipe).out_dir


def test_run_dllm_prints_the_policys_tokens(dlm):
    out = _run(str(dlm), "--prompt", PROMPT, "--max-new-tokens", "16", "--policy", "dllm")
    model = StepModel(dlm)
    ids = tiny_tokenizer()(PROMPT).input_ids
    tokens = [t for c in make_policy("dllm", model).generate(ids, 16, Sampler()) for t in c]
    assert out == PROMPT + model.tokenizer.decode(tokens, skip_special_tokens=True)


# ---- eval, train and adapter commands ------------------------------------------------------


def test_eval_ppl_prints_the_artifacts_perplexity(tree_artifacts):
    from toolchain.quantize.ppl import eval_artifact

    target, _ = tree_artifacts
    res = runner.invoke(app, ["eval", "ppl", str(target), "--tokens", "128"], terminal_width=200)
    assert res.exit_code == 0, (res.output, res.exception)
    want = eval_artifact(target, 128)["rows"]["float"]["ppl"]
    assert f"{want:.3f}" in res.stdout and "float" in res.stdout


def test_train_predictor_writes_a_predictor_lever_prune_uses(tree_artifacts, near_draft, tmp_path):
    target, _ = tree_artifacts
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n---\n".join([PROMPT, "import os\nimport sys\n", "class A:\n    def __init__(self"]))
    out = tmp_path / "predictor.json"
    res = runner.invoke(
        app,
        [
            "train",
            "predictor",
            str(target),
            "--draft",
            str(near_draft),
            "--prompts",
            f"file:{prompts}",
            "--skip",
            "0",
            "--minutes",
            "0.5",
            "--max-new-tokens",
            "24",
            "--out",
            str(out),
        ],
        terminal_width=200,
    )
    assert res.exit_code == 0, (res.output, res.exception)
    spec = json.loads(out.read_text())
    assert spec["layer"] == 1 and len(spec["weights"]) == 5 and "held-out: precision" in res.stdout
    # lever+prune with that predictor is still lossless
    t, d = StepModel(target), StepModel(near_draft)
    ids = tiny_tokenizer()(PROMPT).input_ids
    pruned = make_policy("lever+prune", t, d, predictor=str(out))
    ar = [x for c in make_policy("ar", t).generate(ids, 16, Sampler()) for x in c]
    assert [x for c in pruned.generate(ids, 16, Sampler()) for x in c] == ar


def test_train_forecast_then_run_ds2d(lora_artifact, tmp_path):
    artifact, _ = lora_artifact
    out = tmp_path / "forecast.npz"
    res = runner.invoke(
        app,
        [
            "train",
            "forecast",
            str(artifact),
            "--minutes",
            "0.02",
            "--seq-len",
            "32",
            "--anchors",
            "4",
            "--out",
            str(out),
        ],
        terminal_width=200,
    )
    assert res.exit_code == 0, (res.output, res.exception)
    emb = np.load(out)["forecast_embeds"]
    assert emb.ndim == 2 and emb.shape[1] == 64 and np.isfinite(emb).all()
    common = [str(artifact), "--prompt", PROMPT, "--max-new-tokens", "10"]
    assert _run(*common, "--policy", "ds2d", "--forecast", str(out), speculative=True) == _run(
        *common
    )  # lossless


def test_adapter_train_pack_verify(lora_artifact, tmp_path):
    artifact, _ = lora_artifact
    peft = tmp_path / "style"
    res = runner.invoke(
        app,
        [
            "adapter",
            "train",
            str(artifact),
            "--out",
            str(peft),
            "--steps",
            "3",
            "--rank",
            "4",
            "--seq-len",
            "32",
        ],
        terminal_width=200,
    )
    assert res.exit_code == 0, (res.output, res.exception)
    assert (peft / "adapter_config.json").is_file() and "trained" in res.stdout
    res = runner.invoke(app, ["adapter", "pack", str(artifact), str(peft), "--name", "cli-style"])
    assert res.exit_code == 0, (res.output, res.exception)
    js = tmp_path / "verify.json"
    res = runner.invoke(
        app,
        [
            "adapter",
            "verify",
            str(artifact),
            "cli-style",
            "--tokens",
            "16",
            "--greedy",
            "6",
            "--json",
            str(js),
        ],
        terminal_width=200,
    )
    assert res.exit_code == 0, (res.output, res.exception)
    row = json.loads(js.read_text())["rows"][0]
    # the artifact with the adapter bound computes PEFT's model, and the adapter really changes it
    assert row["artifact_vs_peft"] < 1e-3 and row["peft_vs_base"] > 10 * row["artifact_vs_peft"]
    assert row["greedy_identical"]


def test_train_draft_and_diffusion_write_models_that_compile(tmp_path):
    """`mobc train draft` (with --recipe-out) and `mobc train diffusion` on a tiny recipe, a second of
    training each: the outputs are Hugging Face folders the compiler reads (the draft's recipe compiles)."""
    from toolchain.compile.pipeline import compile_recipe
    from toolchain.diffusion.form import read_form

    recipe = write_recipe(tmp_path / "t.yaml", save_tiny(tmp_path / "hf", "llama"), name="tiny-target")
    res = runner.invoke(
        app,
        [
            "train",
            "draft",
            str(recipe),
            "--out",
            str(tmp_path / "draft"),
            "--layers",
            "1",
            "--minutes",
            "0.01",
            "--seq-len",
            "32",
            "--corpus-tokens",
            "2048",
            "--recipe-out",
            str(tmp_path / "draft.yaml"),
        ],
        terminal_width=200,
    )
    assert res.exit_code == 0, (res.output, res.exception)
    assert "held-out top-1 agreement" in res.stdout
    assert compile_recipe(tmp_path / "draft.yaml", out=tmp_path / "draft-art").manifest.model.n_layers == 1
    res = runner.invoke(
        app,
        [
            "train",
            "diffusion",
            str(recipe),
            "--out",
            str(tmp_path / "dlm"),
            "--minutes",
            "0.01",
            "--seq-len",
            "32",
            "--block",
            "8",
            "--mask-token",
            "<pad>",
        ],
        terminal_width=200,
    )
    assert res.exit_code == 0, (res.output, res.exception)
    assert read_form(tmp_path / "dlm") is not None
