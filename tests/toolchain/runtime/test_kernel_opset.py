"""An artifact compiled for an older layout of mobc's CPU kernels (mobc.cpu opset 1: MatMulQ4's
column-major codes) is refused when its session opens, naming the recompile command, instead of
failing inside onnxruntime on the first call."""

from __future__ import annotations

import json
import shutil

import onnx
import pytest

from toolchain import kernels
from toolchain.artifact.integrity import sha256_path
from toolchain.errors import ArtifactError
from toolchain.runtime.model import StepModel


def _declaring(tiny_artifact, tmp_path, opset: int):
    """A copy of the tiny artifact marked as a CPU form whose decode graph imports mobc.cpu at `opset`."""
    art = tmp_path / f"opset{opset}"
    shutil.copytree(tiny_artifact, art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["passes"] = [*(manifest.get("passes") or []), {"pass": "matmul_nbits"}]
    decode = next(g["file"] for g in manifest["graphs"] if g["role"] == "decode")
    model = onnx.load(str(art / decode), load_external_data=False)
    model.opset_import.append(onnx.helper.make_opsetid(kernels.DOMAIN, opset))
    onnx.save(model, str(art / decode))
    manifest["files"][decode] = sha256_path(art / decode)  # as a compile would have recorded it
    manifest["sizes"][decode] = (art / decode).stat().st_size
    (art / "manifest.json").write_text(json.dumps(manifest))
    return art


def test_an_older_kernel_opset_is_refused_with_the_fix(tiny_artifact, tmp_path):
    model = StepModel(_declaring(tiny_artifact, tmp_path, 1))
    with pytest.raises(ArtifactError, match=r"mobc.cpu opset 1.*recompile it \(`mobc compile"):
        model.forward([3], family="decode")


def test_the_current_opset_opens(tiny_artifact, tmp_path):
    art = _declaring(tiny_artifact, tmp_path, kernels.OPSET)
    assert kernels.graph_opset(art / "decode.onnx") == kernels.OPSET
    assert StepModel(art).forward([3], family="decode").shape[0] == 1
