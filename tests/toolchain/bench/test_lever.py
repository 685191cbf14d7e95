"""`mobc bench lever` on tiny artifacts: one command prints the decode, ablation and DRAM-sweep
tables, writes the JSON and a valid PNG, and every policy reproduces ar."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from toolchain.cli.main import app


def test_bench_lever_command(tree_artifacts, tmp_path):
    target_dir, draft_dir = tree_artifacts
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\n---\nimport os\n")
    out, png = tmp_path / "res.json", tmp_path / "plot.png"
    res = CliRunner().invoke(app, ["bench", "lever", str(target_dir), "--draft", str(draft_dir),
                                   "--prompts", f"file:{prompts}", "--max-new-tokens", "10", "--gamma", "3",
                                   "--policies", "ar,chain,lever,ahasd", "--plot", str(png), "--json", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    names = [r["policy"] for r in data["decode"]]
    assert names == ["ar", "chain", "lever", "ahasd"]
    assert all(r["identical_to_ar"] == r["prompts"] == 2 for r in data["decode"])
    assert [r["target_dram"] for r in data["dram_sweep"]] == [0.0, 0.5, 1.0]
    assert {r["variant"] for r in data["ablation"]} >= {"lever+full", "lever+path"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ablation" in res.output and "DRAM sweep" in res.output
