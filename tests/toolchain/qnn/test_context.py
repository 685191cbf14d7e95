"""QNN HTP context binaries of tiny step graphs, built and run on the emulated HTP (onnxruntime-qnn)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper
from pydantic import ValidationError

from passes import build
from tests.passes.tiny import feeds_for, tiny
from toolchain.qnn import context as qnn


def _save(model: ir.Model, folder, name: str) -> str:
    path = folder / f"{name}.onnx"
    ir.save(model, path, external_data=f"{name}.bin")
    return str(path)


@pytest.mark.qnn
def test_tiny_step_graph_builds_and_matches_cpu(tmp_path):
    layout, model = tiny("llama")
    build("scale_rmsnorm")(model)
    src = _save(model, tmp_path, "decode")
    feeds = feeds_for(layout)
    records = qnn.emit_qnn({"decode": src}, tmp_path / "out", qnn.QnnSpec(max_abs=0.05), {"decode": feeds})
    (rec,) = records
    assert rec["status"] == "verified"
    out = tmp_path / "out"
    assert (out / rec["context_model"]).exists()
    assert rec["binaries"] and all((out / b).stat().st_size > 0 for b in rec["binaries"])
    # the context model holds only the EPContext node: the graph really is one QNN binary
    ctx = onnx.load(out / rec["context_model"], load_external_data=False)
    assert [n.op_type for n in ctx.graph.node] == ["EPContext"]
    verify = rec["verify"]
    assert set(verify["max_abs"]) == {name for name, _, _ in layout.outputs()}
    assert verify["worst_max_abs"] < 0.05  # fp16 HTP vs fp32 CPU on O(1) activations
    assert verify["argmax_agreement"]["logits"] == 1.0
    assert not list(out.glob(".*-qnn-*"))  # the temporary build folder is gone


@pytest.mark.qnn
def test_massive_activation_row_survives_fp16(tmp_path):
    """A row with one entry of 2e4 next to O(0.01) entries (SmolLM2's attention-sink token).

    Regression: x / max|x| with max|x| > 2^14 divides through an fp16-subnormal reciprocal that
    the HTP flushes to zero, which zeroed the whole row's norm (and every later token's attention).
    """
    layout, model = tiny("llama")
    feeds = feeds_for(layout)
    emb = model.graph.initializers["embed_tokens.weight"]
    table = emb.const_value.numpy().copy()
    table[int(feeds["input_ids"][0, 0]), 5] = 2.0e4
    emb.const_value = ir.tensor(table, name=emb.name)
    build("scale_rmsnorm")(model)
    src = _save(model, tmp_path, "sink")
    binary = qnn.build_context_binary(src, tmp_path / "out")
    cmp = qnn.run_and_compare(src, binary.model, feeds)
    for name in ("new_key_0", "new_value_0", "new_key_1", "new_value_1"):
        assert cmp.max_abs[name] < 0.02, (name, cmp.max_abs[name])


@pytest.mark.qnn
def test_raw_export_fails_to_finalize_and_names_the_fix(tmp_path):
    _, model = tiny("llama")
    src = _save(model, tmp_path, "raw")
    with pytest.raises(qnn.QnnCompileError) as err:
        qnn.build_context_binary(src, tmp_path / "out")
    msg = str(err.value)
    assert "QNN_COMMON_ERROR_MEM_ALLOC" in msg
    assert "layers.0.input_layernorm/Pow" in msg and "scale_rmsnorm" in msg


@pytest.mark.qnn
def test_unsupported_node_is_named(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"], name="ok/Relu"), helper.make_node("Det", ["r"], ["y"], name="bad/Det")],
        "g", [x], [y],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    proto.ir_version = 10
    path = tmp_path / "det.onnx"
    onnx.save(proto, path)
    with pytest.raises(qnn.QnnCompileError, match=r"Det 'bad/Det'"):
        qnn.build_context_binary(path, tmp_path / "out")


@pytest.mark.qnn
def test_mismatch_beyond_tolerance_fails_with_the_output_name(tmp_path):
    layout, model = tiny("llama")
    build("scale_rmsnorm")(model)
    src = _save(model, tmp_path, "decode")
    spec = qnn.QnnSpec(max_abs=1e-9, verify=True)
    with pytest.raises(qnn.QnnMismatchError, match="'decode': output"):
        qnn.emit_qnn({"decode": src}, tmp_path / "out", spec, {"decode": feeds_for(layout)})


def _broken_copy(model: ir.Model, folder, name: str) -> str:
    """The same graph with the lm_head's weight negated: what a binary built from a stale or
    corrupted graph computes."""
    broken = model.clone()
    for value in broken.graph.initializers.values():
        if value.name.startswith("lm_head") or value.name.startswith("embed_tokens"):
            value.const_value = ir.tensor(-value.const_value.numpy(), name=value.name)
    return _save(broken, folder, name)


@pytest.mark.qnn
def test_default_gate_passes_a_faithful_binary_and_fails_a_broken_one(tmp_path, monkeypatch):
    """The default qnn: gate (top-1 agreement of logits rows, K/V within 5% of their own scale)
    holds for a float graph in fp16 and refuses a binary whose numbers are not the graph's."""
    layout, model = tiny("llama", 4)
    build("scale_rmsnorm")(model)
    src = _save(model, tmp_path, "decode")
    feeds = {"decode": feeds_for(layout)}
    (rec,) = qnn.emit_qnn({"decode": src}, tmp_path / "ok", qnn.QnnSpec(), feeds)
    assert rec["verify"]["argmax_agreement"]["logits"] == 1.0
    assert max(rec["verify"]["max_rel"][k] for k in rec["verify"]["max_rel"] if k != "logits") < 0.05
    bad = _broken_copy(model, tmp_path, "broken")
    real_build = qnn.build_context_binary
    monkeypatch.setattr(qnn, "build_context_binary", lambda path, *a, **kw: real_build(bad, *a, **kw))
    with pytest.raises(qnn.QnnMismatchError, match="min_top1|max_rel"):
        qnn.emit_qnn({"decode": src}, tmp_path / "bad", qnn.QnnSpec(), feeds)


def test_qnn_spec_validates_keys_and_arch():
    assert qnn.QnnSpec().provider_options() == {
        "backend_type": "htp", "soc_model": "57", "htp_arch": "75", "enable_htp_fp16_precision": "1",
    }
    assert "enable_htp_fp16_precision" not in qnn.QnnSpec(fp16=False).provider_options()
    with pytest.raises(ValidationError, match="htp_arch"):
        qnn.QnnSpec(htp_arch=76)
    with pytest.raises(ValidationError, match="extra"):
        qnn.QnnSpec(soc=57)


def test_skip_when_unavailable_is_recorded(monkeypatch, tmp_path):
    monkeypatch.setattr(qnn, "availability", lambda: (False, "no wheel for this platform"))
    records = qnn.emit_qnn({"decode": "x.onnx"}, tmp_path, qnn.QnnSpec(on_unavailable="skip"))
    assert records == [{"graph": "decode", "status": "skipped", "reason": "no wheel for this platform"}]
    with pytest.raises(qnn.QnnUnavailableError, match="onnxruntime-qnn"):
        qnn.emit_qnn({"decode": "x.onnx"}, tmp_path, qnn.QnnSpec())


def test_compare_counts_non_finite_as_worst():
    cpu = {"logits": np.zeros((1, 2, 4), np.float32), "h": np.ones(3, np.float32)}
    got = {"logits": np.array([[[0, 1, 0, 0], [0, 0, 0, 0]]], np.float32), "h": np.array([1, np.inf, 1], np.float32)}
    c = qnn.compare(cpu, got)
    assert c.max_abs["logits"] == 1.0 and c.max_abs["h"] == float("inf")
    assert c.argmax_agreement["logits"] == 0.5
    assert c.worst == ("h", float("inf"))


def test_the_gate_over_several_calls_is_the_worst_of_each_output():
    cpu = {"logits": np.array([[[1.0, 0.0], [1.0, 0.0]]], np.float32), "h": np.ones(2, np.float32)}
    early = qnn.compare(cpu, {"logits": cpu["logits"], "h": np.array([1.0, 1.5], np.float32)})
    late = qnn.compare(cpu, {"logits": np.array([[[0.0, 1.0], [1.0, 0.0]]], np.float32), "h": cpu["h"]})
    both = qnn.worst_of([early, late])
    assert both.max_rel == {"logits": 1.0, "h": 0.5} and both.argmax_agreement == {"logits": 0.5}
    assert qnn.worst_of([late, early]).max_abs == both.max_abs


def test_a_quantized_output_may_differ_from_the_cpu_as_far_as_the_cpu_differs_from_float():
    """With the float graph as reference (quantized graphs), the HTP and the CPU simulation are two
    roundings of one model: a row keeps its token when the HTP picks the CPU's or the float's, and a
    K/V row may be as far from the CPU as the CPU is from float, not farther."""
    flt = {"logits": np.array([[[1.0, 0.9, 0.0]]]), "k": np.array([1.0, -1.0, 0.5])}
    cpu = {"logits": np.array([[[0.9, 1.0, 0.0]]]), "k": np.array([1.0, -0.9, 0.5])}  # 0.1 from float
    htp = {"logits": np.array([[[1.0, 0.9, 0.0]]]), "k": np.array([0.9, -1.0, 0.5])}  # 0.1 from float too
    c = qnn.compare(cpu, htp, 0.02, flt)
    assert c.argmax_agreement["logits"] == 1.0 and c.argmax_vs_cpu["logits"] == 0.0
    assert c.argmax_vs_float["logits"] == {"cpu": 0.0, "htp": 1.0}
    assert c.max_rel["k"] == pytest.approx(0.1) and c.excess_rel["k"] == pytest.approx(0.0)
    qnn.check_gate("decode", c, qnn.QnnSpec())  # 10% off the CPU, but no farther from float than it
    with pytest.raises(qnn.QnnMismatchError, match="min_top1"):  # without the reference: a flip
        qnn.check_gate("decode", qnn.compare(cpu, htp, 0.02), qnn.QnnSpec())
    htp["k"] = np.array([1.0, -0.9, 0.8])  # 0.3 from float where the CPU is 0.1
    c = qnn.compare(cpu, htp, 0.02, flt)
    assert c.excess_rel["k"] == pytest.approx(0.2)
    with pytest.raises(qnn.QnnMismatchError, match=r"'k'.*0\.2 farther from the float graph"):
        qnn.check_gate("decode", c, qnn.QnnSpec())
    both = qnn.worst_of([qnn.compare(cpu, cpu, 0.02, flt), c])
    assert both.excess_rel["k"] == pytest.approx(0.2) and both.argmax_vs_float["logits"]["htp"] == 0.0


def test_top1_counts_near_ties_as_kept_only_within_the_tie():
    cpu = {"logits": np.array([[[1.0, 0.99, 0.0, 0.0], [1.0, 0.5, 0.0, 0.0]]], np.float32)}
    got = {"logits": np.array([[[0.98, 0.99, 0.0, 0.0], [0.4, 0.5, 0.0, 0.0]]], np.float32)}  # both rows pick 1
    assert qnn.compare(cpu, got).argmax_agreement["logits"] == 0.0
    assert qnn.compare(cpu, got, tie=0.02).argmax_agreement["logits"] == 0.5  # 0.01 apart: a tie; 0.5: not


def test_qnn_marked_tests_fail_not_skip_where_the_backend_is_declared(monkeypatch):
    """tests/conftest.py: on Linux x86_64 (onnxruntime-qnn is a declared dependency) a missing backend
    fails every qnn-marked test; elsewhere they skip."""
    from tests.conftest import pytest_runtest_setup

    class Item:
        def __init__(self, marked: bool):
            self.marked = marked

        def get_closest_marker(self, name):
            return object() if self.marked and name == "qnn" else None

    def outcome(marked: bool) -> tuple[str, str]:  # a skip must not escape: it would skip this test
        try:
            pytest_runtest_setup(Item(marked))
        except pytest.fail.Exception as exc:
            return "fail", str(exc)
        except pytest.skip.Exception as exc:
            return "skip", str(exc)
        return "run", ""

    monkeypatch.setattr(qnn, "availability", lambda: (False, "onnxruntime-qnn is not installed"))
    monkeypatch.setattr(qnn, "declared_here", lambda: True)
    status, why = outcome(True)
    assert status == "fail" and "declared dependency on Linux x86_64" in why
    assert outcome(False) == ("run", "")  # unmarked tests never need the backend
    monkeypatch.setattr(qnn, "declared_here", lambda: False)
    status, why = outcome(True)
    assert status == "skip" and "not installed" in why


def test_declared_here_follows_pyproject():
    import platform
    import tomllib
    from pathlib import Path

    deps = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("onnxruntime-qnn") and "platform_machine == 'x86_64'" in d and "'Linux'" in d
               for d in deps)
    assert qnn.declared_here() == (platform.system() == "Linux" and platform.machine() == "x86_64")
