"""`mobc bench train-step` on a tiny target: every variant is timed, and the malloc setting is the one it names."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from tests.cli_main import run_main
from tests.tiny import save_tiny, write_recipe


def test_the_default_malloc_faults_in_each_step_and_the_pinned_one_does_not(tmp_path):
    """In a fresh process, as `mobc bench train-step` runs (this process's freed heap would blur the faults)."""
    hf = save_tiny(tmp_path / "hf", "llama")
    probe = f"""
import json, torch
from pathlib import Path
from toolchain.bench.train_step import measure
from toolchain.train.head import HeadConfig, load_target
from tests.tiny import write_recipe
target, tok, _, _ = load_target(write_recipe(Path({str(tmp_path / 't.yaml')!r}), Path({str(hf)!r})))
windows = torch.randint(3, 512, (8, 256), generator=torch.Generator().manual_seed(0))
print(json.dumps(measure(target, tok, windows, rounds=2, steps=4, cfg=HeadConfig(draft_vocab=256))))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    rows = {(r["precision"], r["malloc"]): r for r in res["rows"]}
    assert list(rows) == [("fp32", "default"), ("fp32", "pinned"), ("bf16", "default"), ("bf16", "pinned")]
    assert res["glibc"] and res["windows"] == [8, 256] and res["steps_per_block"] == 4
    assert rows[("fp32", "default")]["steps_per_minute_vs_base"] == 1.0
    for r in rows.values():
        assert 0 < r["min_s"] <= r["median_s"] <= r["max_s"]
        assert abs(r["steps_per_minute_vs_base"] - rows[("fp32", "default")]["median_s"] / r["median_s"]) < 1e-12
    # fp32 activations of 4 x 256 rows are above 128 KB: fresh mappings every step. Measured: fp32 ~12.5k faults
    # per step against ~1.9k pinned (the pinned block faults back in what the default block's trim gave back),
    # bf16 ~3.2k against ~0.4k; with the default block left untrimmed fp32 read ~2.5k, with every block pinned ~0.5k
    assert rows[("fp32", "default")]["faults_per_step"] > 6000, rows
    for precision in ("fp32", "bf16"):
        default, pinned = rows[(precision, "default")], rows[(precision, "pinned")]
        assert pinned["faults_per_step"] < default["faults_per_step"] / 3, rows


def test_the_bench_names_a_missing_cache_or_recipe(tmp_path):
    r = run_main("bench", "train-step", "--windows", tmp_path / "none.pt")
    assert r.clean_error and "none.pt: no such file" in r.err
    r = run_main("bench", "train-step", tmp_path / "none.yaml")
    assert r.clean_error and "none.yaml: no such recipe" in r.err
    torch.save({"windows": torch.zeros(2, 4)}, tmp_path / "other.pt")
    r = run_main("bench", "train-step", "--windows", tmp_path / "other.pt")
    assert r.clean_error and "other.pt: not a cache this command wrote" in r.err


def test_the_bench_prints_its_table_and_json(tmp_path):
    hf = save_tiny(tmp_path / "hf", "llama")
    recipe = write_recipe(tmp_path / "t.yaml", hf)
    cache = tmp_path / "c.pt"
    torch.save({"key": {"target": "tiny"}, "app": torch.randint(3, 500, (6, 64), dtype=torch.int32)}, cache)
    r = run_main("bench", "train-step", recipe, "--windows", cache, "--n-windows", "4", "--rounds", "1", "--steps", "1",
                 "--json", tmp_path / "o.json")
    assert r.code == 0, r.err
    assert "bf16 malloc pinned" in r.out and "page faults per step" in r.out and "1.00x" in r.out
    res = json.loads((tmp_path / "o.json").read_text())
    assert res["windows"] == [4, 64] and len(res["rows"]) == 4
