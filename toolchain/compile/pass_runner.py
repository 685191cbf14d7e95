"""Runs the recipe's passes over a GraphSet and proves each one kept the numerics.

For every pass, in recipe order: apply it (model-level passes to every graph of every family,
graph-level passes once per family on the GraphSet), check its `ensures`, run every family's
chain in onnxruntime CPU on the same feeds, and compare each output with what the chain
produced before the pass. The "before" outputs of pass k are the "after" outputs of pass k-1,
so each pass costs one chain run per family. A diff above the tolerance raises PassError naming
the pass, the family and the worst output. Rows are plain JSON (manifest.json "passes").
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from rich.table import Table

from passes.base import GraphSetPass
from passes.registry import check_order
from toolchain.artifact.chain import run_chain
from toolchain.compile.contracts import argmax_exact_diff
from toolchain.errors import MobcError, PassError
from toolchain.ir import disk
from toolchain.ir.graph import layer_of, weight_bytes
from toolchain.ir.graphset import GraphEntry, GraphSet
from toolchain.runtime.sessions import (
    PART_BUDGET_BYTES,
    prepacking_changes_numerics,
    reopenable_session_options,
)

Feeds = dict[str, dict[str, np.ndarray]]


# A stage whose weights exceed this is run in temporary layer parts (split_layers' cut), each
# its own session, so checking a 8B graph needs one part's memory, not the model's.
RUN_PART_BYTES = PART_BUDGET_BYTES


def save_for_ort(model: ir.Model, folder: Path, stem: str = "graph") -> Path:
    """`folder`/<stem>.onnx for onnxruntime. On-disk weights are read where they lie when they are
    in `folder` (the compile's spill: no copy of a multi-GB checkpoint per check), else linked
    into it; in-memory ones go to <stem>.data."""
    proto = ir.to_proto(model)
    paths = {v.name: Path(v.const_value.path) for v in model.graph.initializers.values()
             if isinstance(v.const_value, ir.ExternalTensor)}
    for t in proto.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL and t.name in paths:
            for entry in t.external_data:
                if entry.key == "location":
                    entry.value = disk.link_into(folder, paths[t.name])
    path = folder / f"{stem}.onnx"
    onnx.save_model(proto, path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location=f"{stem}.data", size_threshold=1024)
    return path


def _ort_run_whole(entry: GraphEntry, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    spill = disk.active()
    with tempfile.TemporaryDirectory(prefix="mobc-pass-") as tmp:
        folder = spill.folder if spill is not None else Path(tmp)
        stem = f"check-{os.getpid()}-{entry.name}"
        path = save_for_ort(entry.model, folder, stem)
        try:
            ops = {n.op_type for n in entry.model.graph.all_nodes()}
            opts = reopenable_session_options(prepack=prepacking_changes_numerics(ops))
            sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise PassError(f"graph {entry.name!r} does not load in onnxruntime: {exc}") from exc
        finally:
            path.unlink()
            (folder / f"{stem}.data").unlink(missing_ok=True)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds), strict=True))


def ort_run(entry: GraphEntry, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One graph on the onnxruntime CPU EP (the reference every pass is checked on).

    A graph with more than RUN_PART_BYTES of weights runs as temporary layer parts, one
    session at a time; the parts compute exactly what the whole graph computes (the chain rules
    of toolchain/artifact/chain.py), so the check is the same at a fraction of the memory.
    """
    if weight_bytes(entry.model) > RUN_PART_BYTES and _layer_count(entry.model) > 1:
        from passes.split_layers import SplitLayers

        gs = GraphSet()
        gs.add(dataclasses.replace(entry, meta={k: v for k, v in entry.meta.items() if k != "layers"}))
        gs = SplitLayers(SplitLayers.Config(max_part_bytes=RUN_PART_BYTES)).apply(gs, entry.family)
        parts = gs.chain(entry.family)
        if len(parts) > 1:
            outs = run_chain(parts, feeds, _ort_run_whole)
            return {name: outs[name] for name in entry.output_names}
    return _ort_run_whole(entry, feeds)


def _layer_count(model: ir.Model) -> int:
    return len({i for n in model.graph if (i := layer_of(n)) is not None})


def _stats(gs: GraphSet) -> tuple[dict[str, int], int]:
    """Op counts over every graph, and weight bytes as the artifact stores them: identical
    bytes once (weights shared between stages, widths, or a tied embedding and its lm_head)."""
    ops: Counter[str] = Counter()
    tensors: dict[int, Any] = {}
    for e in gs.entries.values():
        ops.update(n.op_type for n in e.model.graph)
        for v in e.model.graph.initializers.values():
            if v.const_value is not None:
                tensors[id(v.const_value)] = v.const_value
    keys = set()
    by_size: dict[int, list[Any]] = {}
    for t in tensors.values():
        if isinstance(t, ir.ExternalTensor):  # on disk: the same bytes are the same file range
            keys.add((str(Path(t.path).resolve()), t.offset, t.length or t.nbytes))
        else:
            by_size.setdefault(t.nbytes, []).append(t)
    nbytes = sum(k[2] for k in keys)
    for size, group in by_size.items():
        # only tensors of equal size can be equal: hash just those
        distinct = {hashlib.sha1(t.tobytes()).digest() for t in group} if len(group) > 1 else group
        nbytes += size * len(distinct)
    return dict(sorted(ops.items())), nbytes


def _run_all(gs: GraphSet, feeds: Feeds) -> dict[str, dict[str, np.ndarray]]:
    out = {}
    for fam in gs.families():
        if fam not in feeds:
            raise PassError(f"no verification inputs for graph family {fam!r}")
        out[fam] = run_chain(gs.chain(fam), feeds[fam], ort_run)
    return out


def _apply(p: Any, gs: GraphSet) -> GraphSet:
    if isinstance(p, GraphSetPass):
        for fam in gs.families():
            gs = p.apply(gs, fam)
            p.ensures(gs, fam)
        return gs
    for entry in list(gs.entries.values()):
        result = p(entry.model)  # onnx_ir's PassBase.__call__ runs requires/call/ensures
        entry.model = result.model
    return gs


# outputs compared relative to their largest entry: the residual stream a split_lm_head artifact
# exposes reaches |x| ~ 2e4 on SmolLM2's attention-sink token, where float32 reordering alone moves
# it by ~1e-3 (the logits it leads to are still checked absolutely)
RELATIVE_OUTPUTS = ("hidden",)


def _scale(out: str, ref: np.ndarray) -> float:
    if out in RELATIVE_OUTPUTS and ref.size:
        return max(1.0, float(np.max(np.abs(ref))))
    return 1.0


def compare_outputs(name: str, before: dict, after: dict, tolerance: float,
                    argmax_exact: frozenset[str] = frozenset()) -> dict[str, dict[str, float]]:
    """max |diff| per family and output (outputs in `argmax_exact`: at each row's argmax, see
    toolchain/compile/contracts.py); raises PassError when the worst exceeds the tolerance."""
    diffs: dict[str, dict[str, float]] = {}
    worst = (0.0, "", "")  # (diff / scale, family, output)
    for fam, ref in before.items():
        got = after[fam]
        missing = sorted(set(ref) - set(got))
        if missing:
            raise PassError(f"pass {name!r} removed outputs {missing[:4]} of graph {fam!r}")
        diffs[fam] = {}
        for out, a in ref.items():
            b = got[out]
            if a.shape != b.shape:
                raise PassError(f"pass {name!r} changed the shape of {fam}.{out}: {a.shape} -> {b.shape}")
            if out in argmax_exact:
                d = argmax_exact_diff(a, b, tolerance)
            else:
                d = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.size else 0.0
            if not np.isfinite(d):
                d = float("inf")
            diffs[fam][out] = d
            rel = d / _scale(out, a)
            if rel > worst[0] or worst[1] == "":
                worst = (rel, fam, out)
    if worst[0] > tolerance:
        what = "relative to its largest entry " if worst[2] in RELATIVE_OUTPUTS else ""
        if worst[2] in argmax_exact:
            what = "at its argmax (or moved the argmax) "
        raise PassError(
            f"pass {name!r} changed graph {worst[1]!r} output {worst[2]!r} {what}by {worst[0]:.3g} "
            f"(tolerance {tolerance:g}); remove the pass from the recipe or report a mobc bug"
        )
    return diffs


def run_passes(
    graphset: GraphSet,
    specs: list,
    tolerance: float,
    feeds: Feeds,
    progress: Callable[[str], None] | None = None,
) -> tuple[GraphSet, list[dict]]:
    """Applies `specs` (recipe pass list) in order; returns the new GraphSet and one row per pass."""
    passes = check_order(specs)
    rows: list[dict] = []
    before = _run_all(graphset, feeds)
    argmax_exact: frozenset[str] = frozenset()
    for p in passes:
        name = p.pass_name
        argmax_exact |= frozenset(p.argmax_exact_outputs)  # this pass's and every later pass's check
        ops_before, bytes_before = _stats(graphset)
        graphs_before = sorted(graphset.entries)
        t0 = time.perf_counter()
        spill = disk.active()
        if spill is not None:
            spill.section(name)  # what this pass creates; earlier sections it replaces get deleted below
        try:
            graphset = _apply(p, graphset)
            if spill is not None:
                for entry in graphset.entries.values():
                    disk.spill_large(entry.model, spill)  # tensors a rewriter made outside add_initializer
        except MobcError:
            raise
        except Exception as exc:
            cause = exc.__cause__  # onnx_ir wraps requires/ensures failures; their cause says why
            why = f"{exc}: {type(cause).__name__}: {cause}" if cause else f"{type(exc).__name__}: {exc}"
            raise PassError(f"pass {name!r} failed: {why}") from exc
        seconds = time.perf_counter() - t0
        after = _run_all(graphset, feeds)
        diffs = compare_outputs(name, before, after, tolerance, argmax_exact)
        ops_after, bytes_after = _stats(graphset)
        worst_fam, worst_out, worst = "", "", 0.0
        for fam, d in diffs.items():
            for out, v in d.items():
                if v >= worst:
                    worst_fam, worst_out, worst = fam, out, v
        if progress:
            progress(f"{name}: {len(graphset.entries)} graphs, worst |diff| {worst:.2g} ({worst_fam}.{worst_out}), "
                     f"{time.perf_counter() - t0:.0f} s with its check")
        options = p.config.model_dump(mode="json") if hasattr(p, "config") else {}
        rows.append(
            {
                "pass": name,
                "options": options,
                "seconds": round(seconds, 3),
                "graphs_before": graphs_before,
                "graphs_after": sorted(graphset.entries),
                "ops_before": ops_before,
                "ops_after": ops_after,
                "nodes_before": sum(ops_before.values()),
                "nodes_after": sum(ops_after.values()),
                "weight_bytes_before": bytes_before,
                "weight_bytes_after": bytes_after,
                "max_abs_diff": diffs,
                "worst": {"family": worst_fam, "output": worst_out, "diff": worst},
            }
        )
        before = after
        if spill is not None:
            spill.collect(v.const_value for e in graphset.entries.values()
                          for v in e.model.graph.initializers.values())
    return graphset, rows


def format_pass_table(rows: list[dict]) -> Table:
    """The per-pass table (the same rows `mobc inspect` and report.md show)."""
    from toolchain.compile.report import pass_rows, rich_table

    return rich_table("passes", pass_rows(rows))
