"""`mobc bench startup`: what the artifact integrity check adds to a `mobc run` start.

Each round starts `mobc run ARTIFACT --prompt P --max-new-tokens 1` once per mode, interleaved
so that machine load hits every mode alike:
  unchecked  the integrity check is a no-op (the baseline; only this bench's child does that)
  cold       an empty integrity cache: a copied or restored artifact, every file is hashed once
  warm       the cache holds every file's state: every later run, and the first run after a compile
Each run is a fresh process measured from outside: wall time and peak RSS (os.wait4's ru_maxrss,
the figure `/usr/bin/time -v` prints). The table gives medians and each mode's ratio to unchecked.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("unchecked", "cold", "warm")


def run_once(mode: str, artifact: Path, prompt: str, cache: Path) -> dict[str, Any]:
    """One `mobc run` process in `mode`: wall seconds and peak RSS bytes."""
    env = {**os.environ, "MOBC_CACHE": str(cache)}
    if mode == "cold":
        shutil.rmtree(cache / "verified", ignore_errors=True)
    cmd = [sys.executable, "-m", "toolchain.cli.startup_child", mode, str(artifact), prompt]
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t
    stderr = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"mobc run ({mode}) exited {code}: {stderr.strip()[-500:]}")
    return {"seconds": seconds, "peak_rss_bytes": usage.ru_maxrss * 1024}


def measure(artifact: Path, prompt: str, rounds: int, progress=lambda msg: None) -> dict[str, Any]:
    """Medians per mode over `rounds` interleaved rounds (one warm-up run primes the page cache)."""
    with tempfile.TemporaryDirectory(prefix="mobc-startup-") as tmp:
        cache = Path(tmp)
        run_once("cold", artifact, prompt, cache)  # page cache warm for every mode; states recorded
        samples: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
        for r in range(rounds):
            for mode in MODES:
                samples[mode].append(run_once(mode, artifact, prompt, cache))
            progress(
                f"round {r + 1}/{rounds}: "
                + ", ".join(f"{m} {samples[m][-1]['seconds']:.2f} s" for m in MODES)
            )
    rows = {}
    for mode in MODES:
        secs = [s["seconds"] for s in samples[mode]]
        rows[mode] = {
            "median_s": statistics.median(secs),
            "min_s": min(secs),
            "max_s": max(secs),
            "peak_rss_bytes": max(s["peak_rss_bytes"] for s in samples[mode]),
        }
    base = rows["unchecked"]["median_s"]
    for mode in MODES:
        rows[mode]["ratio"] = rows[mode]["median_s"] / base
        rows[mode]["added_s"] = rows[mode]["median_s"] - base
    return {"artifact": str(artifact), "rounds": rounds, "modes": rows}
