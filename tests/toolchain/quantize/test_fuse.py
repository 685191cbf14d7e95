"""RMSNorm fusion keeps the float graph's numerics and removes every Pow/Sqrt/Reciprocal chain."""

import numpy as np
import onnx
import onnxruntime as ort

from toolchain.quantize.fuse import fuse_rmsnorm
from toolchain.runtime.cache import KVCache
from toolchain.runtime.sessions import ArtifactSessions


def test_fused_graph_matches_float(compiled, tmp_path):
    model = onnx.load(compiled / "decode.onnx")
    assert fuse_rmsnorm(model) == 5  # 2 layers x 2 norms + the final norm
    ops = {n.op_type for n in model.graph.node}
    assert not ops & {"Pow", "Sqrt", "Reciprocal", "ReduceMean"}
    onnx.save(model, tmp_path / "fused.onnx", save_as_external_data=True, location="fused.bin")
    s = ArtifactSessions(compiled)
    feeds = KVCache(s.layout("decode"), s.rope).step_inputs([5], 1)
    ref = ort.InferenceSession(str(compiled / "decode.onnx")).run(None, feeds)
    got = ort.InferenceSession(str(tmp_path / "fused.onnx")).run(None, feeds)
    for a, b in zip(ref, got, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
