"""Artifact integrity at load: file sizes always, sha256 once per file state.

Every command that loads an artifact (Manifest.load) compares each recorded file's size with the
manifest (a stat: microseconds), and its sha256 with the manifest unless this exact file state was
hashed before. A file state is (device, inode, size, mtime_ns, ctime_ns); the verified states live
in the user cache ($MOBC_CACHE, default ~/.cache/mobc, under verified/), one small entry per file,
so a warm `mobc run` reads a few tiny files instead of hashing the weights. The compile records
the states of the files it hashes while writing the manifest, so even the first run after a
compile is warm; a copied, restored or edited file is hashed once more. Nothing is ever written
into the artifact itself, and a read-only cache only costs the hashing.

The runtime (StepModel) loads inside `deferred_hashing()`: a large file not verified before (the
weights of a copied artifact) is then hashed on a background thread while onnxruntime starts its
sessions, and the model's first call waits for it, so a cold start pays little more than the
sizes while a damaged file still stops the run before any result is used.
"""

from __future__ import annotations

import contextvars
import hashlib
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from toolchain.atomic import atomic_file
from toolchain.errors import ArtifactError

# inside deferred_hashing(), unverified files from this size on are hashed in the background
DEFER_BYTES = 16 << 20
BACKGROUND_NICE = 19  # the background hash runs only on otherwise idle CPU
_DEFERRED: contextvars.ContextVar[list[Pending] | None] = contextvars.ContextVar(
    "mobc_deferred", default=None
)


def cache_dir() -> Path:
    return Path(os.environ.get("MOBC_CACHE", Path.home() / ".cache" / "mobc")) / "verified"


def sha256_path(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _entry(st: os.stat_result) -> tuple[Path, str]:
    return cache_dir() / f"{st.st_dev:x}-{st.st_ino:x}", f"{st.st_size} {st.st_mtime_ns} {st.st_ctime_ns}"


def known_sha(st: os.stat_result) -> str | None:
    """The sha256 recorded for this exact file state, or None."""
    path, state = _entry(st)
    try:
        recorded, _, digest = path.read_text().rpartition(" ")
    except (OSError, ValueError):
        return None
    return digest if recorded == state else None


def remember(st: os.stat_result, digest: str) -> None:
    """Records that the file in state `st` hashes to `digest` (best effort)."""
    path, state = _entry(st)
    try:
        with atomic_file(path) as tmp:
            tmp.write_text(f"{state} {digest}")
    except OSError:
        pass


def hash_and_remember(path: Path) -> str:
    st = os.stat(path)
    digest = sha256_path(path)
    if _entry(os.stat(path)) == _entry(st):  # unchanged while we read it (reading may move atime only)
        remember(st, digest)
    return digest


def expected_sizes(manifest) -> dict[str, int]:
    """Recorded sizes; manifests written before `sizes` existed still give their graphs' and weights' sizes."""
    if manifest.sizes:
        return dict(manifest.sizes)
    sizes = {g.file: g.onnx_bytes for g in manifest.graphs if g.onnx_bytes}
    if manifest.weights.get("file") and manifest.weights.get("bytes"):
        sizes[manifest.weights["file"]] = manifest.weights["bytes"]
    return sizes


def _compare(rel: str, path: Path, digest: str) -> str | None:
    try:
        got = hash_and_remember(path)
    except OSError:
        return f"{rel} could not be read"
    return None if got == digest else f"{rel} changed since the compile (its sha256 differs)"


def damaged_files(folder: Path, manifest, later: list[tuple[str, Path, str]] | None = None) -> list[str]:
    """One line per missing, resized or changed file (empty when the artifact is intact). With
    `later`, large files that need hashing are appended there instead of being hashed now."""
    sizes = expected_sizes(manifest)
    problems = []
    for rel, digest in manifest.files.items():
        path = folder / rel
        try:
            st = os.stat(path)
        except OSError:
            problems.append(f"{rel} is missing")
            continue
        want = sizes.get(rel)
        if want is not None and st.st_size != want:
            problems.append(f"{rel} is {st.st_size:,} bytes, the compile wrote {want:,}")
            continue
        known = known_sha(st)
        if known is not None:
            if known != digest:
                problems.append(f"{rel} changed since the compile (its sha256 differs)")
        elif later is not None and st.st_size >= DEFER_BYTES:
            later.append((rel, path, digest))
        elif problem := _compare(rel, path, digest):
            problems.append(problem)
    return problems


def fix_hint(folder: Path, manifest) -> str:
    recipe = manifest.recipe_file or "RECIPE"
    return (
        f"recompile it (`mobc compile {recipe} --out {folder} --force`); `mobc verify {folder}` "
        "lists every changed file"
    )


def _damaged(folder: Path, manifest, problems: list[str]) -> ArtifactError:
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return ArtifactError(
        f"{folder} is damaged: {'; '.join(problems[:3])}{more}. mobc will not use a corrupted artifact: "
        + fix_hint(folder, manifest)
    )


def check_files(folder: Path, manifest) -> None:
    """Raises ArtifactError naming the first damaged files and the fix (inside deferred_hashing(),
    large unverified files are left to a background Pending check)."""
    deferred = _DEFERRED.get()
    later: list[tuple[str, Path, str]] | None = [] if deferred is not None else None
    problems = damaged_files(folder, manifest, later)
    if problems:
        raise _damaged(folder, manifest, problems)
    if later:
        deferred.append(Pending(folder, manifest, later))


class Pending:
    """sha256 checks running on a background thread; `wait` raises if a file turned out damaged."""

    def __init__(self, folder: Path, manifest, files: list[tuple[str, Path, str]]):
        self.folder, self.manifest, self.problems = folder, manifest, []
        self._thread = threading.Thread(target=self._run, args=(files,), name="mobc-sha256", daemon=True)
        self._thread.start()

    def _run(self, files: list[tuple[str, Path, str]]) -> None:
        _yield_cpu()
        for rel, path, digest in files:
            if problem := _compare(rel, path, digest):
                self.problems.append(problem)

    def wait(self) -> None:
        self._thread.join()
        if self.problems:
            raise _damaged(self.folder, self.manifest, self.problems)


def _yield_cpu() -> None:
    """Lowers the calling thread's priority (Linux: nice is per thread), so the background hash
    takes the cores the start-up leaves idle instead of slowing the sessions it runs beside."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):  # no per-thread priority here: the hash just runs at normal priority
        pass


@contextmanager
def deferred_hashing() -> Iterator[list[Pending]]:
    """Manifest.load calls inside leave large unverified files to background checks, collected in
    the yielded list: the caller must `wait()` on each before it uses a result computed from them."""
    pending: list[Pending] = []
    token = _DEFERRED.set(pending)
    try:
        yield pending
    finally:
        _DEFERRED.reset(token)
