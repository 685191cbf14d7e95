"""CLI of issue 7: `mobc adapter pack|train|verify|qnn`, `mobc train forecast`, `mobc bench ctg|ds2d`.

The bench and train commands attach to runtime_cli's `bench` and `train` groups, so they sit
beside `bench decode` and `train draft`. Registered in toolchain/cli/main.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from toolchain.cli.run import bench_app, train_app
from toolchain.compile.report import rich_table
from toolchain.errors import MobcError

console = Console()
err = Console(stderr=True)
adapter_app = typer.Typer(no_args_is_help=True, help="LoRA adapters for artifacts compiled with lora_inputs.")


def _log(msg: str) -> None:
    err.print(f"[dim]{msg}[/]")


def _source(artifact: Path) -> Any:
    """The artifact's source model, loaded offline as the compile did."""
    from toolchain.artifact.manifest import load_manifest
    from toolchain.compile.recipe import SourceSpec
    from toolchain.compile.source import load

    manifest = load_manifest(artifact)
    base = Path(manifest.get("recipe_file", ".")).parent
    return load(SourceSpec(**manifest["source"]["spec"]), base=base)


@adapter_app.command("pack")
def pack_cmd(
    artifact: Path = typer.Argument(..., help="artifact folder compiled with the lora_inputs pass"),
    peft_dir: Path = typer.Argument(..., help="PEFT adapter folder (adapter_config.json + adapter_model.safetensors)"),
    name: str | None = typer.Option(None, "--name", help="adapter name (default: the folder name)"),
) -> None:
    """Turn a PEFT LoRA folder into the artifact's adapter input tensors (no recompile)."""
    from toolchain.lora.adapters import pack

    out, ad = pack(artifact, peft_dir, name)
    console.print(f"[bold green]packed[/] {ad.name}: rank {ad.rank}, {len(ad.weights)} projections "
                  f"({', '.join(ad.meta['targets'])}) -> {out}; use it with `mobc run {artifact} --adapter {ad.name}`")


@adapter_app.command("train")
def train_cmd(
    artifact: Path = typer.Argument(..., help="artifact folder (its source model is the base)"),
    out: Path = typer.Option(..., "--out", help="folder for the PEFT adapter"),
    text: str = typer.Option("textwrap", "--text", help="standard-library module name or a text file"),
    steps: int = typer.Option(12, "--steps"),
    rank: int = typer.Option(8, "--rank"),
    targets: str = typer.Option("q_proj,v_proj", "--targets"),
    lr: float = typer.Option(5e-3, "--lr"),
    seq_len: int = typer.Option(64, "--seq-len"),
) -> None:
    """Make a real PEFT LoRA adapter: a few fine-tuning steps on real text with PEFT itself."""
    from toolchain.train.lora import LoraTrainConfig, stdlib_text, train_lora

    lm = _source(artifact)
    cfg = LoraTrainConfig(rank=rank, alpha=2.0 * rank, targets=tuple(targets.split(",")), steps=steps, lr=lr,
                          seq_len=seq_len)
    r = train_lora(lm.model, lm.tokenizer, stdlib_text(text), out, cfg, log=_log)
    console.print(f"[bold green]trained[/] {out}: loss {r['loss_first']:.3f} -> {r['loss_last']:.3f} in "
                  f"{r['steps']} steps ({r['seconds']:.0f} s)")


@adapter_app.command("verify")
def verify_cmd(
    artifact: Path = typer.Argument(..., help="artifact folder"),
    adapters: list[str] = typer.Argument(..., help="packed adapter names (their PEFT folders are re-read)"),
    tokens: int = typer.Option(32, "--tokens", help="tokens of real text to compare logits on"),
    greedy: int = typer.Option(16, "--greedy", help="greedy tokens to compare with PEFT's generate"),
    json_out: Path | None = typer.Option(None, "--json"),
) -> None:
    """Artifact + adapter vs the PEFT model and the merged model: logits diffs and greedy tokens."""
    from toolchain.lora.verify import verify_adapters

    res = verify_adapters(artifact, adapters, _source(artifact), tokens, greedy, log=_log)
    head = ["adapter", "rank", "|art-peft|", "|art-merged|", "|peft-merged|", "|peft-base| (effect)",
            "|art0-base|", f"greedy {greedy} == peft"]
    body = [[r["adapter"], str(r["rank"]), f"{r['artifact_vs_peft']:.2e}", f"{r['artifact_vs_merged']:.2e}",
             f"{r['peft_vs_merged']:.2e}", f"{r['peft_vs_base']:.3f}", f"{r['zero_vs_base']:.2e}",
             str(r["greedy_identical"])] for r in res["rows"]]
    title = f"{res['artifact']}: adapters vs PEFT on {res['tokens']} tokens of real text"
    console.print(rich_table(title, (head, body), numeric=True))
    if json_out:
        json_out.write_text(json.dumps(res, indent=1))


@adapter_app.command("qnn")
def qnn_cmd(
    artifact: Path = typer.Argument(..., help="artifact compiled with lora_inputs and a qnn: section"),
    adapters: list[str] = typer.Argument(..., help="packed adapter names (the zero adapter is always run)"),
    tokens: int = typer.Option(16, "--tokens", help="greedy tokens per request"),
    ctg_steps: int = typer.Option(4, "--ctg-steps", help="CTG steps mixing the adapters per row (0: none)"),
) -> None:
    """Adapters bound to the artifact's QNN HTP context binaries vs the CPU EP, call by call (no recompile)."""
    from toolchain.lora.qnn_check import RESULT_FILE, check_adapters

    res = check_adapters(artifact, adapters, tokens, ctg_steps, log=_log)
    head = ["run", "calls", "rows", "max |logits diff|", "median", "max |KV diff|", "argmax =", "effect", "HTP s"]
    body = []
    runs = [(r["adapter"], r) for r in res["requests"]]
    if res["ctg"]:
        runs.append((f"ctg {'/'.join(res['ctg']['styles'])}", res["ctg"]))
    for name, r in runs:
        effect = r.get("adapter_effect_max_abs")  # max |logits(adapter) - logits(base)| on the CPU
        body.append([
            name,
            str(r["calls"]),
            str(r["rows"]),
            f"{r['logits_max_abs']:.4g}",
            f"{r['logits_median_abs']:.4g}",
            f"{r['kv_max_abs']:.4g}",
            f"{r['argmax_agreement'] * 100:.1f}%",
            "—" if effect is None else f"{effect:.3f}",
            f"{r['htp_seconds']:.0f}",
        ])
    console.print(rich_table(f"{res['artifact']}: emulated HTP vs CPU EP, same inputs per call", (head, body),
                             numeric=True))
    console.print(f"[dim]records: {artifact / 'qnn' / RESULT_FILE}[/]")


@train_app.command("forecast")
def train_forecast_cmd(
    artifact: Path = typer.Argument(..., help="artifact folder compiled with forecast_inputs"),
    minutes: float = typer.Option(3.0, "--minutes", help="wall-clock budget of the training loop"),
    seq_len: int = typer.Option(128, "--seq-len"),
    anchors: int = typer.Option(32, "--anchors", help="forecast sets per training sequence"),
    lr: float = typer.Option(1e-2, "--lr"),
    out: Path | None = typer.Option(None, "--out", help="default: ARTIFACT/forecast.npz"),
    resume: bool = typer.Option(False, "--resume", help="start from the embeddings already at --out"),
) -> None:
    """Prefix-tune DS2D's forecast embeddings on stdlib source with the base model frozen."""
    from toolchain.artifact.manifest import load_manifest
    from toolchain.runtime.policies.ds2d import FORECAST_FILE
    from toolchain.train.forecast import ForecastConfig, save_forecast, train_forecast

    manifest = load_manifest(artifact)
    shapes = [i["shape"] for g in manifest["graphs"] for i in g["inputs"] if i["name"] == "forecast_embeds"]
    if not shapes:
        raise MobcError(f"{artifact} has no forecast_embeds input; add `- forecast_inputs: {{m: 3}}` to the "
                        "recipe's passes and recompile")
    path = out or artifact / FORECAST_FILE
    init = None
    if resume:
        from toolchain.runtime.policies.ds2d import load_forecast

        init = load_forecast(artifact, path)
    lm = _source(artifact)
    cfg = ForecastConfig(seconds=minutes * 60, seq_len=seq_len, anchors=anchors, lr=lr)
    embeds, report = train_forecast(lm.model, lm.tokenizer, shapes[0][0], cfg, log=_log, init=init)
    save_forecast(path, embeds, report)
    console.print(f"[bold green]forecast[/] {path}: m={report['m']}, {report['steps']} steps in {report['seconds']:.0f} s; "
                  f"top-1 per slot {report['accuracy_before']} -> {report['accuracy_after']} (held-out os.py)")


@bench_app.command("ctg")
def bench_ctg_cmd(
    artifact: Path = typer.Argument(..., help="artifact compiled with lora_inputs (slots >= K) and a width >= K graph"),
    adapter: list[str] = typer.Option([], "--adapter", help="packed adapter per style (repeatable; 'base' = none)"),
    k: int = typer.Option(8, "-k", help="styles (cycles through --adapter when fewer are given)"),
    prompts: str = typer.Option("humaneval:4", "--prompts", help="humaneval:N or file:PATH"),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="per style"),
    threads: int | None = typer.Option(None, "--threads"),
    json_out: Path | None = typer.Option(None, "--json"),
) -> None:
    """K styles decoded concurrently (one call per step) vs K sequential runs: tokens/s and ratio."""
    from toolchain.bench.decode import load_prompts
    from toolchain.bench.lora import bench_ctg
    from toolchain.lora.adapters import resolve_adapter
    from toolchain.runtime.model import StepModel

    model = StepModel(artifact, threads=threads)
    pool = [None if a == "base" else resolve_adapter(artifact, a) for a in adapter] or [None]
    styles = [pool[i % len(pool)] for i in range(k)]
    res = bench_ctg(model, styles, load_prompts(prompts), max_new_tokens, log=_log)
    table = Table(title=f"ctg {res['artifact']}: K={k} styles ({', '.join(res['styles'])}) on {res['prompts']} prompts")
    for col in ("mode", "tokens", "decode tok/s", "calls", "ratio (decode)", "ratio (end to end)", "phone ms/token",
                "== sequential"):
        table.add_column(col, justify="right" if col != "mode" else "left")
    rows = res["rows"]
    table.add_row(f"{k} sequential", str(sum(r["seq_tokens"] for r in rows)), f"{res['sequential_tokens_per_s']:.1f}",
                  str(sum(r["seq_tokens"] for r in rows)), "1.00x", "1.00x",
                  f"{res['phone_ms_per_token_sequential']:.2f}", "—")
    table.add_row(f"ctg K={k}", str(sum(r["ctg_tokens"] for r in rows)), f"{res['ctg_tokens_per_s']:.1f}",
                  str(sum(r["ctg_calls"] for r in rows)), f"{res['ratio_decode']:.2f}x", f"{res['ratio_end_to_end']:.2f}x",
                  f"{res['phone_ms_per_token_ctg']:.2f}", f"{res['identical_styles']}/{res['total_styles']}")
    console.print(table)
    if json_out:
        json_out.write_text(json.dumps(res, indent=1))


@bench_app.command("ds2d")
def bench_ds2d_cmd(
    artifact: Path = typer.Argument(..., help="artifact compiled with forecast_inputs, trained forecast.npz"),
    prompts: str = typer.Option("humaneval:8", "--prompts", help="humaneval:N or file:PATH"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    forecast: Path | None = typer.Option(None, "--forecast", help="default: ARTIFACT/forecast.npz"),
    depth: int | None = typer.Option(None, "--depth", help="drafts per round (default m)"),
    threads: int | None = typer.Option(None, "--threads"),
    json_out: Path | None = typer.Option(None, "--json"),
) -> None:
    """DS2D vs greedy AR: acceptance length, tokens per call, decode speed, token-for-token equality."""
    from toolchain.bench.decode import load_prompts
    from toolchain.bench.lora import bench_ds2d
    from toolchain.runtime.model import StepModel
    from toolchain.runtime.policies.ds2d import load_forecast

    model = StepModel(artifact, threads=threads)
    res = bench_ds2d(model, load_forecast(artifact, forecast), load_prompts(prompts), max_new_tokens, depth, log=_log)
    table = Table(title=f"ds2d {res['artifact']} (m={res['m']}) on {res['prompts']} prompts, greedy")
    for col in ("policy", "decode tok/s", "accepted/round", "tokens/call", "speedup CPU", "phone ms/token", "== ar"):
        table.add_column(col, justify="right" if col != "policy" else "left")
    table.add_row("ar", f"{res['ar_tokens_per_s']:.1f}", "—", "1.00", "1.00x", f"{res['phone_ms_per_token_ar']:.2f}", "—")
    table.add_row("ds2d", f"{res['ds2d_tokens_per_s']:.1f}", f"{res['accepted_per_round']:.2f}",
                  f"{res['tokens_per_call']:.2f}", f"{res['speedup']:.2f}x", f"{res['phone_ms_per_token_ds2d']:.2f}",
                  f"{res['identical']}/{res['prompts']}")
    console.print(table)
    if json_out:
        json_out.write_text(json.dumps(res, indent=1))


def policy_options(model: Any, policy: str, adapters: list[str], forecast: Path | None) -> dict[str, Any]:
    """`mobc run` options of issue 7: ctg gets its styles; other policies get the adapter bound to every row."""
    from toolchain.lora.adapters import resolve_adapter
    from toolchain.runtime.policies.ctg import bind_adapters
    from toolchain.runtime.policies.ds2d import load_forecast

    loaded = [None if a == "base" else resolve_adapter(model.folder, a) for a in adapters]
    if policy == "ctg":
        if len(loaded) < 2:
            raise MobcError("--policy ctg decodes several styles: pass --adapter once per style (at least 2)")
        return {"styles": loaded}
    if len(loaded) > 1:
        raise MobcError(f"--policy {policy} runs one adapter per request; pass --adapter once (or use --policy ctg)")
    if loaded:
        bind_adapters(model, [a for a in loaded if a is not None], 0 if loaded[0] is not None else None)
    if policy == "ds2d":
        return {"forecast": load_forecast(model.folder, forecast)}
    return {}


def print_styles(pol: Any, ids: list[int], prompt: str, max_new_tokens: int, sampler: Any) -> None:
    import time

    t = time.perf_counter()
    list(pol.generate(ids, max_new_tokens, sampler))
    wall = time.perf_counter() - t
    tok = pol.target.tokenizer
    for style, out in zip(pol.styles, pol.outputs, strict=True):
        console.rule(f"style {style.name if style else 'base'}")
        console.print(prompt + tok.decode(out, skip_special_tokens=True), markup=False, highlight=False)
    s = pol.stats
    err.print(f"[dim]{len(pol.styles)} styles, {s.tokens} tokens in {s.n_target_calls} calls, "
              f"{s.tokens / max(wall - s.prefill_seconds, 1e-9):.1f} tok/s decode[/]")
