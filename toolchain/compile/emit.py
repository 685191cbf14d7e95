"""Emit: an artifact folder with graphs, one shared weights file and the RoPE tables.

Everything is written into a sibling temporary folder and renamed into place at the very end,
so an interrupted compile never leaves a folder whose manifest looks complete. Initializers are
deduplicated by content across all graphs (decode/prefill/tree widths share every weight), so a
second width costs kilobytes of graph, not another copy of the model.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from toolchain.artifact.manifest import ROPE, WEIGHTS, GraphRecord, IOSpec, sha256_path
from toolchain.errors import ArtifactError
from toolchain.ir.graph import weight_bytes
from toolchain.ir.graphset import GraphEntry, GraphSet

INLINE_BYTES = 1024  # tiny constants (shapes, scalars) stay inside the .onnx
ALIGN = 64


class WeightsWriter:
    """Appends tensors to one shared file, storing identical bytes once."""

    def __init__(self, folder: Path, file_name: str = WEIGHTS):
        self.folder = folder
        self.file_name = file_name
        self._f = open(folder / file_name, "wb")
        self._offsets: dict[str, tuple[int, int]] = {}
        self.tensors = 0
        self.referenced_bytes = 0

    def externalize(self, model: ir.Model) -> None:
        for value in model.graph.initializers.values():
            tensor = value.const_value
            if tensor is None:
                continue
            if tensor.nbytes < INLINE_BYTES:
                if isinstance(tensor, ir.ExternalTensor):  # a small weight still in the checkpoint or spill
                    value.const_value = ir.tensor(tensor.numpy(), name=value.name)
                continue
            data = tensor.tobytes()  # one tensor in memory at a time (DiskTensors read on demand)
            key = hashlib.sha256(data).hexdigest()
            if key not in self._offsets:
                pad = (-self._f.tell()) % ALIGN
                self._f.write(b"\0" * pad)
                self._offsets[key] = (self._f.tell(), len(data))
                self._f.write(data)
                self.tensors += 1
            offset, length = self._offsets[key]
            self.referenced_bytes += length
            value.const_value = ir.ExternalTensor(
                self.file_name, offset, length, tensor.dtype, shape=tensor.shape,
                name=value.name, base_dir=self.folder,
            )

    def close(self) -> int:
        self._f.close()
        return (self.folder / self.file_name).stat().st_size


def io_specs(values: Any) -> list[IOSpec]:
    return [
        IOSpec(name=v.name, shape=[int(d) if isinstance(d, int) else str(d) for d in v.shape],
               dtype=v.dtype.name.lower() if v.dtype is not None else "?")
        for v in values
    ]


@contextmanager
def staging(out_dir: Path, force: bool):
    """Yields a temporary folder; on success it replaces out_dir atomically, else it is removed."""
    out_dir = out_dir.resolve()
    if out_dir.exists() and not force:
        raise ArtifactError(f"{out_dir} already exists; pass --force to replace it (or --out another folder)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    if out_dir.exists():
        out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)


def write_graphs(folder: Path, graphs: GraphSet) -> tuple[list[GraphRecord], dict[str, Any]]:
    """Saves every graph as <name>.onnx with weights in one shared, deduplicated file."""
    writer = WeightsWriter(folder)
    records = []
    for entry in graphs.entries.values():
        own_bytes = weight_bytes(entry.model)
        writer.externalize(entry.model)
        path = folder / f"{entry.name}.onnx"
        ir.save(entry.model, path)
        records.append(graph_record(entry, path, own_bytes))
    total = writer.close()
    weights = {
        "file": WEIGHTS,
        "bytes": total,
        "tensors": writer.tensors,
        "bytes_saved_by_sharing": max(0, writer.referenced_bytes - total),
        "sha256": sha256_path(folder / WEIGHTS),
    }
    return records, weights


def graph_record(entry: GraphEntry, path: Path, own_bytes: int) -> GraphRecord:
    return GraphRecord(
        name=entry.name, file=path.name, family=entry.family, role=entry.role, width=entry.width,
        context=entry.context, stage=entry.stage, meta=entry.meta,
        inputs=io_specs(entry.model.graph.inputs), outputs=io_specs(entry.model.graph.outputs),
        nodes=len(entry.model.graph), weight_bytes=own_bytes, onnx_bytes=path.stat().st_size,
        sha256=sha256_path(path),
    )


def write_rope(folder: Path, tables: dict[str, np.ndarray]) -> dict[str, Any]:
    path = folder / ROPE
    # np.savez embeds no timestamps when written through a file handle with fixed names
    with open(path, "wb") as f:
        np.savez(f, **tables)
    return {"file": ROPE, "tables": sorted(tables), "length": int(next(iter(tables.values())).shape[0])}
