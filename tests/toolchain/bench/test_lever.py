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
    assert all(r["ties_with_ar"] == 0 and r["divergence"] == {} for r in data["decode"])
    assert "greedy: every policy reproduces ar token for token" in res.output
    assert [r["target_dram"] for r in data["dram_sweep"]] == [0.0, 0.5, 1.0]
    assert {r["variant"] for r in data["ablation"]} >= {"lever+full", "lever+path"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ablation" in res.output and "DRAM sweep" in res.output


def test_bench_lever_prices_a_draft_head_by_its_own_graphs(tmp_path, capsys, monkeypatch):
    """A draft head is an adapter over its StepModel: the bench prices the graphs inside it (it once
    failed with a traceback on the README's own command)."""
    from tests.toolchain.cli.test_commands import assert_user_error, mobc
    from tests.toolchain.head_fixtures import tiny_head_world

    _, target_dir, head_dir = tiny_head_world(tmp_path / "world")
    capsys.readouterr()  # the compiles' progress
    out, prompts = tmp_path / "res.json", tmp_path / "p.txt"
    prompts.write_text("def f(x):\n")

    def bench(spec: str):
        return mobc(capsys, monkeypatch, "bench", "lever", str(target_dir), "--draft", str(head_dir),
                    "--prompts", spec, "--max-new-tokens", "8", "--policies", "ar,lever", "--no-ablation",
                    "--sweep", "0", "--plot", str(tmp_path / "p.png"), "--json", str(out))

    code, _, err = bench("humaneval:1")  # longer than the tiny target's 64-token context
    assert_user_error(code, err, "no prompt of 'humaneval:1' leaves room", "--max-new-tokens")
    code, _, err = bench(f"file:{prompts}")
    assert code in (0, None), err
    rows = json.loads(out.read_text())["decode"]
    assert [r["policy"] for r in rows] == ["ar", "lever"] and rows[1]["identical_to_ar"] == 1
    assert rows[1]["phone_ms_per_token"] > 0
