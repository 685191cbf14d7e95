"""Emit: an artifact folder with graphs, one shared weights file and the RoPE tables.

Everything is written into a sibling temporary folder and renamed into place at the very end,
so an interrupted compile never leaves a folder whose manifest looks complete. Initializers are
deduplicated by content across all graphs (decode/prefill/tree widths share every weight), so a
second width costs kilobytes of graph, not another copy of the model.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import threading
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from toolchain.artifact.manifest import MANIFEST, ROPE, WEIGHTS, GraphRecord, IOSpec, sha256_path
from toolchain.errors import ArtifactError
from toolchain.ir.graph import weight_bytes
from toolchain.ir.graphset import GraphEntry, GraphSet

INLINE_BYTES = 1024  # tiny constants (shapes, scalars) stay inside the .onnx
ALIGN = 64


class WeightsWriter:
    """Appends tensors to one shared file, storing identical bytes once.

    `release(tensor)` is called with each on-disk source tensor once its bytes are written (the
    compile frees its scratch copy there); a later reference to the same source location reuses
    the written bytes without reading the source again."""

    def __init__(self, folder: Path, file_name: str = WEIGHTS, release: Callable[[Any], Any] | None = None):
        self.folder = folder
        self.file_name = file_name
        self._f = open(folder / file_name, "wb")
        self._offsets: dict[str, tuple[int, int]] = {}
        self._by_location: dict[tuple[str, int, int], tuple[int, int]] = {}
        self._release = release
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
            location = _location(tensor)
            if location in self._by_location:  # written already (and maybe released): no read
                offset, length = self._by_location[location]
            else:
                data = tensor.tobytes()  # one tensor in memory at a time (DiskTensors read on demand)
                key = hashlib.sha256(data).hexdigest()
                if key not in self._offsets:
                    pad = (-self._f.tell()) % ALIGN
                    self._f.write(b"\0" * pad)
                    self._offsets[key] = (self._f.tell(), len(data))
                    self._f.write(data)
                    self.tensors += 1
                offset, length = self._offsets[key]
                if location is not None:
                    self._by_location[location] = (offset, length)
                    if self._release is not None:
                        self._f.flush()
                        self._release(tensor)
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


# staging, scratch and backup folders beside an output: .NAME.partial-PID (being written), .NAME.scratch-PID
# (weights the compile created, toolchain/ir/disk.py), .NAME.old-PID (the
# artifact being replaced, for the instant of the swap). A compile locks its output from its first
# check to the swap with a lock file in the user cache (nothing is left beside the output when a
# compile fails before it stages; the lock goes with the process at the latest)
_PARKED = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old|scratch)-(?P<pid>\d+)$")
_CLAIMS: dict[Path, tuple[int, Path]] = {}  # outputs this process has locked -> (descriptor, lock file)


def output_path(out_dir: Path) -> Path:
    """The absolute output path with its last component not resolved (a symlink stays a symlink)."""
    out = Path(os.path.abspath(out_dir))
    if not out.name or out == out.parent:
        raise ArtifactError(f"--out {out_dir}: give a folder for the artifact, not a filesystem root")
    return out.parent.resolve() / out.name


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe(path: Path) -> str:
    """What is at `path`, in a few words (for refusing to replace it)."""
    if path.is_symlink():
        return f"a symbolic link to {os.readlink(path)}"
    if not path.is_dir():
        return f"a file of {path.stat().st_size:,} bytes" if path.exists() else "not a folder"
    try:
        names = sorted(p.name for p in path.iterdir())
    except OSError as exc:
        return f"a folder mobc cannot list ({exc.strerror})"
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    entries = f"{len(names)} entr{'y' if len(names) == 1 else 'ies'}"
    return f"a folder with {entries} ({shown}) and no mobc manifest"


def is_artifact(folder: Path) -> bool:
    """A real folder whose manifest.json is a mobc manifest (what --force may replace)."""
    path = folder / MANIFEST
    if folder.is_symlink() or not folder.is_dir() or path.is_symlink() or not path.is_file():
        return False
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and str(data.get("format", "")).startswith("mobc-artifact/")


def check_replaceable(out: Path, force: bool, is_ours: Callable[[Path], bool] = is_artifact) -> None:
    """Raises unless out is absent, or (with force) an empty folder or a mobc artifact (`is_ours`:
    what else mobc wrote there and may replace, e.g. a bundle)."""
    if not os.path.lexists(out):
        return
    try:
        empty = out.is_dir() and not out.is_symlink() and not any(out.iterdir())
    except OSError:
        empty = False
    if empty or is_ours(out):
        if not force:
            raise ArtifactError(f"{out} already exists; pass --force to replace it (or --out another folder)")
        return
    raise ArtifactError(
        f"{out} already exists and is not a mobc artifact: it is {describe(out)}. mobc replaces only "
        "artifact folders it wrote (or empty folders), even with --force; choose another --out or move it away"
    )


def sweep_stale(parent: Path) -> list[Path]:
    """Removes the staging folders of compiles whose process is gone (killed, crashed) from `parent`; a
    backup (.NAME.old-PID) whose swap was cut short goes back in place if NAME is missing."""
    swept = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return swept
    for p in entries:
        m = _PARKED.match(p.name)
        if not m or pid_alive(int(m["pid"])) or p.is_symlink() or not p.is_dir():
            continue
        target = parent / m["name"]
        try:
            if m["kind"] == "old" and not os.path.lexists(target):
                p.rename(target)
            else:
                shutil.rmtree(p)
                swept.append(p)
        except OSError:
            pass  # someone else's folder we may not remove: leave it
    return swept


def _lock_path(out: Path) -> Path:
    root = Path(os.environ.get("MOBC_CACHE", Path.home() / ".cache" / "mobc")) / "locks"
    root.mkdir(parents=True, exist_ok=True)
    return root / (hashlib.sha256(str(out).encode()).hexdigest()[:24] + ".lock")


def _lock(out: Path) -> tuple[int, Path] | None:
    while True:
        try:
            path = _lock_path(out)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return None  # no writable cache: compile unlocked rather than not at all
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ArtifactError(
                f"another mobc compile (pid {holder}) is writing {out}; wait for it to finish or --out another folder"
            ) from None
        try:  # the holder before us may have removed the file after we opened it: lock the current one
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
            return fd, path
        os.close(fd)


def release(out: Path) -> None:
    """Gives up this process's lock on `out` (removing the lock file first, then unlocking)."""
    claim = _CLAIMS.pop(out, None)
    if claim is not None:
        with contextlib.suppress(OSError):
            os.unlink(claim[1])
        os.close(claim[0])


def check_writable(out: Path) -> None:
    """The output's name leaves room for its staging names, and its nearest existing folder is writable
    (checked before any work, creating nothing)."""
    if len(os.fsencode(out.name)) > 200:  # .NAME.partial-PID / .NAME.scratch-XXXXXXXX must fit 255 bytes
        raise ArtifactError(f"{out}: the artifact folder's name is {len(os.fsencode(out.name))} bytes long; "
                            "give it a name of at most 200 bytes (--out or the recipe's output)")
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ArtifactError(f"cannot write the artifact {out}: {parent} is not a folder you can write to; "
                            "choose another --out")


def claim_output(out_dir: Path, force: bool, is_ours: Callable[[Path], bool] = is_artifact) -> Path:
    """Before any work: checks that out_dir may be (re)placed, sweeps dead compiles' staging folders
    beside it and locks it against concurrent compiles. Returns the normalized output path; the
    lock is released by `staging` (or when the process ends)."""
    out = output_path(out_dir)
    check_replaceable(out, force, is_ours)
    check_writable(out)
    sweep_stale(out.parent)
    if out not in _CLAIMS and (claim := _lock(out)) is not None:
        _CLAIMS[out] = claim
    return out


@contextmanager
def staging(out_dir: Path, force: bool, is_ours: Callable[[Path], bool] = is_artifact):
    """Yields a temporary folder; on success it replaces out_dir atomically, else it is removed.

    Only an absent output, an empty folder or a mobc artifact is replaced (never a user's folder,
    a file or a symlink's target); the swap runs with SIGINT/SIGTERM held back so an interrupt
    never lands between moving the old artifact aside and moving the new one in."""
    out = claim_output(out_dir, force, is_ours)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        if tmp.is_symlink():
            tmp.unlink()
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(parents=True)
        except OSError as exc:
            raise ArtifactError(f"cannot write the artifact {out}: {exc.strerror} ({tmp}); choose another --out") \
                from None
        try:
            yield tmp
            with _signals_held():
                check_replaceable(out, force, is_ours)  # the output may have changed during the compile
                old = out.parent / f".{out.name}.old-{os.getpid()}"
                if os.path.lexists(out):
                    out.rename(old)
                try:
                    tmp.rename(out)
                except BaseException:
                    if os.path.lexists(old):
                        old.rename(out)
                    raise
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        release(out)


@contextmanager
def _signals_held():
    sigs = {signal.SIGINT, signal.SIGTERM}
    main = threading.current_thread() is threading.main_thread()
    if main:
        signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        if main:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)


def _location(tensor: Any) -> tuple[str, int, int] | None:
    if not isinstance(tensor, ir.ExternalTensor):
        return None
    length = tensor.length if tensor.length is not None else tensor.nbytes
    return (os.path.abspath(tensor.path), tensor.offset or 0, length)


def write_graphs(folder: Path, graphs: GraphSet, release: Callable[[Any], Any] | None = None,
                 ) -> tuple[list[GraphRecord], dict[str, Any]]:
    """Saves every graph as <name>.onnx with weights in one shared, deduplicated file (`release`:
    see WeightsWriter)."""
    writer = WeightsWriter(folder, release=release)
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
