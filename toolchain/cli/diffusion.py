"""`mobc train diffusion` and `mobc bench diffusion` (registered into the runtime CLI's sub-apps)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

# wide tables stay readable when the output is a file or a pipe (rich assumes 80 columns there)
console = Console(width=None if Console().is_terminal else 160)
err = Console(stderr=True)


def _fmt(v, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def train_diffusion(
    recipe: Path = typer.Argument(..., help="the AR model's recipe, e.g. recipes/smollm2-135m.yaml"),
    out: Path = typer.Option(..., "--out", help="folder for the diffusion LM (save_pretrained + diffusion.json)"),
    minutes: float = typer.Option(15.0, "--minutes", help="wall-clock budget of the training loop"),
    seq_len: int = typer.Option(96, "--seq-len"),
    block: int = typer.Option(32, "--block", help="diffusion block size trained for (= the graph width)"),
    batch: int = typer.Option(4, "--batch"),
    lr: float = typer.Option(2e-4, "--lr"),
    mask_token: str = typer.Option("<empty_output>", "--mask-token", help="an unused special token to use as [MASK]"),
    init: Path | None = typer.Option(None, "--init", help="continue training a diffusion LM saved by an earlier --out"),
    seed: int = typer.Option(0, "--seed", help="which windows and masks are drawn (give a new one with --init)"),
) -> None:
    """Adapt an AR LM into a masked diffusion LM (Dream-style) on stdlib source; report masked accuracy."""
    from toolchain.train.diffusion import DiffusionTrainConfig
    from toolchain.train.diffusion import train_diffusion as run_train

    cfg = DiffusionTrainConfig(seconds=minutes * 60, seq_len=seq_len, block=block, batch=batch, lr=lr, seed=seed,
                               mask_token=mask_token)
    rep = run_train(recipe, out, cfg, log=lambda m: err.print(f"[dim]{m}[/]", highlight=False), init=init)
    b, a = rep["accuracy_before"], rep["accuracy_after"]
    table = Table(title=f"held-out masked-token accuracy ({rep['steps']} steps, {rep['seconds']:.0f} s training)")
    for col in ("mask rate", "acc before", "acc after", "NLL before", "NLL after"):
        table.add_column(col, justify="right")
    for rate in ("0.15", "0.5", "0.9"):
        table.add_row(rate, f"{b['acc@' + rate]:.3f}", f"{a['acc@' + rate]:.3f}", f"{b['nll@' + rate]:.2f}",
                      f"{a['nll@' + rate]:.2f}")
    console.print(table)
    for s in rep["samples"]:
        console.print(f"[bold]prompt[/] {s['prompt']!r} (S={s['steps']} steps per block)\n[bold]->[/] "
                      f"{s['completion']!r}", highlight=False)
    console.print(f"[bold green]diffusion LM[/] {out} ({rep['total_seconds']:.0f} s total); compile it with "
                  "mobc compile recipes/smollm2-135m-diffusion.yaml")


def bench_diffusion(
    artifact: Path = typer.Argument(..., help="artifact compiled from a diffusion LM"),
    configs: str = typer.Option("dllm,fastdllm,llada-off,llada,llada+rev", "--policies",
                                help="comma-separated configurations (toolchain/bench/diffusion.py)"),
    prompts: str = typer.Option("humaneval:4", "--prompts", help="humaneval:N or file:PATH"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    block: int = typer.Option(0, "--block", help="block size (0 = the graph width)"),
    steps: int = typer.Option(8, "--steps", help="LLaDA steps per block"),
    threshold: float = typer.Option(0.9, "--threshold", help="Fast-dLLM confidence threshold"),
    device: str = typer.Option("snapdragon-8-gen-3", "--device"),
    dram: float = typer.Option(1.0, "--dram", help="DRAM budget for the latency column (fraction or bytes)"),
    prefetch_budgets: str = typer.Option("1.0,0.5,0.25", "--prefetch-budgets", help="DRAM budgets for the prefetch table"),
    threads: int | None = typer.Option(None, "--threads"),
    json_out: Path | None = typer.Option(None, "--json"),
) -> None:
    """Compare diffusion decoding policies: calls/token, CPU tok/s, phone latency, agreement; prefetch."""
    from toolchain.bench.decode import load_prompts
    from toolchain.bench.diffusion import bench, prefetch_section
    from toolchain.runtime.model import StepModel

    model = StepModel(artifact, threads=threads)
    names = [c.strip() for c in configs.split(",") if c.strip()]
    res = bench(model, names, load_prompts(prompts), max_new_tokens, block, steps, threshold, device, dram,
                log=lambda m: err.print(f"[dim]{m}[/]"))
    table = Table(title=f"diffusion decode {res['artifact']}: width {res['width']}, block {res['block']}, "
                        f"S={steps}, threshold {threshold}, {res['prompts']} prompts x {max_new_tokens} tokens; "
                        f"phone = {device}, DRAM {dram:g}")
    for col in ("policy", "tokens", "calls/token", "tok/s CPU", "phone ms/token", "agree w/ dllm", "== rule base",
                "spec kept/decided", "revision overlap"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in res["rows"]:
        spec = f"{r['spec_kept']}/{r['spec_decided']}" if "spec_decided" in r else "—"
        rev = (f"{r['revision_overlap']:.0%} ({r['revised']}/{r['provisional']} re-masked)"
               if r.get("revision_overlap") is not None else "—")
        table.add_row(r["policy"], str(r["tokens"]), _fmt(r["calls_per_token"], ".3f"),
                      _fmt(r["tokens_per_s_cpu"], ".1f"), _fmt(r["phone_ms_per_token"], ".2f"),
                      _fmt(r["agreement_with_dllm"], ".1%"), r["equals_rule_baseline"] or "—", spec, rev)
    console.print(table)
    pre = prefetch_section(model, device, [float(b) for b in prefetch_budgets.split(",")])
    res["prefetch"] = pre
    t2 = Table(title=f"weight prefetch, {pre['parts']} parts ({'split artifact' if pre['split_artifact'] else 'modelled split'})"
                     f": predicted phone ms per diffusion call on {device}")
    for col in ("DRAM budget", "streamed parts (serial/prefetch)", "serial ms", "prefetch ms", "speedup"):
        t2.add_column(col, justify="right")
    for p in pre["predicted"]:
        t2.add_row(f"{p['dram_budget']:g}", f"{p['streamed_parts_serial']}/{p['streamed_parts_prefetch']}",
                   f"{p['serial_ms']:.2f}", f"{p['prefetch_ms']:.2f}", _fmt(p["speedup"], ".2f") + "x")
    console.print(t2)
    if pre.get("measured_cpu"):
        t3 = Table(title="part streaming on this CPU (resident parts = the DRAM budget)")
        for col in ("resident parts", "prefetch", "ms/call", "load ms/call", "wait ms/call"):
            t3.add_column(col, justify="right")
        for m in pre["measured_cpu"]:
            t3.add_row(str(m["resident_parts"]), str(m["prefetch"]), f"{m['ms_per_call']:.1f}",
                       f"{m['load_ms_per_call']:.1f}", f"{m['wait_ms_per_call']:.1f}")
        console.print(t3)
    bad = [r["policy"] for r in res["rows"] if r["equals_rule_baseline"] not in (None, f"{res['prompts']}/{res['prompts']}")]
    if bad:
        console.print(f"[red]speculation off differs from its baseline: {', '.join(bad)}[/]")
    if json_out:
        json_out.write_text(json.dumps(res, indent=1))
        console.print(f"wrote {json_out}")


def register(bench_app: typer.Typer, train_app: typer.Typer) -> None:
    train_app.command("diffusion")(train_diffusion)
    bench_app.command("diffusion")(bench_diffusion)
