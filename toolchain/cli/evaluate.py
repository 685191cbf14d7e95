"""`mobc eval ppl|qnn|sensitivity`: quality of quantized graphs against their float originals."""

from __future__ import annotations

from pathlib import Path

import typer

from toolchain.cli.common import console, err
from toolchain.errors import MobcError

app = typer.Typer(no_args_is_help=True, help="Evaluate an artifact's graphs.")


@app.command("ppl")
def eval_ppl(
    artifact: Path = typer.Argument(..., help="artifact folder (its quantized/ graphs are compared if present)"),
    text: Path | None = typer.Option(None, "--text", help="text file (default: held-out stdlib sources)"),
    tokens: int = typer.Option(2048, "--tokens", help="tokens of text to score"),
) -> None:
    """Perplexity of float vs quantized graphs on held-out text, with the relative change."""
    from toolchain.compile.report import rich_table
    from toolchain.quantize.ppl import eval_artifact, ppl_table

    result = eval_artifact(artifact, tokens, text.read_text() if text else None)
    console.print(rich_table(f"Perplexity on {result['tokens']} tokens of {result['text']}", ppl_table(result)))


@app.command("qnn")
def eval_qnn(
    artifact: Path = typer.Argument(..., help="artifact folder with a quantized/ sub-artifact"),
    tokens: int = typer.Option(64, "--tokens", help="greedy tokens compared HTP vs CPU QDQ"),
    out: Path | None = typer.Option(None, "--out", help="where context binaries are built (default: the compile's own in quantized/qnn, checked as they are, or built there if the compile made none)"),
) -> None:
    """Build QNN HTP context binaries of the quantized graphs and compare them with the CPU QDQ simulation."""
    from toolchain.compile.report import rich_table
    from toolchain.quantize.qnn_check import check_quantized

    q = artifact / "quantized"
    r = check_quantized(q, out, tokens, log=lambda m: err.print(f"[dim]{m}[/]"))
    def pct(x: float | None) -> str:
        return "—" if x is None else f"{x * 100:.1f}%"

    rows = []
    for g, v in r["graphs"].items():
        vs_float = v.get("argmax_vs_float") or {}
        excess = v.get("excess_rel_max")
        rows.append([g, f"{v['context_bytes'] / 1e6:,.1f} MB", f"{v['build_seconds']:.1f}", f"{v['worst_max_abs']:.4g}",
                     v["worst_output"], pct(v.get("argmax_vs_cpu", v["argmax_agreement"])),
                     pct(vs_float.get("cpu")), pct(vs_float.get("htp")), "—" if excess is None else f"{excess:.3g}"])
    # the float columns: how often each picks the float graph's token; excess: how much farther from the
    # float graph the HTP's worst output is than the CPU's (share of its magnitude; <= 0 as accurate)
    console.print(rich_table("QNN HTP vs CPU QDQ (2 calls per graph, worst)", (
        ["graph", "context", "build s", "max |diff|", "worst", "argmax = CPU", "CPU = float", "HTP = float",
         "excess vs float"], rows)))
    gr = r["greedy"]
    vs_float = gr.get("argmax_vs_float")
    floats = (f", the float graphs' token: CPU {pct(vs_float['cpu'])}, HTP {pct(vs_float['htp'])}, "
              f"HTP = CPU or float {pct(gr['argmax_kept'])}" if vs_float else "")
    console.print(f"greedy {gr['tokens']} tokens (lockstep): argmax agreement {gr['argmax_agreement'] * 100:.1f}%"
                  f"{floats}, max |logit diff| {gr['logits_max_abs']:.4g}")


@app.command("sensitivity")
def eval_sensitivity(
    artifact: Path = typer.Argument(..., help="artifact folder with a quantized/ sub-artifact"),
    graph: str = typer.Option("decode", "--graph", help="graph to analyse"),
    top: int = typer.Option(15, "--top", help="rows to show"),
    by: str = typer.Option("sqnr", "--by", help="sqnr: worst SQNR per layer block; kl: logit KL removed "
                                                "when a layer or tensor kind runs in float (slower)"),
) -> None:
    """Which tensors dominate the quantization error, per layer block (float vs QDQ)."""
    from transformers import AutoTokenizer

    from toolchain.compile.report import rich_table
    from toolchain.quantize.sensitivity import ablation_table, kl_ablation, sensitivity, sensitivity_table

    tok = AutoTokenizer.from_pretrained(artifact / "tokenizer")
    if by == "kl":
        base, rows = kl_ablation(artifact, tok, graph, log=lambda m: err.print(f"[dim]{m}[/]"))
        console.print(rich_table(f"Quantization error of {graph} by group (logit KL of the QDQ graph {base:.4f}; "
                                 "each row runs one group in float)", ablation_table(rows, top)))
    elif by == "sqnr":
        rows = sensitivity(artifact, tok, graph)
        console.print(rich_table(f"Quantization sensitivity of {graph} (lowest SQNR first)",
                                 sensitivity_table(rows, top)))
    else:
        raise MobcError(f"--by {by!r}: choose sqnr or kl")
