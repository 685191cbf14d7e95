"""Graph QAT: the torch execution of the QDQ graph is the graph (matches onnxruntime), training
moves only free 8-bit encodings, and what was learned is what the emitted graphs carry."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from tests.toolchain.quantize.test_qdq import assert_kv_tied
from toolchain.quantize.calibrate import corpus_tokens, family_feeds
from toolchain.quantize.graph_qat import QdqTorch, dequantize_constant, mean_kl, round_ste, torch_feeds
from toolchain.quantize.schema import QuantizeSpec
from toolchain.quantize.stage import quantize_artifact
from toolchain.runtime.sessions import ArtifactSessions

W8 = dict(activations="int8", kv_cache="int8", calibration={"samples": 2},
          overrides={"*norm*": {"activations": "int16"}})


@pytest.fixture
def ptq8(artifact, tokenizer):
    quantize_artifact(artifact, QuantizeSpec(**W8), tokenizer)
    return artifact


def _feed(artifact, tokenizer, family="prefill", seed=5):
    sessions = ArtifactSessions(artifact)
    return next(family_feeds(sessions, family, corpus_tokens(tokenizer, "heldout", 512), 1, seed=seed))


def test_round_ste_passes_gradients():
    x = torch.tensor([0.2, 1.7], requires_grad=True)
    round_ste(x).sum().backward()
    assert torch.equal(x.grad, torch.ones(2))


def test_blocked_dequantize_matches_the_definition():
    q = np.arange(-8, 8, dtype=np.int8).repeat(3).reshape(16, 3)  # [in, out], blocks of 4 along axis 0
    scale = np.array([[1.0, 2.0, 3.0], [0.5, 0.5, 0.5], [2.0, 1.0, 1.0], [4.0, 4.0, 4.0]], np.float32)
    out = dequantize_constant(q, scale, None, axis=0, block=4)
    for r in range(16):
        np.testing.assert_array_equal(out[r], q[r].astype(np.float32) * scale[r // 4])


@pytest.mark.parametrize("family", ["prefill", "decode"])
def test_torch_execution_is_the_qdq_graph(ptq8, tokenizer, family):
    path = ptq8 / "quantized" / f"{family}.onnx"
    feed = _feed(ptq8, tokenizer, family)
    # the QDQ graph's own semantics: onnxruntime without its fusions into integer kernels
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(["logits"], feed)[0]
    net = QdqTorch(onnx.load(path))
    with torch.no_grad():
        got = net({k: torch.from_numpy(v) for k, v in feed.items()})["logits"].numpy()
        flt = net({k: torch.from_numpy(v) for k, v in feed.items()}, quant=False)["logits"].numpy()
    assert np.abs(got - ref).max() < 1e-3 * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    float_ref = ArtifactSessions(ptq8).run_family(family, feed)["logits"]
    assert np.abs(flt - float_ref).max() < np.abs(got - float_ref).max()  # quant off: float activations


def _held_out_kl(graph, feeds) -> float:
    """KL(float activations || the graph's own encodings) of `graph` on `feeds`, computed afresh from
    the file (the teacher ignores activation encodings, so PTQ and QAT graphs share it)."""
    net = QdqTorch(onnx.load(graph))
    tf = [torch_feeds(f) for f in feeds]
    with torch.no_grad():
        teachers = [net(f, quant=False)["logits"] for f in tf]
    return mean_kl(net, teachers, tf)


def _qat_held_out_feeds(artifact, tokenizer, spec):
    """The held-out calls run_graph_qat chooses its checkpoint on (same text, same seed)."""
    sessions = ArtifactSessions(artifact)
    val = corpus_tokens(tokenizer, "heldout", spec.eval_tokens + 4 * sessions.layout("prefill").context)
    return list(family_feeds(sessions, "prefill", val[spec.eval_tokens :], 2, seed=spec.calibration.seed + 2))


def test_training_moves_free_encodings_only_and_they_land_in_every_graph(artifact, tokenizer):
    spec = QuantizeSpec(method="qat", **W8, qat={"steps": 10, "lr": 0.05, "feeds": 2})
    record = quantize_artifact(artifact, spec, tokenizer)
    rec = record["qat"]
    assert rec["steps"] == 10 and 0 < rec["learnable_encodings"] < rec["encodings"]
    # training learned something: measured 0.00147 -> 0.00075 in 10 steps (a QAT that learns nothing
    # keeps PTQ's encodings, best_step 0, and the KL before)
    assert rec["best_step"] > 0 and rec["held_out_kl_after"] < 0.8 * rec["held_out_kl_before"], rec
    assert [s for s, _ in rec["held_out_curve"]] == [0, 5, 10]
    q = artifact / "quantized"
    arrays = {g: {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(q / f"{g}.onnx").graph.initializer}
              for g in ("decode", "prefill")}
    shared = [k for k in arrays["prefill"] if k.endswith("_scale") and k in arrays["decode"]
              and arrays["prefill"][k].size == 1]
    assert all(np.array_equal(arrays["prefill"][k], arrays["decode"][k]) for k in shared)
    assert_kv_tied(q)  # training never moves the tied KV cache encodings
    kv = json.loads((q / "manifest.json").read_text())["quantization"]["kv_encodings"]["key_0"]
    assert arrays["decode"]["past_key_0_scale"] == pytest.approx(kv["scale"])
    # the emitted graph still runs in onnxruntime
    feed = _feed(artifact, tokenizer)
    ort.InferenceSession(str(q / "prefill.onnx"), providers=["CPUExecutionProvider"]).run(["logits"], feed)
    # the learned encodings are the trained ones: the emitted graph, measured afresh on the held-out
    # calls, has the KL training reported, and a PTQ graph of the same calibration has the KL before
    held = _qat_held_out_feeds(artifact, tokenizer, spec)
    qat_kl = _held_out_kl(q / "prefill.onnx", held)
    ptq_dir = artifact.parent / "ptq"
    shutil.copytree(artifact, ptq_dir, ignore=shutil.ignore_patterns("quantized"))
    quantize_artifact(ptq_dir, QuantizeSpec(**W8), tokenizer)
    ptq_kl = _held_out_kl(ptq_dir / "quantized" / "prefill.onnx", held)
    assert qat_kl == pytest.approx(rec["held_out_kl_after"], abs=2e-5)
    assert ptq_kl == pytest.approx(rec["held_out_kl_before"], abs=2e-5)
    ptq = {i.name: onnx.numpy_helper.to_array(i)
           for i in onnx.load(ptq_dir / "quantized" / "prefill.onnx").graph.initializer}
    moved = [k for k in shared if not np.array_equal(arrays["prefill"][k], ptq[k])]
    assert 0 < len(moved) < len(shared)  # some 8-bit encodings moved; the 16-bit and KV ones did not


def test_kl_ablation_names_the_groups_that_carry_the_error(ptq8, tokenizer):
    from toolchain.quantize.sensitivity import ablation_table, kl_ablation

    base, rows = kl_ablation(ptq8, tokenizer, "prefill", samples=1)
    by = {r["group"]: r for r in rows}
    assert base > 0 and {"layers.00", "layers.01"} <= set(by)
    # a layer's encodings in float can only remove error a little or a lot, never leave more than all of it
    assert all(0.0 <= r["kl"] <= 2 * base for r in rows)
    assert rows == sorted(rows, key=lambda r: -r["removed"])
    assert any(g.startswith("self_attn") for g in by) and any(g.startswith("mlp") for g in by)
    head, body = ablation_table(rows, top=3)
    assert len(body) == 3 and len(head) == 4
