"""`mobc bench compile`: how a compile's time and memory grow with the model.

For each size, a random-weight Llama checkpoint of that shape is written (toolchain/bench/checkpoints.py,
reused when present), compiled with the NPU recipe in a child process, and measured from outside:
wall time and the child's peak resident set (os.wait4's ru_maxrss, the figure `/usr/bin/time -v`
prints). The verification figures (max |logits diff| vs transformers, greedy identical) come from
the artifact's manifest, so every row is a verified compile or says why not.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from toolchain.bench.checkpoints import SHAPES, write_random_llama

NPU_PASSES: list[Any] = [
    "fold_constants", "scale_rmsnorm", "mha_to_sha", "linear_to_conv", "split_lm_head",
    {"split_parts": {"max_part_bytes": 1.0e9}}, "check_htp",
]
W4A16 = {"method": "ptq", "weights": "int4", "granularity": "block", "block_size": 32,
         "activations": "int16", "kv_cache": "int8", "calibration": {"samples": 2}, "eval_tokens": 0}


def recipe_for(size: str, checkpoint: Path, variant: str, context: int, prefill: int) -> dict[str, Any]:
    recipe: dict[str, Any] = {
        "name": f"llama-{size}-{variant}",
        # absolute: a relative source path resolves from the recipe's folder, not from the cwd
        "source": {"path": str(checkpoint.resolve())},
        "graphs": {"decode": {"width": 1, "context": context}, "prefill": {"width": prefill, "context": context}},
        "passes": NPU_PASSES,
        "tolerance": {"max_abs": 1.0e-3},
        "verify": {"greedy_tokens": 16},
    }
    if variant == "w4a16":
        # parts bound the quantizer's memory: it loads, calibrates and rewrites one part at a time
        # (split_lm_head first: measured, a 3B's raw graph cut by budget alone failed at its last layer)
        recipe["passes"] = ["split_lm_head", {"split_parts": {"max_part_bytes": 1.0e9}}]
        recipe["quantize"] = W4A16
    return recipe


def run_compile(recipe_path: Path, out: Path, log_path: Path) -> dict[str, Any]:
    """One compile in a child process: wall seconds, peak RSS bytes, exit code."""
    cmd = [sys.executable, "-m", "toolchain.cli.main", "compile", str(recipe_path), "--out", str(out), "--force"]
    t = time.perf_counter()
    sampled, during = 0, ""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        while True:  # poll, so the stage that holds the peak can be named
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            rss = _rss_bytes(proc.pid)
            if rss > sampled:
                sampled, during = rss, _running_stage(log_path)
            time.sleep(0.5)
    return {"seconds": round(time.perf_counter() - t, 1), "peak_rss_bytes": usage.ru_maxrss * 1024,
            "peak_after_stage": during, "exit_code": os.waitstatus_to_exitcode(status)}


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _running_stage(log_path: Path) -> str:
    """The last stage the compile finished ("✓ ..." line): the peak came in the stage after it."""
    done = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.startswith("✓")]
    return done[-1][2:].rsplit(" (", 1)[0] if done else "start"


def verification(out: Path) -> dict[str, Any]:
    path = out / "manifest.json"
    if not path.is_file():
        return {}
    m = json.loads(path.read_text())
    v = m.get("verification") or {}
    fams = v.get("families") or {}
    return {"logits_max_abs": max((f["logits_max_abs"] for f in fams.values()), default=None),
            "greedy_identical": (v.get("greedy") or {}).get("identical"),
            "weights_bytes": (m.get("weights") or {}).get("bytes"), "parts": len(m.get("graphs", []))}


def bench(sizes: list[str], variants: list[str], work: Path, context: int = 1024, prefill: int = 128,
          keep: bool = False, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    rows = []
    for size in sizes:
        shape = SHAPES[size]
        checkpoint = work / f"llama-{size}"
        if not (checkpoint / "model.safetensors").is_file():
            log(f"writing random {size} checkpoint ({shape.parameters() / 1e9:.2f}B parameters)")
            write_random_llama(checkpoint, shape)
        for variant in variants:
            recipe = recipe_for(size, checkpoint, variant, context, prefill)
            recipe_path = work / f"{recipe['name']}.yaml"
            recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
            out = work / "out" / recipe["name"]
            log(f"compiling {recipe['name']} (log: {work / (recipe['name'] + '.log')})")
            run = run_compile(recipe_path, out, work / f"{recipe['name']}.log")
            weights = shape.parameters() * 4
            rows.append({"size": size, "variant": variant, "parameters": shape.parameters(),
                         "fp32_weight_bytes": weights, **run,
                         "peak_over_weights": round(run["peak_rss_bytes"] / weights, 3),
                         **(verification(out) if run["exit_code"] == 0 else {})})
            if not keep:  # a 3B artifact is 13 GB: free the disk for the next size
                shutil.rmtree(out, ignore_errors=True)
    return rows


def chart(rows: list[dict[str, Any]], path: Path) -> Path:
    from toolchain.bench.png import line_chart

    series = {}
    for variant in dict.fromkeys(r["variant"] for r in rows):
        ok = [r for r in rows if r["variant"] == variant and r["exit_code"] == 0]
        series[f"{variant} peak RSS GB"] = ([r["parameters"] / 1e9 for r in ok],
                                           [r["peak_rss_bytes"] / 1e9 for r in ok])
    series["fp32 weights GB"] = ([r["parameters"] / 1e9 for r in rows],
                                 [r["fp32_weight_bytes"] / 1e9 for r in rows])
    return line_chart(path, series, "compile peak memory vs model size", "parameters (B)", "GB")
