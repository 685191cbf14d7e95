"""The quantized graphs' HTP check on a tiny artifact: context binaries build, lockstep greedy agrees with CPU QDQ."""

from __future__ import annotations

import json

import pytest

from toolchain.qnn import context as qnn
from toolchain.quantize.qnn_check import check_quantized


@pytest.mark.qnn
def test_quantized_graphs_build_and_follow_the_cpu_simulation(compiled, tmp_path):
    lines: list[str] = []
    r = check_quantized(compiled / "quantized", tmp_path, greedy_tokens=8, log=lines.append)
    assert set(r["graphs"]) == {"decode", "prefill"}
    for g in r["graphs"].values():
        assert g["context_bytes"] > 0 and g["argmax_agreement"] == 1.0
    # the HTP runs the integer kernels the CPU simulates: max logit diff 0.025 with the 16-bit MatMuls
    # as Conv / Mul+ReduceSum (htp_precise), 0.036 with HTP's own 16-bit MatMul (measured); a random
    # tiny model's top logits can sit closer than that, so one flip in 8 tokens is tolerated (not two)
    g = r["greedy"]
    assert g["tokens"] == 8 and g["argmax_agreement"] >= 7 / 8 and g["logits_max_abs"] < 0.03
    # each flip is listed with the CPU's own gap to the HTP's pick, which a flip bounds by twice the diff
    assert len(g["flips"]) == round(8 * (1 - g["argmax_agreement"]))
    assert all(0 <= f["cpu_gap"] <= 2 * g["logits_max_abs"] for f in g["flips"])
    assert any(m.startswith("lockstep token 8/8") for m in lines)
    # the float lane: the steps kept (the CPU's token or the float graphs') include every agreeing one
    assert set(g["argmax_vs_float"]) == {"cpu", "htp"} and g["argmax_kept"] >= g["argmax_agreement"]
    assert all("htp_is_float" in f for f in g["flips"])
    assert json.loads((tmp_path / "qnn_check.json").read_text())["greedy"]["tokens"] == 8
    # measured against the float artifact the quantized one sits in, as the compile's gate
    for g in r["graphs"].values():
        assert set(g["argmax_vs_float"]) == {"cpu", "htp"} and g["excess_rel_max"] < 0.05


def test_the_lockstep_keeps_a_step_where_the_htp_picks_the_float_models_token(artifact, tokenizer):
    """The lockstep's float lane: the CPU simulation and the HTP are two roundings of one quantized
    model, so a step where the HTP leaves the CPU's token for the float model's own is kept. Run on the
    CPU with the float graphs standing in for an HTP that rounds exactly like the float model: every
    step is then kept, while the CPU's own token differs on some (W4A8 on a random tiny model)."""
    from toolchain.qnn.lockstep import lockstep_greedy
    from toolchain.quantize.schema import QuantizeSpec
    from toolchain.quantize.stage import quantize_artifact
    from toolchain.runtime.sessions import ArtifactSessions

    quantize_artifact(artifact, QuantizeSpec(weights="int4", granularity="block", block_size=16, activations="int8",
                                             calibration={"samples": 2}), tokenizer)
    quantized, floats = ArtifactSessions(artifact / "quantized"), ArtifactSessions(artifact)
    ids = tokenizer("def fibonacci(n):\n").input_ids
    r = lockstep_greedy(quantized, floats, ids, 16, reference=floats)
    assert r["argmax_agreement"] < 1  # else the float lane decides nothing here
    assert r["argmax_vs_float"] == {"cpu": r["argmax_agreement"], "htp": 1.0} and r["argmax_kept"] == 1.0
    assert r["flips"] and all(f["htp_is_float"] for f in r["flips"])
    # without the float lane only the CPU's token counts
    plain = lockstep_greedy(quantized, floats, ids, 16)
    assert plain["argmax_kept"] == plain["argmax_agreement"] == r["argmax_agreement"]
    assert "argmax_vs_float" not in plain
    # an "HTP" that rounds like the CPU picks the float token exactly where the CPU does
    same = lockstep_greedy(quantized, ArtifactSessions(artifact / "quantized"), ids, 16, reference=floats)
    assert same["argmax_agreement"] == 1.0 and same["argmax_vs_float"]["htp"] == same["argmax_vs_float"]["cpu"]


@pytest.mark.qnn
def test_eval_qnn_prints_how_the_cpu_and_the_htp_agree_with_float(compiled, tmp_path):
    from typer.testing import CliRunner

    from toolchain.cli.main import app

    res = CliRunner().invoke(app, ["eval", "qnn", str(compiled), "--tokens", "2", "--out", str(tmp_path)],
                             terminal_width=200)
    assert res.exit_code == 0, res.output
    assert "HTP = float" in res.output and "excess vs float" in res.output
    assert "decode" in res.output and "prefill" in res.output


@pytest.mark.qnn
def test_block_weights_with_8bit_activations_are_explained(artifact, tokenizer, tmp_path):
    from toolchain.quantize.schema import QuantizeSpec
    from toolchain.quantize.stage import quantize_artifact

    quantize_artifact(artifact, QuantizeSpec(weights="int4", granularity="block", block_size=16,
                                             activations="int8", calibration={"samples": 2}), tokenizer)
    with pytest.raises(qnn.QnnCompileError, match=r"(?s)MatMul 'layers\.0\..*16-bit activations.*per_channel"):
        qnn.build_context_binary(artifact / "quantized" / "decode.onnx", tmp_path)


@pytest.mark.qnn
def test_lpbq_gives_8bit_activation_matmuls_a_weight_form_htp_runs(artifact, tokenizer, tmp_path):
    """The same W4A8 scheme with lpbq: true: the MatMuls HTP refused above get LPBQ weights, the binary
    builds and computes what the CPU simulation of the rewritten graph computes."""
    from toolchain.quantize.schema import QuantizeSpec
    from toolchain.quantize.stage import quantize_artifact

    rec = quantize_artifact(artifact, QuantizeSpec(weights="int4", granularity="block", block_size=16,
                                                   activations="int8", calibration={"samples": 2}, lpbq=True),
                            tokenizer)
    forms = {r["form"] for recs in rec["lpbq_by_graph"].values() for r in recs}
    assert "lpbq int4" in forms
    src = artifact / "quantized" / "decode.onnx"
    binary = qnn.build_context_binary(src, tmp_path)
    cmp = qnn.run_and_compare(src, binary.model, qnn.random_feeds(src))
    assert cmp.argmax_agreement["logits"] == 1.0


@pytest.mark.qnn
def test_w4a8_with_16bit_norms_writes_its_8bit_value_cache_through_a_convert_htp_runs(artifact, tokenizer, tmp_path):
    """SmolLM2's W4A8 scheme (16-bit norms, 8-bit KV): v_proj tied straight to the 8-bit cache was
    refused here; written at 16 bits and converted, it builds and is within the gate."""
    from toolchain.quantize.schema import QuantizeSpec
    from toolchain.quantize.stage import quantize_artifact

    quantize_artifact(artifact, QuantizeSpec(weights="int4", granularity="block", block_size=16, activations="int8",
                                             kv_cache="int8", overrides={"*norm*": {"activations": "int16"}},
                                             calibration={"samples": 2}, lpbq=True), tokenizer)
    src = artifact / "quantized" / "decode.onnx"
    binary = qnn.build_context_binary(src, tmp_path)
    cmp = qnn.run_and_compare(src, binary.model, qnn.random_feeds(src))
    # layer 0's rows depend on the token alone (random feeds put layer 1's past cache far outside the
    # calibrated ranges): measured 1.6% of their range for values and keys
    assert cmp.max_rel["new_value_0"] < qnn.QnnSpec().max_rel and cmp.max_rel["new_key_0"] < qnn.QnnSpec().max_rel


@pytest.mark.qnn
def test_float_residual_graphs_are_checked_in_the_htp_fp16_mode_and_follow_the_cpu(artifact, tokenizer, tmp_path):
    """W4A16 with float_residual: both graphs (float Adds and L2 norms beside the integer kernels) build
    on the HTP and keep the CPU's argmax. (The fp16 flag `mobc eval qnn` then sets explicitly is also
    onnxruntime-qnn's default: with it unset these graphs build alike, measured.)"""
    from toolchain.quantize.schema import QuantizeSpec
    from toolchain.quantize.stage import quantize_artifact

    rec = quantize_artifact(artifact, QuantizeSpec(weights="int4", granularity="block", block_size=16,
                                                   activations="int16", calibration={"samples": 2},
                                                   float_residual=True), tokenizer)
    assert rec["float_residual_by_graph"]["prefill"]["norms"] == 4
    r = check_quantized(artifact / "quantized", tmp_path, greedy_tokens=4)
    for g in r["graphs"].values():
        assert g["argmax_agreement"] == 1.0
    assert r["greedy"]["argmax_agreement"] >= 3 / 4


@pytest.mark.qnn
def test_a_quantized_recipes_qnn_section_builds_its_quantized_graphs(tiny_src, tmp_path):
    """A quantized recipe with a qnn: section: mobc compile builds an HTP binary of every quantized
    graph (integer kernels), gates each against the CPU QDQ simulation and runs the lockstep; the
    float graphs (not HTP-ready without the NPU passes) get none. W4A16: at 8-bit activations a
    random tiny model's near-uniform logits flip on one quantization step (measured: 1 of 4 lockstep
    tokens kept), which says nothing about the binaries; LPBQ's own HTP run is the test above."""
    from tests.tiny import write_recipe
    from toolchain.artifact.manifest import Manifest
    from toolchain.compile.pipeline import compile_recipe

    quant = ("quantize:\n  weights: int4\n  granularity: block\n  block_size: 16\n  activations: int16\n"
             "  calibration: {samples: 2}\n  eval_tokens: 128\n"
             "qnn: {soc_model: 57, htp_arch: 75, lockstep_tokens: 4, min_lockstep: 0.75}\n")
    recipe = write_recipe(tmp_path / "q.yaml", tiny_src, name="w4a16htp",
                          graphs="  decode: {width: 1, context: 64}\n  prefill: {width: 8, context: 64}\n",
                          extra=quant)
    recipe.write_text(recipe.read_text().replace("greedy_tokens: 12", "greedy_tokens: 4"))
    result = compile_recipe(recipe)
    assert result.manifest.qnn is None
    q = result.manifest.quantization["qnn"]
    assert {r["graph"] for r in q["graphs"]} == {"decode", "prefill"}
    assert all(r["status"] == "verified" and r["fp16"] is False for r in q["graphs"])
    assert all(r["verify"]["calls"] == 2 for r in q["graphs"])  # past 0, and a call with a cache behind it
    assert all(set(r["verify"]["argmax_vs_float"]["logits"]) == {"cpu", "htp"} for r in q["graphs"])
    assert q["lockstep"]["tokens"] == 4 and set(q["lockstep"]["argmax_vs_float"]) == {"cpu", "htp"}
    qm = Manifest.load(result.out_dir / "quantized")
    assert qm.qnn_lockstep["tokens"] == 4 and len(qm.qnn) == 2
    # `mobc eval qnn` afterwards checks the compile's binaries as they are: rebuilt in place they
    # differed byte for byte and the artifact read as damaged
    lines: list[str] = []
    check_quantized(result.out_dir / "quantized", greedy_tokens=2, log=lines.append)
    assert sum(m.startswith("checking the compile's HTP context binary") for m in lines) == 2
    Manifest.load(result.out_dir / "quantized")  # raises on a changed file


def _weights_scaled(src, dst, weight: str, factor: float) -> None:
    """A copy of the QDQ graph `src` whose `weight` dequantizes `factor` times too large: the binary of
    a graph whose numbers are not the simulation's. (An activation's DQ scale changed alone is not
    enough: the QNN EP takes a Q/DQ pair's encoding from one of them, measured.)"""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(src)
    inits = {i.name: i for i in model.graph.initializer}
    (dq,) = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == weight]
    scale = numpy_helper.to_array(inits[dq.input[1]]) * np.float32(factor)
    model.graph.initializer.append(numpy_helper.from_array(scale, f"{weight}_broken_scale"))
    dq.input[1] = f"{weight}_broken_scale"
    onnx.save(model, dst, save_as_external_data=True, location=f"{dst.name}.data")


@pytest.mark.qnn
def test_the_quantized_gate_measures_against_the_float_graph_and_fails_a_broken_binary(artifact, tokenizer, tmp_path,
                                                                                       monkeypatch):
    """Quantized graphs are gated with their float originals as the reference (two calls each): a faithful
    W4A16 binary passes and records how the CPU and the HTP agree with float; a binary whose layer-0
    v_proj weights are 1.5x too large fails."""
    from toolchain.quantize.calibrate import corpus_tokens
    from toolchain.quantize.qnn_check import float_outputs, gate_calls
    from toolchain.quantize.schema import QuantizeSpec
    from toolchain.quantize.stage import quantize_artifact
    from toolchain.runtime.sessions import ArtifactSessions

    quantize_artifact(artifact, QuantizeSpec(weights="int4", granularity="block", block_size=16, activations="int16",
                                             calibration={"samples": 2}), tokenizer)
    q = artifact / "quantized"
    calls = gate_calls(ArtifactSessions(q), corpus_tokens(tokenizer, "heldout", 256))
    refs = float_outputs(artifact, calls)
    spec = qnn.QnnSpec(fp16=False)
    (rec,) = qnn.emit_qnn({"decode": q / "decode.onnx"}, tmp_path / "ok", spec, {"decode": calls["decode"]}, refs)
    v = rec["verify"]
    assert v["calls"] == 2 and v["argmax_agreement"]["logits"] == 1.0
    assert set(v["argmax_vs_float"]["logits"]) == {"cpu", "htp"} and max(v["excess_rel"].values()) < 0.05
    _weights_scaled(q / "decode.onnx", q / "decode_broken.onnx", "layers.0.self_attn.v_proj.weight_quantized", 1.5)
    real_build = qnn.build_context_binary
    monkeypatch.setattr(qnn, "build_context_binary",
                        lambda path, *a, **kw: real_build(q / "decode_broken.onnx", *a, **kw))
    # measured: new_value_0 0.48 off the CPU, 0.40 farther from float than the CPU is
    with pytest.raises(qnn.QnnMismatchError, match="new_value_0.*farther from the float graph"):
        qnn.emit_qnn({"decode": q / "decode.onnx"}, tmp_path / "bad", spec, {"decode": calls["decode"]}, refs)
