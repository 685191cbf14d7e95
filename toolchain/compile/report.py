"""Human-readable views of a manifest: the same tables as report.md and as rich tables (inspect)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from toolchain.artifact.manifest import GraphRecord, IOSpec, Manifest

Rows = tuple[list[str], list[list[str]]]


def _mb(n: int | float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _shape(spec: IOSpec) -> str:
    return "[" + ",".join(str(d) for d in spec.shape) + "]"


def graphs_rows(m: Manifest) -> Rows:
    head = ["graph", "family", "role", "stage", "N", "CL", "inputs", "outputs", "nodes", "weights", ".onnx"]
    rows = [[g.name, g.family, g.role, str(g.stage), str(g.width), str(g.context), str(len(g.inputs)),
             str(len(g.outputs)), str(g.nodes), _mb(g.weight_bytes), _mb(g.onnx_bytes)] for g in m.graphs]
    return head, rows


def io_rows(graph: GraphRecord, limit: int = 8) -> Rows:
    """Inputs/outputs, with the per-layer K/V tensors folded into one line each."""
    head = ["direction", "name", "shape", "dtype"]
    rows: list[list[str]] = []
    for direction in ("inputs", "outputs"):
        specs: list[IOSpec] = getattr(graph, direction)
        per_layer = [s for s in specs if s.name.rsplit("_", 1)[-1].isdigit()]
        others = [s for s in specs if s not in per_layer]
        for s in others:
            rows.append([direction[:-1], s.name, _shape(s), s.dtype])
        groups: dict[str, list[IOSpec]] = {}
        for s in per_layer:
            groups.setdefault(s.name.rsplit("_", 1)[0], []).append(s)
        for stem, items in groups.items():
            first, last = items[0].name.rsplit("_", 1)[1], items[-1].name.rsplit("_", 1)[1]
            label = items[0].name if len(items) == 1 else f"{stem}_{{{first}..{last}}}"
            rows.append([direction[:-1], label, _shape(items[0]), items[0].dtype])
    return head, rows[: limit * 4]


def verification_rows(m: Manifest) -> Rows:
    v = m.verification or {}
    head = ["family", "max |logits diff|", "max |KV diff|", "argmax agree", "past rows", "within tolerance"]
    tol = v.get("tolerance", 0)
    rows = [[fam, f"{f['logits_max_abs']:.2e}", f"{f['kv_max_abs']:.2e}", f"{f['argmax_agree']:.0%}",
             str(f["past_len"]), "yes" if f["worst_max_abs"] <= tol else "NO"]
            for fam, f in v.get("families", {}).items()]
    return head, rows


def ops_delta(before: dict[str, int], after: dict[str, int], limit: int = 6) -> str:
    """'MatMul 210->0, Conv 0->210': the op types a pass changed, largest change first."""
    changes = []
    for op in sorted(set(before) | set(after)):
        a, b = before.get(op, 0), after.get(op, 0)
        if a != b:
            changes.append((abs(b - a), f"{op} {a}->{b}"))
    changes.sort(key=lambda c: -c[0])
    text = ", ".join(c for _, c in changes[:limit])
    return (text + (f" (+{len(changes) - limit} more)" if len(changes) > limit else "")) or "-"


def pass_rows(rows_in: list[dict[str, Any]]) -> Rows:
    """One row per pass (rows as toolchain.compile.pass_runner.run_passes records them)."""
    head = ["pass", "graphs", "nodes", "weights MB", "max |diff|", "worst output", "s", "ops changed"]
    rows = []
    for r in rows_in:
        worst = r["worst"]
        rows.append([r["pass"], str(len(r["graphs_after"])), f"{r['nodes_before']}->{r['nodes_after']}",
                     f"{r['weight_bytes_before'] / 1e6:.1f}->{r['weight_bytes_after'] / 1e6:.1f}",
                     f"{worst['diff']:.2e}", f"{worst['family']}.{worst['output']}", f"{r['seconds']:.2f}",
                     ops_delta(r["ops_before"], r["ops_after"])])
    return head, rows


def qnn_rows(m: Manifest) -> Rows:
    head = ["graph", "status", "context binary", "build s", "max |diff| vs CPU", "worst output",
            "max rel (K/V, hidden)", "argmax agree"]
    rows = []
    for r in m.qnn or []:
        v = r.get("verify") or {}
        agree = v.get("argmax_agreement")
        if isinstance(agree, dict):  # per output: the logits' top-1 agreement
            agree = min(agree.values()) if agree else None
        rel = [x for k, x in (v.get("max_rel") or {}).items() if not k.startswith("logits")]
        rows.append([r["graph"], r["status"], _mb(r.get("bytes", 0)) if "bytes" in r else r.get("reason", ""),
                     f"{r.get('build_seconds', 0):.1f}", f"{v['worst_max_abs']:.3g}" if v else "-",
                     v.get("worst_output", "-"), f"{max(rel):.2g}" if rel else "-",
                     f"{agree:.0%}" if isinstance(agree, float) else "-"])
    return head, rows


def lockstep_line(m: Manifest) -> str | None:
    """The qnn: gate's greedy lockstep run, in one sentence."""
    g = m.qnn_lockstep
    if not g:
        return None
    vs_float = g.get("argmax_vs_float")
    floats = (f"; the float graphs' token picked by the CPU on {vs_float['cpu']:.0%}, by the HTP on {vs_float['htp']:.0%}"
              if vs_float else "")
    return (f"Greedy lockstep through the HTP decode binaries: {g['tokens']} tokens after a {g['prompt_tokens']}-token "
            f"prompt, the CPU's token kept on {g['argmax_agreement']:.0%} of steps{floats}, max |logit diff| "
            f"{g['logits_max_abs']:.3g} ({g['seconds']:.0f} s emulated).")


def timing_rows(m: Manifest) -> Rows:
    return ["stage", "seconds"], [[k, f"{v:.2f}"] for k, v in m.timings.items()]


def rich_table(title: str, rows: Rows, numeric: bool = False) -> Table:
    """numeric: every column after the first holds numbers (right-justified)."""
    head, body = rows
    table = Table(title=title, title_justify="left")
    for i, h in enumerate(head):
        table.add_column(h, justify="right" if numeric and i else "left")
    for r in body:
        table.add_row(*r)
    return table


def markdown_table(rows: Rows) -> str:
    head, body = rows
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in body]
    return "\n".join(lines)


def write_report(folder: Path, m: Manifest) -> None:
    v = m.verification or {}
    model = m.model
    parts = [
        f"# {m.name}",
        "",
        f"Source: `{m.source['description']}` ({model.family}, {model.n_layers} layers, "
        f"{model.n_heads} heads / {model.n_kv} KV heads, head_dim {model.head_dim}, "
        f"vocab {model.vocab}). Weights: {_mb(m.weights['bytes'])} in `{m.weights['file']}` "
        f"({_mb(m.weights['bytes_saved_by_sharing'])} saved by sharing across graphs).",
        "",
        "## Graphs",
        "",
        markdown_table(graphs_rows(m)),
    ]
    if v.get("families"):  # a draft head is verified against its torch module instead (its own section)
        parts += ["", "## Verification against transformers", "", f"Tolerance: max |diff| <= {v.get('tolerance')}.",
                  "", markdown_table(verification_rows(m))]
    g = v.get("greedy")
    if g:
        parts += ["", f"Greedy decoding, {g['tokens']} tokens through `{g['decode_family']}`: "
                  + ("identical to transformers' generate." if g["identical"] else
                     f"DIVERGES at token {g['first_mismatch']}.")]
    if m.passes:
        parts += ["", "## Passes", "", markdown_table(pass_rows(m.passes))]
    if m.qnn:
        parts += ["", "## QNN HTP context binaries (emulated HTP vs CPU EP, same inputs)", "",
                  markdown_table(qnn_rows(m))]
        if line := lockstep_line(m):
            parts += ["", line]
    for extra in m.report_sections:
        parts += ["", extra]
    parts += ["", "## Timings", "", markdown_table(timing_rows(m)), ""]
    (folder / "report.md").write_text("\n".join(parts))
