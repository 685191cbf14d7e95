"""The source checkpoint's weights, by name, read one tensor at a time from its .safetensors files.

Nothing is loaded up front: the store parses the files' headers (name -> dtype, shape, byte range)
and reads a tensor's bytes with a positional read when asked. fp32 tensors are handed to the
graph as DiskTensors pointing straight into the checkpoint (no copy at all); other dtypes (bf16,
fp16 checkpoints) are upcast one tensor at a time into the compile's spill.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir

from toolchain.errors import SourceError
from toolchain.ir.disk import DiskTensor, Spill

_DTYPES = {
    "F32": ir.DataType.FLOAT, "F16": ir.DataType.FLOAT16, "BF16": ir.DataType.BFLOAT16,
    "F64": ir.DataType.DOUBLE, "I64": ir.DataType.INT64, "I32": ir.DataType.INT32,
}


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    offset: int  # absolute, in bytes
    length: int
    dtype: ir.DataType
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, StoredTensor]:
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as exc:
        raise SourceError(f"{path} is not a readable .safetensors file ({exc}); re-save the checkpoint") from None
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        if h["dtype"] not in _DTYPES:
            raise SourceError(f"{path}: tensor {name} has dtype {h['dtype']}, which mobc cannot read")
        a, b = h["data_offsets"]
        out[name] = StoredTensor(path, 8 + n + a, b - a, _DTYPES[h["dtype"]], tuple(h["shape"]))
    return out


class WeightStore:
    """name -> weight of a Hugging Face checkpoint folder (one or several .safetensors files)."""

    def __init__(self, files: list[Path]):
        self.files = sorted(Path(f) for f in files)
        self.tensors: dict[str, StoredTensor] = {}
        for f in self.files:
            self.tensors.update(read_header(f))
        self.aliases: dict[str, str] = {}

    @classmethod
    def of_folder(cls, folder: Path) -> WeightStore:
        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise SourceError(
                f"{folder} holds no .safetensors weights; mobc streams weights from safetensors "
                "(re-save the model with save_pretrained(..., safe_serialization=True))"
            )
        return cls(files)

    def tie(self, name: str, target: str) -> None:
        """Reads of `name` (e.g. a tied lm_head.weight the file omits) come from `target`."""
        if name not in self.tensors:
            self.aliases[name] = target

    def entry(self, name: str) -> StoredTensor:
        name = self.aliases.get(name, name)
        if name not in self.tensors:
            raise KeyError(name)
        return self.tensors[name]

    def __contains__(self, name: str) -> bool:
        return self.aliases.get(name, name) in self.tensors

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored (its own dtype), in fresh memory."""
        t = self.entry(name)
        return _on_disk(t, name, t.file.parent, t.file.name).numpy()

    def float32(self, name: str) -> np.ndarray:
        arr = self.raw(name)
        return arr if arr.dtype == np.float32 else arr.astype(np.float32)

    def offer_to(self, spill: Spill) -> None:
        """Lets the spill reuse the checkpoint's fp32 tensors when a pass makes the same bytes again
        (linear_to_conv's conv layout is the HF Linear weight itself): an 8B compile then writes
        ~28 GB less scratch."""
        for t in self.tensors.values():
            if t.dtype == ir.DataType.FLOAT:
                spill.register_source(spill.adopt(t.file), t.offset, t.length)

    def graph_tensor(self, name: str, ir_name: str, spill: Spill) -> ir.TensorProtocol:
        """The weight as an fp32 graph initializer: the checkpoint's own bytes when they are fp32."""
        t = self.entry(name)
        if t.dtype == ir.DataType.FLOAT:
            return _on_disk(t, ir_name, spill.folder, spill.adopt(t.file))
        return spill.store(ir_name, self.float32(name))


def _on_disk(t: StoredTensor, name: str, base_dir: Path, location: str) -> DiskTensor:
    """A DiskTensor over a stored tensor's bytes (`location` names its file relative to base_dir)."""
    return DiskTensor(location, t.offset, t.length, t.dtype, shape=ir.Shape(t.shape), name=name, base_dir=base_dir)
