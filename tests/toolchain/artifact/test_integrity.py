"""Artifact integrity at load (issue 17, cases 2 and 9): sizes always, sha256 once per file state,
a damaged artifact is one clear message with exit code 2 naming the file and the fix."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.cli_main import run_main
from toolchain.artifact.manifest import Manifest
from toolchain.errors import ArtifactError


def _count_hashes(monkeypatch) -> list[str]:
    from toolchain.artifact import integrity

    hashed: list[str] = []
    real = integrity.sha256_path

    def counting(path):
        hashed.append(os.path.basename(path))
        return real(path)

    monkeypatch.setattr(integrity, "sha256_path", counting)
    return hashed


def test_case02_random_bytes_inside_weights_are_refused(artifact_copy):
    weights = artifact_copy / "weights.bin"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:  # same size, different bytes: only the sha256 can tell
        f.seek(size // 3)
        f.write(np.random.default_rng(0).bytes(min(4 << 20, size // 3)))
    r = run_main("run", artifact_copy, "--prompt", "def f(x):", "--max-new-tokens", "4")
    assert r.clean_error, r.err
    assert "weights.bin changed since the compile" in r.err and "mobc compile" in r.err and "--force" in r.err


def test_case09_truncated_weights_are_refused_before_onnxruntime(artifact_copy):
    weights = artifact_copy / "weights.bin"
    size = weights.stat().st_size
    os.truncate(weights, size // 2)
    r = run_main("run", artifact_copy, "--prompt", "def f(x):", "--max-new-tokens", "4")
    assert r.clean_error, r.err
    assert f"weights.bin is {size // 2:,} bytes, the compile wrote {size:,}" in r.err
    assert "onnxruntime" not in r.err.lower()


def test_sha256_once_per_file_state(artifact_copy, monkeypatch):
    hashed = _count_hashes(monkeypatch)
    Manifest.load(artifact_copy)  # a copy: new inodes, so every file is hashed once
    first = sorted(hashed)
    assert "weights.bin" in first and "decode.onnx" in first
    hashed.clear()
    Manifest.load(artifact_copy)
    assert hashed == []  # warm: stat only
    weights = artifact_copy / "weights.bin"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # same bytes, new state
    Manifest.load(artifact_copy)
    assert hashed == ["weights.bin"]


def test_the_compile_records_what_it_hashed(tiny_artifact, monkeypatch):
    hashed = _count_hashes(monkeypatch)
    Manifest.load(tiny_artifact)
    assert hashed == []  # the first load after a compile is warm


def test_runtime_hashes_large_weights_beside_session_start(artifact_copy, monkeypatch):
    """StepModel defers large unverified files to a background check that its first call waits for."""
    from toolchain.artifact import integrity
    from toolchain.runtime.model import StepModel

    monkeypatch.setattr(integrity, "DEFER_BYTES", 1024)
    with open(artifact_copy / "weights.bin", "r+b") as f:
        f.seek(4096)
        f.write(b"\x7f" * 4096)
    model = StepModel(artifact_copy)  # sizes fine: loads; the sha256 runs in the background
    with pytest.raises(ArtifactError, match="weights.bin changed since the compile"):
        model.prefill([1, 2, 3])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_background_hash_runs_at_low_priority(artifact_copy, monkeypatch):
    """The deferred sha256 takes idle CPU only: its thread is niced below the sessions it runs beside."""
    import threading

    from toolchain.artifact import integrity

    seen: list[int] = []
    real = integrity._compare

    def recording(rel, path, digest):  # small files are still hashed on the calling thread
        if threading.current_thread() is not threading.main_thread():
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real(rel, path, digest)

    monkeypatch.setattr(integrity, "_compare", recording)
    monkeypatch.setattr(integrity, "DEFER_BYTES", 1024)
    with integrity.deferred_hashing() as pending:
        Manifest.load(artifact_copy)
    assert pending, "weights.bin was not left to the background check"
    for p in pending:
        p.wait()
    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen and all(nice > main for nice in seen), (seen, main)


def test_a_staging_folder_of_another_process_is_not_an_artifact(tiny_artifact, tmp_path):
    import shutil

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    staging = tmp_path / f".tiny.partial-{int(dead.stdout)}"
    shutil.copytree(tiny_artifact, staging)
    with pytest.raises(ArtifactError, match="staging folder, not a finished mobc artifact.*interrupted"):
        Manifest.load(staging)
    r = run_main("inspect", staging)
    assert r.clean_error and "staging folder" in r.err
