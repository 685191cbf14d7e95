"""Sessions over graphs that name the same external weights hold one copy of them, not one each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from toolchain.runtime.shared_weights import SharedWeights

ROWS, COLS = 1024, 8192  # 32 MB of float32


def _graph(folder, width: int):
    t = onnx.TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[ROWS, COLS],
                         data_location=onnx.TensorProto.EXTERNAL)
    for k, v in (("location", "weights.bin"), ("offset", "64"), ("length", str(ROWS * COLS * 4))):
        e = t.external_data.add()
        e.key, e.value = k, v
    g = helper.make_graph([helper.make_node("MatMul", ["A", "W"], ["Y"])], f"w{width}",
                          [helper.make_tensor_value_info("A", TensorProto.FLOAT, [width, ROWS])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [width, COLS])], [t])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    path = folder / f"w{width}.onnx"
    onnx.save(model, str(path))
    return path


_MEASURE = """
import sys
from pathlib import Path
import numpy as np
from tests.toolchain.runtime.test_shared_weights import open_and_run
from toolchain.runtime.shared_weights import SharedWeights
def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024
folder, mode = Path(sys.argv[1]), sys.argv[2]
paths = sorted(folder.glob("w*.onnx"))
before = rss()
shared = SharedWeights() if mode == "shared" else None  # must outlive the sessions: they read its buffers
sessions = open_and_run(paths, shared)
print(rss() - before)
"""


def open_and_run(paths, shared: SharedWeights | None):
    """Opens a session per graph (sharing the weights or not) and runs each once; returns them."""
    sessions = []
    for p in paths:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if shared is not None:
            shared.add_to(so, p)
        s = ort.InferenceSession(str(p), so, providers=["CPUExecutionProvider"])
        width = s.get_inputs()[0].shape[0]
        s.run(None, {"A": np.zeros((width, ROWS), np.float32)})
        sessions.append(s)
    return sessions


def _growth_mb(folder, mode: str) -> float:
    """RSS growth of a fresh process that opens and runs every graph (in-process figures are
    muddied by memory the allocator kept from earlier tests)."""
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(folder), mode], cwd=root, capture_output=True,
                         text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def test_four_widths_hold_one_copy(tmp_path):
    w = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32)
    (tmp_path / "weights.bin").write_bytes(b"\0" * 64 + w.tobytes())
    paths = [_graph(tmp_path, n) for n in (1, 4, 8, 32)]
    shared = SharedWeights()  # must outlive the sessions: they read its buffers
    sessions = open_and_run(paths, shared)
    for s, n in zip(sessions, (1, 4, 8, 32), strict=True):
        a = np.random.default_rng(n).standard_normal((n, ROWS)).astype(np.float32)
        np.testing.assert_allclose(s.run(None, {"A": a})[0], a @ w, rtol=1e-4, atol=1e-3)
    mb = w.nbytes / 2**20
    shared, copies = _growth_mb(tmp_path, "shared"), _growth_mb(tmp_path, "copies")
    assert shared < 1.5 * mb, shared  # one 32 MB copy (the mapped pages), not four
    assert copies > 3 * mb, copies  # the old way: each session reads its own copy


def test_packed_int4_weights_are_left_to_onnxruntime(tmp_path):
    """QDQ graphs keep int4 codes two to a byte, which numpy cannot view: those initializers are
    read by onnxruntime itself (the W4A16 SmolLM2 compile failed here before)."""
    import ml_dtypes

    codes = np.random.default_rng(0).integers(-8, 8, size=(256, 64)).astype(ml_dtypes.int4)
    packed = onnx.numpy_helper.from_array(codes).raw_data  # 2 codes per byte
    (tmp_path / "weights.bin").write_bytes(packed)
    t = onnx.TensorProto(name="Q", data_type=TensorProto.INT4, dims=[256, 64], data_location=onnx.TensorProto.EXTERNAL)
    for k, v in (("location", "weights.bin"), ("offset", "0"), ("length", str(len(packed)))):
        e = t.external_data.add()
        e.key, e.value = k, v
    scale = onnx.numpy_helper.from_array(np.float32(0.5), "S")
    g = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["Q", "S"], ["W"]), helper.make_node("MatMul", ["A", "W"], ["Y"])],
        "q", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, 256])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 64])], [t, scale])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.save(model, str(tmp_path / "q.onnx"))
    so = ort.SessionOptions()
    assert SharedWeights().add_to(so, tmp_path / "q.onnx") == 0
    a = np.ones((1, 256), np.float32)
    y = ort.InferenceSession(str(tmp_path / "q.onnx"), so).run(None, {"A": a})[0]
    np.testing.assert_allclose(y, a @ (codes.astype(np.float32) * 0.5), rtol=1e-5)
