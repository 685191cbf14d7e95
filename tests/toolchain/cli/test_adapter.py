"""The issue-7 commands end to end on the tiny artifact: pack, run --adapter (no recompile),
run --policy ctg / ds2d, bench ctg / ds2d (JSON), and user errors as one-line messages."""

from __future__ import annotations

import json

import numpy as np
from typer.testing import CliRunner

from tests.lora_tiny import M, peft_adapter
from toolchain.cli.main import app
from toolchain.runtime.policies.ds2d import FORECAST_FILE

PROMPT = "def main(argv):\n    return"


def test_cli_pack_run_and_bench(lora_artifact, tmp_path):
    artifact, src = lora_artifact
    runner = CliRunner()
    outs = {}
    for name, seed in (("a", 1), ("b", 2)):
        peft_adapter(src, tmp_path / name, r=4, seed=seed)
        res = runner.invoke(app, ["adapter", "pack", str(artifact), str(tmp_path / name)])
        assert res.exit_code == 0, res.output
    for adapter in ("a", "b", None):
        args = ["run", str(artifact), "--prompt", PROMPT, "--max-new-tokens", "10"]
        res = runner.invoke(app, args + (["--adapter", adapter] if adapter else []))
        assert res.exit_code == 0, res.output
        outs[adapter] = res.stdout
    assert len(set(outs.values())) == 3  # two adapters and the base, one artifact, no recompile
    res = runner.invoke(app, ["run", str(artifact), "--prompt", PROMPT, "--max-new-tokens", "6", "--policy", "ctg",
                              "--adapter", "a", "--adapter", "b", "--adapter", "base"])
    assert res.exit_code == 0, res.output
    assert res.stdout.count("style ") == 3
    rng = np.random.default_rng(0)
    with open(artifact / FORECAST_FILE, "wb") as f:
        np.savez(f, forecast_embeds=rng.standard_normal((M, 64)).astype(np.float32))
    res = runner.invoke(app, ["run", str(artifact), "--prompt", PROMPT, "--max-new-tokens", "10", "--policy", "ds2d"])
    assert res.exit_code == 0, res.output
    assert res.stdout == outs[None]  # ds2d reproduces greedy AR
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n---\n".join([PROMPT, "import os\nclass Path"]))
    js = tmp_path / "ctg.json"
    res = runner.invoke(app, ["bench", "ctg", str(artifact), "--adapter", "a", "--adapter", "b", "--adapter",
                              "base", "-k", "3", "--prompts", f"file:{prompts}", "--max-new-tokens", "6",
                              "--json", str(js)])
    assert res.exit_code == 0, res.output
    data = json.loads(js.read_text())
    assert data["identical_styles"] == data["total_styles"] == 6 and data["ratio_decode"] > 0
    js = tmp_path / "ds2d.json"
    res = runner.invoke(app, ["bench", "ds2d", str(artifact), "--prompts", f"file:{prompts}",
                              "--max-new-tokens", "12", "--json", str(js)])
    assert res.exit_code == 0, res.output
    assert json.loads(js.read_text())["identical"] == 2


def test_cli_errors_are_one_line(lora_artifact, tmp_path):
    import subprocess
    import sys

    artifact, src = lora_artifact
    peft_adapter(src, tmp_path / "big", r=8)
    proc = subprocess.run([sys.executable, "-m", "toolchain.cli.main", "adapter", "pack", str(artifact),
                           str(tmp_path / "big")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "max_rank 4" in proc.stderr and "Traceback" not in proc.stderr
