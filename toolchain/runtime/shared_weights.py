"""One copy of an artifact's weights for all its sessions: every external initializer handed to
onnxruntime as a view of one read-only memory map of its data file.

Why: each onnxruntime session reads its graph's external weights into memory of its own, so a
process with four widths of SmolLM2 held four copies of the 538 MB of weights, and prepacking
added more. Widths (and the parts of one width) name the same bytes of weights.bin; given the
same mapped bytes through `SessionOptions.add_initializer`, every session reads the page cache's
one copy (prepacking, which would copy each weight into a kernel layout per session, is off).

It pays only where kernels read the initializers as they are (MatMul graphs: four widths over
32 MB hold one copy, tests/toolchain/runtime/test_shared_weights.py). Measured on SmolLM2 it does
not pay: the NPU graphs' Conv weights are re-laid out per session by onnxruntime's optimizer
anyway, and MatMulNBits runs 7x slower without prepacking; so ArtifactSessions uses it only
when asked (share_weights=True).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from toolchain.errors import ArtifactError


def external_initializers(graph_path: Path):
    """(name, numpy dtype, dims, external-data fields) of every initializer a graph keeps in another
    file; reads the graph protobuf only (its weights stay in their file)."""
    import onnx

    model = onnx.load(str(graph_path), load_external_data=False)
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            yield t.name, onnx.helper.tensor_dtype_to_np_dtype(t.data_type), tuple(t.dims), info


class SharedWeights:
    """Must outlive every session it was added to: they read its mapped buffers (ArtifactSessions
    holds it for exactly that)."""

    def __init__(self) -> None:
        self._maps: dict[Path, np.memmap] = {}
        self._alive: list[object] = []  # onnxruntime reads these buffers for the sessions' lifetime

    def _map(self, path: Path) -> np.memmap:
        path = path.resolve()
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        return self._maps[path]

    def add_to(self, so: ort.SessionOptions, graph_path: Path) -> int:
        """Adds every external initializer of the graph to `so`; returns how many."""
        n = 0
        for name, dtype, dims, info in external_initializers(graph_path):
            data = self._map(graph_path.parent / info["location"])
            offset, length = int(info.get("offset", 0)), int(info.get("length", 0))
            if offset + length > data.size:
                raise ArtifactError(f"{graph_path.name}: weight {name} points outside {info['location']}; "
                                    "the artifact is damaged: run `mobc verify` or recompile")
            if np.dtype(dtype).kind not in "fiub" or length != int(np.prod(dims, dtype=np.int64)) * np.dtype(dtype).itemsize:
                continue  # packed sub-byte codes (int4 QDQ weights): onnxruntime reads them itself
            value = ort.OrtValue.ortvalue_from_numpy(data[offset : offset + length].view(dtype).reshape(dims))
            so.add_initializer(name, value)
            self._alive.append(value)
            n += 1
        so.add_session_config_entry("session.disable_prepacking", "1")
        return n
