"""`mobc compile|inspect|verify`: make an artifact from a recipe, look at it, check it again."""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.markup import escape

from toolchain.cli.common import console


class RichReporter:
    """Stage-by-stage progress: a spinner while a stage runs, a check mark and seconds after."""

    def __init__(self) -> None:
        self._status = None

    def start(self, stage: str) -> None:
        self._status = console.status(f"[bold]{escape(stage)}[/]...")
        self._status.start()

    def done(self, stage: str, seconds: float, detail: str = "") -> None:
        if self._status is not None:
            self._status.stop()
        extra = f" [dim]{escape(detail)}[/]" if detail else ""
        console.print(f"[green]✓[/] {escape(stage)}{extra} [dim]({seconds:.1f} s)[/]")

    def note(self, message: str) -> None:
        console.print(f"  [dim]{escape(message)}[/]", highlight=False)

    def stop(self) -> None:
        if self._status is not None:
            self._status.stop()


def compile_cmd(
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
    v = result.manifest.verification or {"families": {}}
    if "head" in v:
        h = v["head"]
        console.print(
            f"[bold green]compiled[/] draft head {result.manifest.name} -> [bold]{escape(str(result.out_dir))}[/] in "
            f"{time.perf_counter() - t:.0f} s; {h['rows']} decoded rows vs its torch module: max |logits diff| "
            f"{h['max_abs_logits']:.2e}, max relative |hidden diff| {h['max_rel_hidden']:.2e}, "
            f"argmax identical on {h['argmax_identical']}/{h['rows']}")
        return
    worst = max((f["worst_max_abs"] for f in v["families"].values()), default=0.0)
    console.print(
        f"[bold green]compiled[/] {result.manifest.name} -> [bold]{escape(str(result.out_dir))}[/] in "
        f"{time.perf_counter() - t:.0f} s; worst |diff| vs transformers {worst:.2e}"
        + (", greedy identical" if v.get("greedy", {}).get("identical") else "")
    )


def inspect(artifact: Path = typer.Argument(..., help="artifact folder written by mobc compile")) -> None:
    """Show an artifact's graphs, I/O, sizes, passes and verification as tables."""
    from toolchain.artifact import integrity
    from toolchain.artifact.manifest import Manifest
    from toolchain.compile.report import (
        graphs_rows,
        io_rows,
        lockstep_line,
        pass_rows,
        qnn_rows,
        rich_table,
        timing_rows,
        verification_rows,
    )

    m = Manifest.load(artifact, check_files=False)
    damaged = integrity.damaged_files(artifact, m)  # shown, then an error: inspect is how users look at it
    if damaged:
        console.print(f"[bold red]warning:[/] {escape('; '.join(damaged))}: the records below describe the "
                      "files as compiled, not as they are now")
    console.print(f"[bold]{m.name}[/]  source {escape(str(m.source['description']))}  ({m.model.family}, "
                  f"{m.model.n_layers} layers, weights {m.weights['bytes'] / 1e6:,.1f} MB shared)")
    console.print(rich_table("Graphs", graphs_rows(m)))
    seen_io = set()
    for g in m.graphs:
        key = (tuple(g.input_names), g.role == "lm_head")
        if key in seen_io and g.stage == 0:
            continue
        seen_io.add(key)
        console.print(rich_table(f"{g.name}: inputs and outputs", io_rows(g)))
    if (m.verification or {}).get("families"):  # a draft head's check against its module is a section below
        console.print(rich_table("Verification against transformers", verification_rows(m)))
    greedy = (m.verification or {}).get("greedy")
    if greedy:
        if damaged:
            console.print(f"greedy {greedy['tokens']} tokens: [yellow]recorded at compile; files changed since, "
                          "so this no longer holds[/]")
        else:
            console.print(f"greedy {greedy['tokens']} tokens: "
                          + ("[green]identical to generate[/]" if greedy["identical"] else "[red]diverges[/]"))
    if m.passes:
        console.print(rich_table("Passes", pass_rows(m.passes)))
    if m.qnn:
        console.print(rich_table("QNN HTP context binaries (emulated HTP vs CPU EP)", qnn_rows(m)))
        if line := lockstep_line(m):
            console.print(line)
    for extra in m.inspect_tables:
        console.print(rich_table(extra["title"], (extra["head"], extra["rows"])))
    console.print(rich_table("Timings", timing_rows(m)))
    if damaged:
        integrity.check_files(artifact, m)  # exit 2 with the damaged files and the fix


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
    console.print(f"[bold green]verified[/] {escape(str(artifact))}")
