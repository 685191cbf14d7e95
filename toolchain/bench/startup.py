"""`mobc bench startup`: what the artifact integrity check adds to a `mobc run` start.

Each round starts `mobc run ARTIFACT --prompt P --max-new-tokens 1` once per mode, interleaved
so that machine load hits every mode alike:
  unchecked  the integrity check is a no-op (the baseline; only this bench's child does that)
  cold       an empty integrity cache: a copied or restored artifact, every file is hashed once
  warm       the cache holds every file's state: every later run, and the first run after a compile
Each run is a fresh process measured from outside: time to its first generated text on stdout (the
start a user sees: `mobc run` writes the prompt and the first token together), wall time to exit
and peak RSS (os.wait4's ru_maxrss, the figure `/usr/bin/time -v` prints). The table gives medians
and each mode's ratio to unchecked.
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
    """One `mobc run` process in `mode`: seconds to its first generated text and to its exit, peak RSS bytes."""
    env = {**os.environ, "MOBC_CACHE": str(cache)}
    if mode == "cold":
        shutil.rmtree(cache / "verified", ignore_errors=True)
    cmd = [sys.executable, "-m", "toolchain.cli.startup_child", mode, str(artifact), prompt]
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = first_text_after(proc.stdout, len(prompt.encode()))
    first_token = time.perf_counter() - t
    proc.stdout.read()  # the rest, so the child never blocks on a full pipe
    stderr = proc.stderr.read().decode(errors="replace")  # small: the one-line summary or an error
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"mobc run ({mode}) exited {code}: {stderr.strip()[-500:]}")
    # a first token that decodes to no text shows only at exit: then the exit time stands for it
    return {"seconds": seconds, "first_token_s": first_token if first else seconds,
            "peak_rss_bytes": usage.ru_maxrss * 1024}


def first_text_after(stream: Any, skip: int) -> bool:
    """Reads `stream` until it has given more than `skip` bytes (the echoed prompt); False at its end."""
    got = 0
    while got <= skip:
        chunk = os.read(stream.fileno(), 65536)
        if not chunk:
            return False
        got += len(chunk)
    return True


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
        firsts = [s["first_token_s"] for s in samples[mode]]
        rows[mode] = {
            "first_token_median_s": statistics.median(firsts),
            "first_token_max_s": max(firsts),
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
