"""What every command module shares: one console pair, the runtime options, formatting, tables."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from toolchain.errors import MobcError

# tables stay readable when piped to a file or a CI log (rich would wrap them at 80 columns)
console = Console() if sys.stdout.isatty() else Console(width=200)
err = Console(stderr=True)

PROVIDER = typer.Option("cpu", "--provider", help="onnxruntime provider: cpu or qnn")
THREADS = typer.Option(None, "--threads", help="intra-op threads (default: onnxruntime's choice)")
EP_OPTION = typer.Option([], "--ep-option", help="provider option key=value (repeatable), e.g. soc_model=57")


def log(message: str) -> None:
    """Progress of a long command, dim on stderr (stdout keeps the results), printed literally."""
    err.print(Text(message, style="dim"), highlight=False)


def print_error(message: str) -> None:
    """A user error on stderr, printed literally: brackets in a message (a name pattern `^[a-z]*$`,
    a recipe fix `{targets: [q_proj], max_rank: 16}`) are text, never rich markup."""
    err.print(Text.assemble(("error:", "bold red"), " ", message), highlight=False, soft_wrap=True)


def ep_options(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise MobcError(f"--ep-option {item!r}: write key=value")
        out[key] = value
    return out


def open_model(artifact: Path, threads: int | None, provider: str = "cpu", ep: list[str] | None = None):
    """A command's StepModel, its sessions on the process's one thread pool (a draft's and a target's
    sessions take turns: one pool, not one each; toolchain/runtime/sessions.py)."""
    from toolchain.runtime.model import StepModel
    from toolchain.runtime.sessions import share_thread_pool

    share_thread_pool(threads)
    return StepModel(artifact, provider, threads, ep_options(ep or []))


def load_models(artifact: Path, draft: Path | None, provider: str, threads: int | None, ep: list[str]):
    """(target, draft or None) StepModels on one provider, every session on one thread pool."""
    target = open_model(artifact, threads, provider, ep)
    return target, attach_draft(target, draft, provider, threads, ep) if draft else None


def attach_draft(target: Any, draft: Path, provider: str, threads: int | None, ep: list[str]):
    """A draft artifact for `target`: a StepModel, or a draft head's adapter (it reads the target's features)."""
    from toolchain.runtime.model import StepModel

    drafter = StepModel(draft, provider, threads, ep_options(ep))
    if drafter.manifest.model.draft_head is not None:
        from toolchain.runtime.head_draft import HeadDraft

        return HeadDraft(drafter, target)  # reads the target's features as it commits
    return drafter


def load_source(artifact: Path) -> Any:
    """The artifact's source model, loaded offline as the compile did."""
    from toolchain.artifact.manifest import Manifest
    from toolchain.compile.recipe import SourceSpec
    from toolchain.compile.source import load

    manifest = Manifest.load(artifact)
    base = Path(manifest.recipe_file or ".").parent
    return load(SourceSpec(**manifest.source["spec"]), base=base)


def fmt(v: Any, spec: str = ".2f") -> str:
    """A table cell: '—' for a missing value, numbers by `spec`, anything else as text."""
    if v is None:
        return "—"
    return format(v, spec) if isinstance(v, int | float) else str(v)


def print_rows(title: str, rows: list[dict], cols: list[tuple[str, str, str]]) -> None:
    """A table of `rows` (dicts); cols are (header, key, format spec; a trailing x marks a ratio)."""
    t = Table(title=title)
    for head, _, _ in cols:
        t.add_column(head, justify="left" if head in ("policy", "mode", "set", "head") else "right")
    for r in rows:
        cells = []
        for _, key, spec in cols:
            ratio = spec.endswith("x") and r.get(key) is not None
            cells.append(fmt(r.get(key), spec.rstrip("x")) + ("x" if ratio else ""))
        t.add_row(*cells)
    console.print(t)


def write_json(path: Path | None, data: Any) -> None:
    """--json PATH: every number and token of a command's results, for scripts and plots."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))
    console.print(f"wrote {path}")
