"""An artifact compiled for an older layout of mobc's CPU kernels (mobc.cpu opset 1: MatMulQ4's
column-major codes) fails its first call with a clear ArtifactError naming the recompile command,
not with onnxruntime's traceback; bound and unbound calls alike."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from toolchain import kernels
from toolchain.artifact.integrity import sha256_path
from toolchain.errors import ArtifactError
from toolchain.runtime.model import StepModel

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler for mobc's CPU kernels")


def _with_old_layout_matmul(tiny_artifact, tmp_path):
    """A copy of the tiny artifact whose decode graph runs one projection as MatMulQ4 with the
    column-major inputs of opset 1: codes [N, K/32, 16], scales [N, K/32], mins [K/32, N]."""
    art = tmp_path / "old"
    shutil.copytree(tiny_artifact, art)
    manifest = json.loads((art / "manifest.json").read_text())
    decode = next(g["file"] for g in manifest["graphs"] if g["role"] == "decode")
    model = onnx.load(str(art / decode), load_external_data=False)
    weights = {i.name: i for i in model.graph.initializer}
    node = next(n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights
                and len(weights[n.input[1]].dims) == 2 and weights[n.input[1]].dims[0] % 32 == 0)
    k, n = weights[node.input[1]].dims
    old = {"old.codes": np.zeros((n, k // 32, 16), np.uint8), "old.scales": np.ones((n, k // 32), np.float32),
           "old.mins": np.zeros((k // 32, n), np.float32)}
    model.graph.initializer.extend(numpy_helper.from_array(v, name) for name, v in old.items())
    node.op_type, node.domain = "MatMulQ4", kernels.DOMAIN
    node.input[1:] = list(old)
    model.opset_import.append(onnx.helper.make_opsetid(kernels.DOMAIN, 1))
    onnx.save(model, str(art / decode))
    manifest["files"][decode] = sha256_path(art / decode)  # as a compile would have recorded it
    manifest["sizes"][decode] = (art / decode).stat().st_size
    (art / "manifest.json").write_text(json.dumps(manifest))
    return art


@pytest.mark.parametrize("io_binding", [True, False])
def test_an_older_kernel_layout_is_a_clear_error(tiny_artifact, tmp_path, io_binding):
    model = StepModel(_with_old_layout_matmul(tiny_artifact, tmp_path), io_binding=io_binding)
    with pytest.raises(ArtifactError, match=r"older layout of mobc's CPU kernels.*recompile it \(`mobc compile"):
        model.forward([3], family="decode")


def test_other_run_failures_are_not_reworded():
    assert kernels.is_stale_layout(RuntimeError(f"MatMulQ4: ...; {kernels.STALE_LAYOUT}"))
    assert not kernels.is_stale_layout(RuntimeError("MatMulQ4: x has K=96 but the codes hold K=64"))
