"""CLI for the tree policies: `mobc bench lever` and `mobc train predictor` (registered on the
bench/train groups of toolchain/cli/run.py by importing this module from toolchain/cli/main.py)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from toolchain.cli.run import _EP_OPT, _PROVIDER, _THREADS, _models, bench_app, train_app
from toolchain.errors import MobcError

console = Console()
err = Console(stderr=True)


def _fmt(v, spec: str = ".2f") -> str:
    if v is None:
        return "—"
    return format(v, spec) if isinstance(v, int | float) else str(v)


def _print(title: str, rows: list[dict], cols: list[tuple[str, str, str]]) -> None:
    t = Table(title=title)
    for head, _, _ in cols:
        t.add_column(head, justify="left" if head == "policy" else "right")
    for r in rows:
        t.add_row(*[_fmt(r.get(key), spec.rstrip("x")) + ("x" if spec.endswith("x") and r.get(key) is not None else "")
                    for _, key, spec in cols])
    console.print(t)


def _prompt_ids(target, spec: str, skip: int) -> list[list[int]]:
    from toolchain.bench.decode import load_prompts

    kind, _, n = spec.partition(":")
    texts = load_prompts(f"{kind}:{int(n) + skip}" if n and kind == "humaneval" else spec)[skip:]
    return [target.tokenizer(t).input_ids for t in texts]


@bench_app.command("lever")
def bench_lever(
    artifact: Path = typer.Argument(..., help="target artifact (tree widths, split_lm_head, split_layers)"),
    draft: Path = typer.Option(..., "--draft", help="draft artifact folder"),
    policies: str = typer.Option("ar,chain,lever,lever+prune,ahasd", "--policies"),
    prompts: str = typer.Option("humaneval:20", "--prompts", help="humaneval:N or file:PATH"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    gamma: int = typer.Option(4, "--gamma", help="draft tokens per chain/ahasd verify"),
    device: str = typer.Option("snapdragon-8-gen-3", "--device"),
    target_dram: float = typer.Option(0.0, "--target-dram", help="fraction of target weights resident (0 = Flash-AR)"),
    draft_dram: float = typer.Option(1.0, "--draft-dram"),
    ablation: bool = typer.Option(True, "--ablation/--no-ablation"),
    sweep: str = typer.Option("0,0.5,1", "--sweep", help="target DRAM budgets to sweep ('' = none)"),
    plot: Path = typer.Option(Path("build/lever/tokens_vs_tree.png"), "--plot"),
    json_out: Path | None = typer.Option(None, "--json"),
    provider: str = _PROVIDER,
    threads: int | None = _THREADS,
    ep_option: list[str] = _EP_OPT,
) -> None:
    """ar, chain, lever (+prune) and ahasd on the same prompts: decode, ablation and DRAM-sweep tables and a PNG."""
    from toolchain.bench.lever import LeverBench

    target, drafter = _models(artifact, draft, provider, threads, ep_option)
    names = [p.strip() for p in policies.split(",") if p.strip()]
    if "lever+prune" in names and not (target.folder / "predictor.json").is_file():
        err.print(f"[yellow]no {target.folder / 'predictor.json'}: dropping lever+prune (run mobc train predictor)[/]")
        names = [n for n in names if "prune" not in n]
    ids = [x for x in _prompt_ids(target, prompts, 0) if len(x) + max_new_tokens + 40 < target.context]
    b = LeverBench(target, drafter, ids, max_new_tokens, gamma, device, target_dram, draft_dram,
                   log=lambda m: err.print(f"[dim]{m}[/]"))
    main = b.table(["ar", *[n for n in names if n != "ar"]])
    res: dict = {"target": target.name, "draft": drafter.name, "device": device, "target_dram": target_dram,
                 "draft_dram": draft_dram, "prompts": len(ids), "max_new_tokens": max_new_tokens, "decode": main}
    cols = [("policy", "policy", ""), ("tok/s CPU", "tokens_per_s_cpu", ".1f"),
            ("tokens/cycle", "tokens_per_cycle", ".2f"), ("phone ms/tok", "phone_ms_per_token", ".2f"),
            ("speedup CPU", "speedup_cpu", ".2fx"), ("phone vs ar", "speedup_phone", ".2fx"),
            ("phone vs chain", "speedup_phone_vs_chain", ".2fx"), ("tree nodes", "mean_tree_nodes", ".1f"),
            ("lm_head rows", "lm_head_rows", ""), ("overlap", "overlap", ".2f"), ("== ar", "identical_to_ar", "d")]
    _print(f"decode {target.name} + {drafter.name}, {len(ids)} prompts, {device}, target DRAM {target_dram:g}",
           main, cols)
    lever_name = "lever"  # the sweep re-runs the main lever policy (its decisions read the cost model)
    if ablation and "lever" in names:
        abl = ["ar", "chain", "lever+full"] + (["lever+prune+full", "lever+prune+path"] if "lever+prune" in names
                                               else ["lever+path"])
        rows = b.table(abl)
        labels = {"lever+full": "gain/cost trees only", "lever+prune+full": "+ predictor pruning",
                  "lever+prune+path": "+ path-only logits", "lever+path": "+ path-only logits (no predictor)"}
        for r in rows:
            r["variant"], r["policy"] = r["policy"], labels.get(r["policy"], r["policy"])
        res["ablation"] = rows
        _print("ablation", rows, [*cols[:7], ("lm_head GFLOP saved", "lm_head_gflops_saved", ".2f"),
                                  ("pruned nodes", "pruned_nodes", ""), ("verify GFLOP saved", "verify_gflops_saved", ".1f"),
                                  ("== ar", "identical_to_ar", "d")])
    budgets = [float(x) for x in sweep.split(",") if x.strip()]
    if budgets and "lever" in names:
        rows = b.sweep(budgets, lever_name)
        res["dram_sweep"] = rows
        _print(f"DRAM sweep (target layers resident), {lever_name}", rows,
               [("target DRAM", "target_dram", ".0%"), ("ar ms/tok", "ar_ms", ".2f"), ("chain ms/tok", "chain_ms", ".2f"),
                (f"{lever_name} ms/tok", f"{lever_name}_ms", ".2f"), ("ahasd ms/tok", "ahasd_ms", ".2f"),
                ("lever vs ar", "lever_vs_ar", ".2fx"), ("lever vs chain", "lever_vs_chain", ".2fx"),
                ("== ar", "lever_identical", "d")])
    if "lever" in names:
        console.print(f"plot: {b.plot(lever_name, plot)}")
    bad = [r["policy"] for r in main if r["identical_to_ar"] != r["prompts"]]
    console.print("[green]greedy: every policy reproduces ar on every prompt[/]" if not bad
                  else f"[red]greedy mismatch vs ar: {', '.join(bad)}[/]")
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(res, indent=1, default=str))
        console.print(f"wrote {json_out}")


@train_app.command("predictor")
def train_predictor(
    artifact: Path = typer.Argument(..., help="target artifact compiled with split_layers at the predictor layer"),
    draft: Path = typer.Option(..., "--draft", help="draft artifact folder"),
    prompts: str = typer.Option("humaneval:40", "--prompts"),
    skip: int = typer.Option(100, "--skip", help="skip the first N prompts (keep the bench's prompts out)"),
    minutes: float = typer.Option(3.0, "--minutes"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    recall: float = typer.Option(0.95, "--recall", help="recall of accepted-worthy branches to keep"),
    out: Path | None = typer.Option(None, "--out", help="default: ARTIFACT/predictor.json (found by lever+prune)"),
    threads: int | None = _THREADS,
) -> None:
    """Fit lever's branch predictor on real target + draft runs; report precision/recall."""
    from toolchain.runtime.predictor import save_predictor
    from toolchain.train.predictor import train_predictor as fit

    target, drafter = _models(artifact, draft, "cpu", threads, [])
    if drafter is None:
        raise MobcError("--draft is required")
    texts = [target.tokenizer.decode(x) for x in _prompt_ids(target, prompts, skip)]
    spec = fit(target, drafter, texts, seconds=minutes * 60, max_new_tokens=max_new_tokens, recall=recall,
               log=lambda m: err.print(f"[dim]{m}[/]"))
    path = save_predictor(spec, out or artifact / "predictor.json")
    m = spec.metrics
    console.print(f"[bold green]predictor[/] {path}: layer {spec.layer}, threshold {spec.threshold:.3f}, "
                  f"{m['train_nodes']} train / {m['test_nodes']} test nodes from {m['prompts']} prompts "
                  f"({m['seconds']:.0f} s)")
    t, bb = m["test"], m["backbone_only"]
    console.print(f"held-out: precision {t['precision']:.3f}, recall {t['recall']:.3f}, pruned {t['pruned_fraction']:.1%} "
                  f"of nodes (backbone only: precision {bb['precision']:.3f}, recall {bb['recall']:.3f})")
