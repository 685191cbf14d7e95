"""Where a compile writes (issue 17, cases 1 and 3): --force replaces only an artifact or an empty
folder, never a user's folder, a file or a symlink's target; staging folders never outlive their
compile (SIGTERM/SIGINT clean up, dead compiles' folders are swept) and never pass for artifacts;
one output, one compile at a time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli_main import run_main
from tests.tiny import write_recipe
from toolchain.compile import emit
from toolchain.errors import ArtifactError

GRAPHS = "  decode: {width: 1, context: 32}\n"


def _recipe(tmp_path: Path, src: Path, name: str = "tiny", extra: str = "") -> Path:
    r = write_recipe(tmp_path / f"{name}.yaml", src, name=name, graphs=GRAPHS, extra=extra)
    r.write_text(r.read_text().replace("greedy_tokens: 12", "greedy_tokens: 0"))
    return r


def _dead_pid() -> int:
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(proc.stdout)


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_case01_force_never_replaces_a_users_folder_a_link_target_or_a_recipe_output(tiny_source, tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "important.txt").write_text("x")
    recipe = _recipe(tmp_path, tiny_source)
    r = run_main("compile", recipe, "--out", precious, "--force")
    assert r.clean_error, r.err
    assert "is not a mobc artifact" in r.err and "important.txt" in r.err
    r = run_main("compile", recipe, "--out", precious)  # without --force: no advice to pass it
    assert r.clean_error and "--force to replace" not in r.err
    link = tmp_path / "link"
    link.symlink_to(precious, target_is_directory=True)
    r = run_main("compile", recipe, "--out", link, "--force")
    assert r.clean_error and "symbolic link" in r.err
    absolute = _recipe(tmp_path, tiny_source, name="abs")
    absolute.write_text(absolute.read_text().replace(str(tmp_path / "out" / "abs"), str(precious)))
    r = run_main("compile", absolute, "--force")
    assert r.clean_error and "important.txt" in r.err
    assert (precious / "important.txt").read_text() == "x" and link.is_symlink()


def test_force_replaces_an_artifact_or_an_empty_folder(tmp_path):
    art = tmp_path / "art"
    art.mkdir()
    (art / "manifest.json").write_text(json.dumps({"format": "mobc-artifact/1"}))
    (art / "old.onnx").write_text("old")
    with pytest.raises(ArtifactError, match="pass --force"):
        with emit.staging(art, force=False):
            pass
    for target in (art, tmp_path / "empty"):
        target.mkdir(exist_ok=True)
        with emit.staging(target, force=True) as tmp:
            (tmp / "new.onnx").write_text("new")
        assert [p.name for p in target.iterdir()] == ["new.onnx"]
    assert _leftovers(tmp_path) == []  # no staging, backup or lock file left


def test_an_output_that_changed_during_the_compile_is_kept(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ArtifactError, match="not a mobc artifact"):
        with emit.staging(out, force=True) as tmp:
            (tmp / "new.onnx").write_text("new")
            out.mkdir()  # the user put something there meanwhile
            (out / "mine.txt").write_text("x")
    assert [p.name for p in out.iterdir()] == ["mine.txt"] and _leftovers(tmp_path) == []


def test_case03_force_onto_a_file_keeps_it_and_leaves_nothing(tiny_source, tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    r = run_main("compile", _recipe(tmp_path, tiny_source), "--out", target, "--force")
    assert r.clean_error and "a file of 4 bytes" in r.err
    assert target.read_text() == "mine" and _leftovers(tmp_path) == []


def test_case03_dead_compiles_staging_is_swept_and_never_loaded(tiny_artifact, tiny_source, tmp_path):
    import shutil

    out = tmp_path / "out"
    out.mkdir()
    pid = _dead_pid()
    stale = out / f".tiny.partial-{pid}"
    shutil.copytree(tiny_artifact, stale)  # what a SIGKILL during verify leaves: a complete-looking folder
    running = out / f".other.partial-{os.getpid()}"  # a live compile's folder is left alone
    running.mkdir()
    scratch = out / f".tiny.scratch-{pid}"  # a killed compile's spilled weights (toolchain/ir/disk.py)
    scratch.mkdir()
    (scratch / "spill001-weights.bin").write_bytes(b"\0" * 64)
    r = run_main("inspect", stale)
    assert r.clean_error and "staging folder" in r.err and f"pid {pid}" in r.err
    recipe = _recipe(tmp_path, tiny_source)
    recipe.write_text(recipe.read_text().replace(f"path: {tiny_source}", f"path: {tmp_path / 'gone'}"))
    r = run_main("compile", recipe)  # fails loading its source, after sweeping beside its output
    assert r.clean_error and "source.path" in r.err
    assert not stale.exists() and not scratch.exists() and running.is_dir()


def test_case03_sigterm_during_emit_removes_staging_and_says_so(tiny_source, tmp_path):
    recipe = _recipe(tmp_path, tiny_source, name="term")
    out_parent = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "toolchain.cli.main", "compile", str(recipe)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path.cwd())},
    )
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if list(out_parent.glob(".term.partial-*/decode.onnx")):
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.02)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "interrupted by SIGTERM" in err and "Traceback" not in err
    assert err.strip().count("\n") == 0  # one line
    assert not (out_parent / "term").exists() and _leftovers(out_parent) == []


def test_case13_sigint_prints_one_line_and_cleans_up(tiny_source, tmp_path, monkeypatch):
    import toolchain.compile.pipeline as pipeline

    real = pipeline.write_rope

    def interrupted_write_rope(folder, tables):
        rec = real(folder, tables)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of emit
        time.sleep(1)
        return rec

    monkeypatch.setattr(pipeline, "write_rope", interrupted_write_rope)
    r = run_main("compile", _recipe(tmp_path, tiny_source, name="intr"))
    assert r.code == 128 + signal.SIGINT
    assert r.err.strip() == "interrupted by SIGINT: stopped, and removed what it had half written"
    assert not (tmp_path / "out" / "intr").exists() and _leftovers(tmp_path / "out") == []


def test_one_compile_per_output_at_a_time(tmp_path):
    out = tmp_path / "busy"
    lock = emit._lock_path(out)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
            "os.write(fd, str(os.getpid()).encode())\nprint('locked', flush=True)\ntime.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ArtifactError, match=f"another mobc compile \\(pid {holder.pid}\\) is writing"):
            emit.claim_output(out, force=False)
    finally:
        holder.kill()
        holder.wait()
    assert emit.claim_output(out, force=False) == out  # free again
    emit.release(out)
    assert _leftovers(tmp_path) == []
