"""`mobc adapter pack|train|verify|qnn`: PEFT LoRA adapters bound to a compiled artifact."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape

from toolchain.cli.common import console, load_source, log, write_json
from toolchain.compile.report import rich_table

app = typer.Typer(no_args_is_help=True, help="LoRA adapters for artifacts compiled with lora_inputs.")


@app.command("pack")
def pack_cmd(
    artifact: Path = typer.Argument(..., help="artifact folder compiled with the lora_inputs pass"),
    peft_dir: Path = typer.Argument(..., help="PEFT adapter folder (adapter_config.json + adapter_model.safetensors)"),
    name: str | None = typer.Option(None, "--name", help="adapter name (default: the folder name)"),
) -> None:
    """Turn a PEFT LoRA folder into the artifact's adapter input tensors (no recompile)."""
    from toolchain.lora.pack import pack

    out, ad = pack(artifact, peft_dir, name)
    console.print(f"[bold green]packed[/] {ad.name}: rank {ad.rank}, {len(ad.weights)} projections "
                  f"({', '.join(ad.meta['targets'])}) -> {escape(str(out))}; use it with "
                  f"`mobc run {escape(str(artifact))} --adapter {ad.name}`")


@app.command("train")
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
    from toolchain.train.corpus import module_text
    from toolchain.train.lora import LoraTrainConfig, train_lora

    lm = load_source(artifact)
    cfg = LoraTrainConfig(rank=rank, alpha=2.0 * rank, targets=tuple(targets.split(",")), steps=steps, lr=lr,
                          seq_len=seq_len)
    r = train_lora(lm.model, lm.tokenizer, module_text(text), out, cfg, log=log)
    console.print(f"[bold green]trained[/] {out}: loss {r['loss_first']:.3f} -> {r['loss_last']:.3f} in "
                  f"{r['steps']} steps ({r['seconds']:.0f} s)")


@app.command("verify")
def verify_cmd(
    artifact: Path = typer.Argument(..., help="artifact folder"),
    adapters: list[str] = typer.Argument(..., help="packed adapter names (their PEFT folders are re-read)"),
    tokens: int = typer.Option(32, "--tokens", help="tokens of real text to compare logits on"),
    greedy: int = typer.Option(16, "--greedy", help="greedy tokens to compare with PEFT's generate"),
    json_out: Path | None = typer.Option(None, "--json"),
) -> None:
    """Artifact + adapter vs the PEFT model and the merged model: logits diffs and greedy tokens."""
    from toolchain.lora.verify import verify_adapters

    res = verify_adapters(artifact, adapters, load_source(artifact), tokens, greedy, log=log)
    head = ["adapter", "rank", "|art-peft|", "|art-merged|", "|peft-merged|", "|peft-base| (effect)",
            "|art0-base|", f"greedy {greedy} == peft"]
    body = [[r["adapter"], str(r["rank"]), f"{r['artifact_vs_peft']:.2e}", f"{r['artifact_vs_merged']:.2e}",
             f"{r['peft_vs_merged']:.2e}", f"{r['peft_vs_base']:.3f}", f"{r['zero_vs_base']:.2e}",
             str(r["greedy_identical"])] for r in res["rows"]]
    title = f"{res['artifact']}: adapters vs PEFT on {res['tokens']} tokens of real text"
    console.print(rich_table(title, (head, body), numeric=True))
    write_json(json_out, res)


@app.command("qnn")
def qnn_cmd(
    artifact: Path = typer.Argument(..., help="artifact compiled with lora_inputs and a qnn: section"),
    adapters: list[str] = typer.Argument(..., help="packed adapter names (the zero adapter is always run)"),
    tokens: int = typer.Option(16, "--tokens", help="greedy tokens per request"),
    ctg_steps: int = typer.Option(4, "--ctg-steps", help="CTG steps mixing the adapters per row (0: none)"),
) -> None:
    """Adapters bound to the artifact's QNN HTP context binaries vs the CPU EP, call by call (no recompile)."""
    from toolchain.lora.qnn_check import RESULT_FILE, check_adapters

    res = check_adapters(artifact, adapters, tokens, ctg_steps, log=log)
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
