#!/usr/bin/env python3
"""CI export job: compile recipes, verify them, build QNN binaries here, and run AI Hub jobs when a
token is configured. Each recipe's manifest, report and hub results are collected under OUT/<name>/
for upload as build artifacts; OUT/summary.json and the printed table say what passed.

    python ci/export.py --tiny                    # offline smoke job: a tiny Llama built from a config
    python ci/export.py recipes/smollm2-135m.yaml # one cell of the recipe matrix
    python ci/export.py                           # every recipe in recipes/

Steps per recipe (a failed step fails the job; a skipped one says why):
  compile   mobc compile RECIPE --out OUT/<name>/artifact --force
  verify    mobc verify (checksums and numerics against the source model)
  qnn       a QNN HTP context binary per graph via onnxruntime-qnn (this machine's HTP prepare),
            the smallest graph also run on the emulated HTP and compared with the CPU EP;
            skipped when the recipe's compile already built them or onnxruntime-qnn is missing
  hub       with an AI Hub token (~/.qai_hub/client.ini, e.g. from `qai-hub configure --api_token
            "$QAI_HUB_API_TOKEN"`): mobc hub compile, profile, calibrate on --device.
            Without one: `mobc hub compile --dry-run`, which checks the job plan offline.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_DEVICE = "Samsung Galaxy S24 (Family)"
COLLECT = ("manifest.json", "report.md")


class Step:
    def __init__(self, results: list[dict[str, Any]], recipe: str, name: str):
        self.rec: dict[str, Any] = {"recipe": recipe, "step": name, "status": "running"}
        results.append(self.rec)
        self.t0 = time.perf_counter()

    def finish(self, status: str, detail: str = "") -> bool:
        self.rec.update(status=status, detail=detail, seconds=round(time.perf_counter() - self.t0, 1))
        print(
            f"[{status}] {self.rec['recipe']}: {self.rec['step']} ({self.rec['seconds']} s) {detail}",
            flush=True,
        )
        return status != "failed"


def mobc(*args: str, log: Path) -> tuple[bool, str]:
    """Runs `mobc ARGS` in a child process; its output goes to the log file (uploaded with the rest)."""
    cmd = [sys.executable, "-m", "toolchain.cli.main", *args]
    with open(log, "a") as f:
        f.write(f"$ mobc {' '.join(args)}\n")
        f.flush()
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True)
    tail = log.read_text().strip().splitlines()[-1:] or [""]
    return proc.returncode == 0, tail[0][:300]


def tiny_recipe(out: Path) -> tuple[Path, str]:
    """A 2-layer Llama built from a config with a small trained tokenizer: no downloads, seconds to compile.

    Returns the recipe and, when the HTP cannot take its graphs, why the qnn step must be skipped:
    HTP fails to finalize RMSNorm written with Pow(x, 2) (FINDINGS), which the scale_rmsnorm pass fixes.
    """
    import passes
    from tests.tiny import save_tiny, write_recipe

    model_dir = save_tiny(out / "tiny-llama-hf", "llama")
    has_pass = "scale_rmsnorm" in passes.PASSES
    recipe = write_recipe(
        out / "tiny-llama.yaml",
        model_dir,
        name="tiny-llama",
        extra="passes: [scale_rmsnorm]\n" if has_pass else "",
    )
    return (
        recipe,
        "" if has_pass else "the scale_rmsnorm pass is not registered; HTP cannot finalize Pow RMSNorm",
    )


def qnn_step(artifact: Path, dest: Path) -> tuple[str, str]:
    from toolchain.artifact.manifest import Manifest
    from toolchain.qnn import context as qnn

    manifest = Manifest.load(artifact)
    if manifest.qnn:
        return "skipped", "context binaries already built by mobc compile (recipe qnn: section)"
    ok, reason = qnn.availability()
    if not ok:
        # a declared dependency on Linux x86_64: missing there, the install is broken, not the step optional
        return ("failed" if qnn.declared_here() else "skipped"), f"onnxruntime-qnn unavailable: {reason}"
    graphs = {g.name: artifact / g.file for g in manifest.graphs}
    smallest = min(manifest.graphs, key=lambda g: (g.width, g.name)).name
    spec = qnn.QnnSpec(**(manifest.recipe or {}).get("qnn") or {})
    if manifest.quantization:
        spec = spec.model_copy(update={"fp16": False})  # QDQ graphs run as integer kernels
    dest.mkdir(parents=True, exist_ok=True)
    records = qnn.emit_qnn(graphs, dest, spec.model_copy(update={"verify": False}))
    # one emulated run is enough to prove the binary executes; the HTP emulator is slow on 2 cores
    check = qnn.emit_qnn(
        {smallest: graphs[smallest]}, dest / "verify", spec.model_copy(update={"verify": True})
    )
    (dest / "qnn.json").write_text(json.dumps({"binaries": records, "verified": check}, indent=2))
    worst = check[0].get("verify", {}).get("worst_max_abs")
    return "passed", f"{len(records)} binaries; {smallest} on emulated HTP vs CPU max |diff| {worst}"


def hub_steps(artifact: Path, device: str, log: Path, results: list[dict[str, Any]], name: str) -> bool:
    from toolchain.hub.client import token_configured

    if not token_configured():
        step = Step(results, name, "hub (dry run)")
        ok, tail = mobc("hub", "compile", str(artifact), "--device", device, "--dry-run", log=log)
        step.finish("passed" if ok else "failed", tail)
        Step(results, name, "hub").finish("skipped", "no AI Hub token (set the QAI_HUB_API_TOKEN secret)")
        return ok
    for sub in ("compile", "profile", "calibrate"):
        step = Step(results, name, f"hub {sub}")
        ok, tail = mobc("hub", sub, str(artifact), "--device", device, log=log)
        if not step.finish("passed" if ok else "failed", tail):
            return False
    return True


def collect(artifact: Path, dest: Path) -> None:
    """The small files worth keeping from a run: manifest, report, AI Hub profiles and device profiles."""
    for name in COLLECT:
        if (artifact / name).is_file():
            shutil.copy2(artifact / name, dest / name)
    for p in artifact.glob("hub/*/**/*"):
        if p.is_file() and p.suffix in (".json", ".yaml"):
            target = dest / p.relative_to(artifact)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, target)


def export(
    recipe: Path, out: Path, device: str, qnn: bool, results: list[dict[str, Any]], qnn_skip: str = ""
) -> bool:
    from toolchain.compile.recipe import load_recipe

    name = load_recipe(recipe).name
    dest = out / name
    artifact = dest / "artifact"
    dest.mkdir(parents=True, exist_ok=True)
    log = dest / "log.txt"
    log.write_text("")
    try:
        step = Step(results, name, "compile")
        ok, tail = mobc("compile", str(recipe), "--out", str(artifact), "--force", log=log)
        if not step.finish("passed" if ok else "failed", tail):
            return False
        step = Step(results, name, "verify")
        ok, tail = mobc("verify", str(artifact), log=log)
        if not step.finish("passed" if ok else "failed", tail):
            return False
        step = Step(results, name, "qnn")
        if not qnn or qnn_skip:
            step.finish("skipped", qnn_skip or "--no-qnn")
        else:
            try:
                status, detail = qnn_step(artifact, dest / "qnn")
            except Exception as exc:  # a CI job reports every failure and carries on collecting
                status, detail = "failed", f"{type(exc).__name__}: {exc}"[:300]
            if not step.finish(status, detail):
                return False
        return hub_steps(artifact, device, log, results, name)
    finally:
        if artifact.is_dir():
            collect(artifact, dest)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipes", nargs="*", type=Path, help="recipe files (default: recipes/*.yaml)")
    ap.add_argument(
        "--tiny", action="store_true", help="export a tiny Llama built from a config (offline, fast)"
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=ROOT / "build" / "ci-out",
        help="where results go (default: build/ci-out/, git-ignored)",
    )
    ap.add_argument("--device", default=DEFAULT_DEVICE, help=f"AI Hub device (default: {DEFAULT_DEVICE})")
    ap.add_argument("--no-qnn", dest="qnn", action="store_false", help="skip local QNN context binaries")
    args = ap.parse_args()

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    recipes = {r.resolve(): "" for r in args.recipes}
    if args.tiny:
        tiny, skip = tiny_recipe(out / "tiny-src")
        recipes[tiny] = skip
    if not recipes:
        recipes = {r: "" for r in sorted((ROOT / "recipes").glob("*.yaml"))}
    results: list[dict[str, Any]] = []
    ok = True
    for recipe, qnn_skip in recipes.items():
        try:
            ok &= export(recipe, out, args.device, args.qnn, results, qnn_skip)
        except Exception as exc:  # e.g. a malformed recipe: report it, go on with the matrix
            Step(results, recipe.name, "setup").finish("failed", f"{type(exc).__name__}: {exc}"[:300])
            ok = False
    (out / "summary.json").write_text(json.dumps(results, indent=2))
    print(
        "\n"
        + "\n".join(
            f"{r['status']:>8}  {r['recipe']:<20} {r['step']:<16} {r.get('seconds', '')}" for r in results
        )
    )
    print("export job " + ("passed" if ok else "FAILED") + f"; results in {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
