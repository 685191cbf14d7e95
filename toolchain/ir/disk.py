"""Weights that live on disk: tensors read on demand and never cached, and a spill for new ones.

Why: a 1-8B model's weights do not fit in memory several times over. onnx_ir's ExternalTensor
memory-maps its whole file and keeps the mapping, so every page a pass or a hash touches stays
in the process's resident set (RSS counts mapped file pages). A DiskTensor reads its bytes with a
positional read into a fresh array on every call: a weight costs memory only while a caller holds
the array, and the page cache (not counted) makes repeated reads cheap.

`Spill` is where the compile puts tensors it creates (transposed Linear weights, per-head slices,
conv layouts): appended to a scratch file as they are made, deduplicated by content, and handed
back as DiskTensors. While a spill is active (`spilling`), `toolchain.ir.graph.add_initializer`
sends every large array there, so a pass that rewrites all weights holds one tensor at a time.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx_ir as ir

SPILL_BYTES = 1 << 16  # arrays at least this large go to disk while a spill is active
_ALIGN = 64


class DiskTensor(ir.ExternalTensor):
    """An external tensor read with pread on every access (no memory map, no cache)."""

    def _read(self) -> bytes:
        length = self.length if self.length is not None else self.nbytes
        with open(self.path, "rb") as f:
            data = os.pread(f.fileno(), length, self.offset or 0)
        if len(data) != length:
            raise OSError(f"{self.path}: expected {length} bytes at offset {self.offset}, read {len(data)}")
        return data

    def numpy(self) -> np.ndarray:
        arr = np.frombuffer(bytearray(self._read()), dtype=self.dtype.numpy())
        return arr.reshape(self.shape.numpy())

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        arr = self.numpy()
        return arr if dtype is None else arr.astype(dtype)

    def tobytes(self) -> bytes:
        return self._read()

    def release(self) -> None:  # nothing is held
        pass


def _contiguous(array: np.ndarray) -> np.ndarray:
    # not np.ascontiguousarray: it turns 0-d scalars into shape (1,)
    return array if array.flags.c_contiguous else array.copy(order="C")


def is_on_disk(tensor: object) -> bool:
    return isinstance(tensor, ir.ExternalTensor)


class Spill:
    """Scratch files of tensors the compile created; one file per `section` (e.g. per pass)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._file = None
        self._name = ""
        self._sections = 0
        self._by_hash: dict[str, tuple[str, int, int]] = {}
        self._released: set[tuple[str, int]] = set()
        # fp32 tensors of the source checkpoint, by byte length: a tensor whose bytes are one of
        # them (a conv layout is the checkpoint's own [out, in] Linear weight again) is handed out
        # as a reference into the checkpoint instead of being written (`register_source`)
        self._sources: dict[int, list[tuple[str, int]]] = {}
        self._source_digest: dict[tuple[str, int], str] = {}
        self._by_source_digest: dict[tuple[str, int], tuple[str, int]] = {}
        self.bytes_written = 0

    def section(self, label: str) -> None:
        """Starts a new scratch file, so `collect` can delete what a later section replaced."""
        self._close()
        self._sections += 1
        self._name = f"spill{self._sections:03d}-{label}.bin"
        self._file = open(self.folder / self._name, "wb")  # noqa: SIM115 - closed by _close/close

    def register_source(self, location: str, offset: int, length: int) -> None:
        """Offers an fp32 region of a file inside the spill folder (an adopted checkpoint) for reuse."""
        if length >= SPILL_BYTES:
            self._sources.setdefault(length, []).append((location, offset))

    def _in_source(self, digest: str, length: int) -> tuple[str, int] | None:
        """The checkpoint region holding exactly these bytes, hashing candidates of this length once."""
        for loc in self._sources.get(length, []):
            if loc not in self._source_digest:
                with open(self.folder / loc[0], "rb") as f:
                    h = hashlib.sha256(os.pread(f.fileno(), length, loc[1])).hexdigest()
                self._source_digest[loc] = h
                self._by_source_digest.setdefault((h, length), loc)
        return self._by_source_digest.get((digest, length))

    def store(self, name: str, array: np.ndarray) -> DiskTensor:
        if self._file is None:
            self.section("weights")
        array = _contiguous(array)
        data = memoryview(array).cast("B") if array.size else b""
        digest = hashlib.sha256(data).hexdigest()
        key = digest + str(array.dtype) + str(array.shape)
        found = self._in_source(digest, len(data)) if array.dtype == np.float32 else None
        if found is not None:
            return DiskTensor(found[0], found[1], len(data), ir.DataType.FLOAT, shape=ir.Shape(array.shape),
                              name=name, base_dir=self.folder)
        if key not in self._by_hash:
            f = self._file
            f.write(b"\0" * ((-f.tell()) % _ALIGN))
            offset = f.tell()
            f.write(data)
            f.flush()  # readers open the file themselves
            self._by_hash[key] = (self._name, offset, len(data))
            self.bytes_written += len(data)
        location, offset, length = self._by_hash[key]
        return DiskTensor(location, offset, length, ir.DataType.from_numpy(array.dtype),
                          shape=ir.Shape(array.shape), name=name, base_dir=self.folder)

    def adopt(self, path: Path) -> str:
        """A name for `path` inside the spill folder (a hard link, else a copy), so graphs saved
        there reference it by a relative name: onnxruntime refuses external data outside the
        model's folder, symlinks included."""
        return link_into(self.folder, Path(path))

    def collect(self, live: Iterable[object]) -> int:
        """Deletes the spill files no live tensor points into (except the open one), and frees the
        blocks of every stored tensor nothing points at any more inside the files that stay (the
        export's transposed q/k/v die when mha_to_sha slices them, while the rest of their file
        lives on); returns bytes freed."""
        live = [t for t in live if isinstance(t, ir.ExternalTensor)]
        used = {Path(t.path).name for t in live}
        regions = {(Path(t.path).name, t.offset or 0) for t in live}
        freed = 0
        for location, offset, length in set(self._by_hash.values()):
            if location in used and (location, offset) not in regions:
                freed += self._free_region(location, offset, length)
        for path in self.folder.glob("spill*.bin"):
            if path.name not in used and path.name != self._name:
                freed += path.stat().st_size
                path.unlink()
                self._by_hash = {k: v for k, v in self._by_hash.items() if v[0] != path.name}
        return freed

    def release(self, tensor: object) -> int:
        """Frees the disk blocks of one spilled tensor once it is written elsewhere (the emit copies
        each into weights.bin), so the scratch shrinks while weights.bin grows instead of both holding
        every weight at the end of a compile. Nothing may read the tensor afterwards (its bytes read
        as zeros); tensors outside this spill (the user's checkpoint) are never touched. Returns the
        bytes released (0 where the filesystem cannot punch holes)."""
        if not isinstance(tensor, ir.ExternalTensor):
            return 0
        path = Path(tensor.path)
        if path.parent.resolve() != self.folder.resolve() or not path.name.startswith("spill"):
            return 0
        length = tensor.length if tensor.length is not None else tensor.nbytes
        return self._free_region(path.name, tensor.offset or 0, length)

    def _free_region(self, location: str, offset: int, length: int) -> int:
        """Punches one stored tensor out of its scratch file and forgets it, so `store` never hands
        the freed place out again; returns the bytes freed (0 if already freed or not possible)."""
        key = (location, offset)
        if key in self._released or not punch_hole(self.folder / location, offset, length):
            return 0
        self._released.add(key)
        self._by_hash = {k: v for k, v in self._by_hash.items() if v[:2] != key}
        return length

    def clear(self) -> int:
        """Deletes every scratch file (once the graphs point elsewhere, e.g. at the emitted weights)."""
        self._close()
        freed = 0
        for path in self.folder.iterdir():
            if path.is_file():
                freed += path.stat().st_size
                path.unlink()
        self._by_hash.clear()
        return freed

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def close(self) -> None:
        self._close()


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


@functools.cache
def _fallocate():
    """libc's fallocate, or None where there is none (not Linux)."""
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    return fn


def punch_hole(path: Path, offset: int, length: int) -> bool:
    """Deallocates [offset, offset+length) of a file (Linux fallocate), keeping its size; the range
    then reads as zeros. False where the OS or filesystem cannot (the bytes then simply stay)."""
    fallocate = _fallocate()
    if length <= 0 or fallocate is None:
        return False
    fd = os.open(path, os.O_RDWR)
    try:
        return fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) == 0
    finally:
        os.close(fd)


def link_into(folder: Path, path: Path) -> str:
    path = path.resolve()
    if path.parent == folder.resolve():
        return path.name
    stat = path.stat()
    name = f"src-{stat.st_dev}-{stat.st_ino}-{path.name}"
    target = folder / name
    if not target.exists():
        try:
            os.link(path, target)
        except OSError:  # another filesystem: one copy on disk
            shutil.copyfile(path, target)
    return name


_active: list[Spill] = []


def active() -> Spill | None:
    return _active[-1] if _active else None


@contextmanager
def spilling(spill: Spill) -> Iterator[Spill]:
    _active.append(spill)
    try:
        yield spill
    finally:
        _active.remove(spill)


def as_tensor(name: str, array: np.ndarray) -> ir.TensorProtocol:
    """An initializer's tensor: spilled to disk when large and a spill is active, else in memory."""
    spill = active()
    if spill is not None and array.nbytes >= SPILL_BYTES:
        return spill.store(name, array)
    return ir.tensor(_contiguous(array), name=name)


def spill_large(model: ir.Model, spill: Spill) -> int:
    """Moves every large in-memory initializer of `model` to the spill; returns how many moved."""
    moved = 0
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is None or is_on_disk(tensor) or tensor.nbytes < SPILL_BYTES:
            continue
        value.const_value = spill.store(value.name, tensor.numpy())
        moved += 1
    return moved
