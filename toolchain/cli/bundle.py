"""`mobc bundle genai|verify`: an artifact as an onnxruntime-genai decoder-pipeline bundle, and
the proof that onnxruntime-genai itself generates what `mobc run` generates from it."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from toolchain.cli.common import console, log

app = typer.Typer(no_args_is_help=True,
                  help="Deployable bundles: artifacts that onnxruntime-genai (and so phone apps) load as they are.")


def _gb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


@app.command("genai")
def genai(
    artifact: Path = typer.Argument(..., help="artifact folder written by mobc compile (decode + prefill graphs)"),
    out: Path = typer.Option(None, "--out", help="bundle folder (default: ARTIFACT-genai beside the artifact)"),
    target: str = typer.Option("cpu", "--target", help="cpu, or qnn (EPContext stages over the artifact's HTP binaries)"),
    force: bool = typer.Option(False, "--force", help="replace an existing bundle (only a mobc bundle or an empty folder)"),
    check: bool = typer.Option(True, "--check/--no-check", help="check the written bundle's structure"),
) -> None:
    """Write ARTIFACT as an onnxruntime-genai decoder-pipeline bundle (weights hard-linked, not copied)."""
    from toolchain.bundle.genai import write_bundle

    summary = write_bundle(artifact, out, target, force)
    table = Table(title=f"onnxruntime-genai pipeline ({target}; prompts in windows of {summary.prompt_width}, "
                        f"context {summary.context})")
    for col in ("#", "stage", "file", "runs on"):
        table.add_column(col)
    for i, s in enumerate(summary.stages, 1):
        table.add_row(str(i), s["name"], s["file"], "prompt" if s["prompt"] else "generated tokens")
    console.print(table)
    if check:
        _print_structure(summary.folder)
    for note in summary.notes:
        log(note)
    console.print(f"wrote {summary.folder}: {_gb(summary.written_bytes)} of new stages, "
                  f"{_gb(summary.linked_bytes)} hard-linked from the artifact"
                  + (f", {_gb(summary.copied_bytes)} copied" if summary.copied_bytes else ""),
                  markup=False, highlight=False)


def _print_structure(bundle: Path) -> None:
    from toolchain.bundle.genai_check import check_structure
    from toolchain.errors import ArtifactError

    rows = check_structure(bundle)
    bad = [r for r in rows if r.problem]
    if bad:
        raise ArtifactError(f"{bundle}: " + "; ".join(f"{r.name}: {r.problem}" for r in bad))
    kinds = {k: sum(r.kind == k for r in rows) for k in ("small", "graph", "epcontext")}
    console.print(f"structure: {len(rows)} stages in pipeline order, each file's inputs and outputs as the config "
                  f"lists them ({kinds['graph']} step-graph stages, {kinds['epcontext']} EPContext stages with "
                  f"their binaries, {kinds['small']} position/KV stages)", markup=False, highlight=False)


@app.command("verify")
def verify(
    bundle: Path = typer.Argument(..., help="bundle folder written by mobc bundle genai"),
    artifact: Path = typer.Option(None, "--artifact", help="artifact to compare with (default: the one it was written from)"),
    prompts: str = typer.Option("humaneval:5", "--prompts", help="humaneval:N or file:PATH"),
    tokens: int = typer.Option(32, "--tokens", min=1, help="greedy tokens per prompt"),
    threads: int = typer.Option(None, "--threads", help="mobc's intra-op threads (default: onnxruntime's choice)"),
) -> None:
    """Generate greedily with onnxruntime-genai over BUNDLE and with mobc over its artifact; the tokens
    must be identical (a --target qnn bundle runs its HTP binaries through the QNN EP: fp16, so
    its agreement with the CPU is reported). Prints decode tokens/s of both, prompt by prompt."""
    from toolchain.bench.prompts import prompt_ids
    from toolchain.bundle.genai import load_marker
    from toolchain.bundle.genai_run import BundleMismatchError, verify_bundle
    from toolchain.runtime.tokenizer import Tokenizer

    marker = load_marker(bundle)
    art = Path(artifact or marker["artifact"])
    tok = Tokenizer(art / "tokenizer")
    ids = prompt_ids(tok, prompts)
    check = verify_bundle(bundle, ids, tokens, art, threads, progress=log)
    table = Table(title=f"onnxruntime-genai over {bundle} vs mobc run over {art} (greedy, {tokens} tokens)")
    for col in ("prompt", "prompt tokens", "same tokens", "genai tok/s", "mobc tok/s", "genai prompt s", "mobc prompt s"):
        table.add_column(col, justify="right")
    for i, r in enumerate(check.results, 1):
        same = "yes" if r.identical else f"no (from token {r.first_difference})"
        table.add_row(str(i), str(r.prompt_tokens), same, f"{r.genai.decode_tps:.1f}", f"{r.mobc.decode_tps:.1f}",
                      f"{r.genai.prompt_seconds:.3f}", f"{r.mobc.prompt_seconds:.3f}")
    console.print(table)
    s = check.summary()
    console.print(f"median decode: genai {s['genai_decode_tps']:.1f} tok/s, mobc {s['mobc_decode_tps']:.1f} tok/s "
                  f"(genai/mobc {s['genai_over_mobc']:.2f}x); identical on {s['identical_prompts']}/{s['prompts']} prompts",
                  markup=False, highlight=False)
    if marker["target"] == "qnn":
        # HTP context binaries compute in fp16, the CPU reference in fp32: agreement is reported
        console.print(f"qnn bundle: onnxruntime-genai ran the HTP context binaries (QNN EP), mobc the float graphs "
                      f"on the CPU; greedy agreement before the first difference {s['agreement']:.1%}",
                      markup=False, highlight=False)
    elif not check.identical:
        raise BundleMismatchError(
            f"onnxruntime-genai generated other tokens than mobc on {s['prompts'] - s['identical_prompts']} of "
            f"{s['prompts']} prompts; the bundle does not reproduce the artifact: write it again with "
            "`mobc bundle genai --force` and report the bundle's genai_config.json if it persists")
