"""The `mobc` command line. User errors print one clear message and exit 2 (traceback with --debug)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer
from rich.console import Console

from toolchain.errors import MobcError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Compile Hugging Face LMs into verified NPU step graphs and decode them fast.")
console = Console()
err_console = Console(stderr=True)
_state = {"debug": False}


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="show full tracebacks for errors")) -> None:
    _state["debug"] = debug


class RichReporter:
    """Stage-by-stage progress: a spinner while a stage runs, a check mark and seconds after."""

    def __init__(self) -> None:
        self._status = None

    def start(self, stage: str) -> None:
        self._status = console.status(f"[bold]{stage}[/]...")
        self._status.start()

    def done(self, stage: str, seconds: float, detail: str = "") -> None:
        if self._status is not None:
            self._status.stop()
        extra = f" [dim]{detail}[/]" if detail else ""
        console.print(f"[green]✓[/] {stage}{extra} [dim]({seconds:.1f} s)[/]")

    def note(self, message: str) -> None:
        console.print(f"  [dim]{message}[/]", highlight=False)

    def stop(self) -> None:
        if self._status is not None:
            self._status.stop()


@app.command()
def compile(
    recipe: Path = typer.Argument(..., help="recipe YAML, e.g. recipes/smollm2-135m.yaml"),
    out: Path | None = typer.Option(None, "--out", help="artifact folder (default: the recipe's output)"),
    force: bool = typer.Option(False, "--force", help="replace an existing artifact folder"),
) -> None:
    """Compile a recipe into verified step graphs in exported/<name>/."""
    from toolchain.compile.pipeline import Reporter, compile_recipe

    class _R(RichReporter, Reporter):
        pass

    reporter = _R()
    t = time.perf_counter()
    try:
        result = compile_recipe(recipe, out=out, force=force, reporter=reporter)
    finally:
        reporter.stop()
    v = result.manifest["verification"]
    worst = max(f["worst_max_abs"] for f in v["families"].values())
    console.print(
        f"[bold green]compiled[/] {result.manifest['name']} -> [bold]{result.out_dir}[/] in "
        f"{time.perf_counter() - t:.0f} s; worst |diff| vs transformers {worst:.2e}"
        + (", greedy identical" if v.get("greedy", {}).get("identical") else "")
    )


@app.command()
def inspect(artifact: Path = typer.Argument(..., help="artifact folder written by mobc compile")) -> None:
    """Show an artifact's graphs, I/O, sizes, passes and verification as tables."""
    from toolchain.artifact.manifest import load_manifest
    from toolchain.compile.report import (
        graphs_rows,
        io_rows,
        pass_rows,
        qnn_rows,
        rich_table,
        timing_rows,
        verification_rows,
    )

    m = load_manifest(artifact)
    model = m["model"]
    console.print(f"[bold]{m['name']}[/]  source {m['source']['description']}  ({model['family']}, "
                  f"{model['n_layers']} layers, weights {m['weights']['bytes'] / 1e6:,.1f} MB shared)")
    console.print(rich_table("Graphs", graphs_rows(m)))
    seen_io = set()
    for g in m["graphs"]:
        key = (tuple(i["name"] for i in g["inputs"]), g["role"] == "lm_head")
        if key in seen_io and g["stage"] == 0:
            continue
        seen_io.add(key)
        console.print(rich_table(f"{g['name']}: inputs and outputs", io_rows(g)))
    console.print(rich_table("Verification against transformers", verification_rows(m)))
    greedy = m.get("verification", {}).get("greedy")
    if greedy:
        console.print(f"greedy {greedy['tokens']} tokens: "
                      + ("[green]identical to generate[/]" if greedy["identical"] else "[red]diverges[/]"))
    if m.get("passes"):
        console.print(rich_table("Passes", pass_rows(m)))
    if m.get("qnn"):
        console.print(rich_table("QNN HTP context binaries (emulated HTP vs CPU EP)", qnn_rows(m)))
    for extra in m.get("inspect_tables", []):
        console.print(rich_table(extra["title"], (extra["head"], extra["rows"])))
    console.print(rich_table("Timings", timing_rows(m)))


@app.command()
def verify(artifact: Path = typer.Argument(..., help="artifact folder written by mobc compile")) -> None:
    """Re-run the numeric checks of an artifact against its source model."""
    from toolchain.compile.reverify import reverify

    reporter = RichReporter()
    try:
        ok = reverify(artifact, reporter)
    finally:
        reporter.stop()
    if not ok:
        raise typer.Exit(1)
    console.print(f"[bold green]verified[/] {artifact}")


# `mobc hub compile|profile|calibrate` (toolchain/cli/hub.py; light to import: qai_hub loads on use)
from toolchain.cli.hub import hub_app  # noqa: E402

app.add_typer(hub_app, name="hub")


eval_app = typer.Typer(no_args_is_help=True, help="Evaluate an artifact's graphs.")
app.add_typer(eval_app, name="eval")


@eval_app.command("ppl")
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


# `mobc run`, `mobc bench decode`, `mobc train draft` (toolchain/cli/run.py)
from toolchain.cli.run import bench_app, train_app  # noqa: E402
from toolchain.cli.run import run as _run  # noqa: E402

app.command("run")(_run)
app.add_typer(bench_app, name="bench")
app.add_typer(train_app, name="train")

# `mobc adapter pack|train|verify`; also adds `bench ctg|ds2d` and `train forecast` (toolchain/cli/adapter.py)
from toolchain.cli.adapter import adapter_app  # noqa: E402

app.add_typer(adapter_app, name="adapter")

# `mobc train diffusion`, `mobc bench diffusion` (toolchain/cli/diffusion.py)
from toolchain.cli.diffusion import register as _register_diffusion  # noqa: E402

_register_diffusion(bench_app, train_app)
# `mobc bench lever`, `mobc train predictor` (toolchain/cli/lever.py) register on the same groups
import toolchain.cli.lever  # noqa: E402,F401


@eval_app.command("qnn")
def eval_qnn(
    artifact: Path = typer.Argument(..., help="artifact folder with a quantized/ sub-artifact"),
    tokens: int = typer.Option(64, "--tokens", help="greedy tokens compared HTP vs CPU QDQ"),
    out: Path | None = typer.Option(None, "--out", help="where context binaries go (default quantized/qnn)"),
) -> None:
    """Build QNN HTP context binaries of the quantized graphs and compare them with the CPU QDQ simulation."""
    from toolchain.compile.report import rich_table
    from toolchain.quantize.qnn_check import check_quantized

    q = artifact / "quantized"
    r = check_quantized(q, out or q / "qnn", tokens, log=lambda m: err_console.print(f"[dim]{m}[/]"))
    rows = [[g, f"{v['context_bytes'] / 1e6:,.1f} MB", f"{v['build_seconds']:.1f}", f"{v['worst_max_abs']:.4g}",
             v["worst_output"], f"{(v['argmax_agreement'] or 0) * 100:.1f}%"] for g, v in r["graphs"].items()]
    console.print(rich_table("QNN HTP vs CPU QDQ", (["graph", "context", "build s", "max |diff|", "worst",
                                                     "argmax ="], rows)))
    gr = r["greedy"]
    console.print(f"greedy {gr['tokens']} tokens (lockstep): argmax agreement {gr['argmax_agreement'] * 100:.1f}%, "
                  f"max |logit diff| {gr['logits_max_abs']:.4g}")


@eval_app.command("sensitivity")
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
        base, rows = kl_ablation(artifact, tok, graph, log=lambda m: err_console.print(f"[dim]{m}[/]"))
        console.print(rich_table(f"Quantization error of {graph} by group (logit KL of the QDQ graph {base:.4f}; "
                                 "each row runs one group in float)", ablation_table(rows, top)))
    elif by == "sqnr":
        rows = sensitivity(artifact, tok, graph)
        console.print(rich_table(f"Quantization sensitivity of {graph} (lowest SQNR first)",
                                 sensitivity_table(rows, top)))
    else:
        raise MobcError(f"--by {by!r}: choose sqnr or kl")


def main() -> None:
    try:
        app()
    except MobcError as exc:
        if _state["debug"]:
            raise
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        err_console.print("[red]interrupted[/]")
        sys.exit(130)


if __name__ == "__main__":
    main()
