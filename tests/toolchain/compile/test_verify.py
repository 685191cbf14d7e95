"""Numeric verification fails on what it must: a difference over tolerance, and any NaN or inf
(max over NaN is NaN, and NaN > tolerance is False: a NaN graph would otherwise pass); `mobc verify`
exits non-zero on an artifact whose numbers no longer match its source model."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from tests.tiny import save_tiny, write_recipe
from toolchain.artifact.manifest import sha256_path
from toolchain.cli.main import app
from toolchain.compile.verify import check_tolerance, compare
from toolchain.errors import VerificationError

runner = CliRunner()


def _case(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "logits": rng.normal(size=(1, 4, 32)).astype(np.float32),
        "new_key_0": rng.normal(size=(2, 1, 8, 4)).astype(np.float32),
        "new_value_0": rng.normal(size=(2, 1, 4, 8)).astype(np.float32),
    }


def test_close_outputs_pass_and_far_ones_fail():
    ref = _case(np.random.default_rng(0))
    out = {k: v + 1e-5 for k, v in ref.items()}
    figures = compare(out, ref)
    assert figures["worst_max_abs"] == pytest.approx(1e-5, rel=1e-2) and figures["argmax_agree"] == 1.0
    check_tolerance("decode", figures, 1e-3)
    out["new_value_0"] = out["new_value_0"] + 0.5
    figures = compare(out, ref)
    assert figures["worst_output"] == "new_value_0"
    with pytest.raises(VerificationError, match=r"output new_value_0 differs from transformers by 0.5"):
        check_tolerance("decode", figures, 1e-3)


@pytest.mark.parametrize(
    ("output", "bad"),
    [
        ("logits", np.nan),
        ("logits", np.inf),
        ("new_key_0", np.nan),
        ("new_value_0", -np.inf),
    ],
)
def test_non_finite_outputs_fail_whatever_the_tolerance(output, bad):
    ref = _case(np.random.default_rng(1))
    out = {k: v.copy() for k, v in ref.items()}
    out[output][..., 0] = bad  # one slice non-finite, the rest exact
    figures = compare(out, ref)
    with pytest.raises(VerificationError, match=rf"graph 'decode': output {output} has non-finite values"):
        check_tolerance("decode", figures, 1e6)
    assert figures["worst_output"] == output and figures["non_finite"] == [output]


def test_non_finite_reference_fails_too():
    """NaN in both (a model that overflows in float32): a NaN difference, never a pass."""
    ref = _case(np.random.default_rng(2))
    ref["logits"][0, 0, 0] = np.nan
    out = {k: v.copy() for k, v in ref.items()}
    with pytest.raises(VerificationError, match="non-finite"):
        check_tolerance("prefill", compare(out, ref), 1.0)


# ---- `mobc verify` on a compiled artifact whose numbers were changed behind the checksums -----------


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    from toolchain.compile.pipeline import compile_recipe

    root = tmp_path_factory.mktemp("verify_cli")
    recipe = write_recipe(
        root / "v.yaml",
        save_tiny(root / "hf", "llama"),
        name="tiny-verify",
        graphs="  decode: {width: 1, context: 64}\n",
    )
    return compile_recipe(recipe).out_dir


def _tamper(src, dst, value: float | None, scale: float = 1.0, greedy_tokens: int | None = None):
    """Copy of `src` with the first 64 floats of layer 0's q_proj weight set to `value` (or scaled),
    its manifest checksums re-stamped so only the numeric checks can notice."""
    shutil.copytree(src, dst)
    model = onnx.load(dst / "decode.onnx", load_external_data=False)
    init = next(
        i
        for i in model.graph.initializer
        if "q_proj" in i.name and i.data_location == onnx.TensorProto.EXTERNAL
    )
    info = {e.key: e.value for e in init.external_data}
    offset = int(info.get("offset", 0))
    path = dst / info["location"]
    data = bytearray(path.read_bytes())
    w = np.frombuffer(bytes(data[offset : offset + 64 * 4]), np.float32).copy()
    w = np.full_like(w, value) if value is not None else w * scale
    data[offset : offset + 64 * 4] = w.tobytes()
    path.write_bytes(bytes(data))
    manifest = json.loads((dst / "manifest.json").read_text())
    for rel in manifest["files"]:
        manifest["files"][rel] = sha256_path(dst / rel)
    if greedy_tokens is not None:
        manifest["recipe"]["verify"] = {
            **manifest["recipe"].get("verify", {}),
            "greedy_tokens": greedy_tokens,
        }
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def test_cli_verify_passes_an_untouched_artifact(artifact):
    r = runner.invoke(app, ["verify", str(artifact)], terminal_width=160)
    assert r.exit_code == 0, r.output
    assert "verified" in r.output


def test_cli_verify_fails_on_changed_numbers(artifact, tmp_path):
    bad = _tamper(artifact, tmp_path / "scaled", None, scale=4.0)
    r = runner.invoke(app, ["verify", str(bad)], terminal_width=160)
    assert r.exit_code != 0 and "verified" not in r.output
    assert isinstance(r.exception, VerificationError), r.exception
    assert "differs from transformers" in str(r.exception)


def test_cli_verify_fails_on_nan_even_without_a_greedy_check(artifact, tmp_path):
    """The diffusion recipes verify with greedy_tokens: 0: the numeric check alone must catch NaN."""
    bad = _tamper(artifact, tmp_path / "nan", np.nan, greedy_tokens=0)
    r = runner.invoke(app, ["verify", str(bad)], terminal_width=160)
    assert r.exit_code != 0 and "verified" not in r.output
    assert isinstance(r.exception, VerificationError), r.exception
    assert "non-finite" in str(r.exception)


def test_teacher_forced_greedy_is_generate_up_to_the_first_difference():
    import torch

    from tests.passes.tiny import hf_model
    from toolchain.compile.verify import hf_greedy_of

    model = hf_model("llama")
    ids = [5, 17, 99, 3, 42]
    gen = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
    assert hf_greedy_of(model, ids, gen) == gen
    wrong = gen[:3] + [(gen[3] + 1) % model.config.vocab_size] + gen[4:]
    assert hf_greedy_of(model, ids, wrong) == gen[:4]  # generate's tokens through the first difference
