"""The pipeline's `quantize` stage: float artifact folder -> <folder>/quantized/ sub-artifact.

It runs on the float graphs as emitted (after every pass, so on SHA/conv/split graphs alike), and
writes a complete artifact of its own (graphs, one shared weights.bin, rope, tokenizer, manifest,
AIMET encodings per graph), so the runtime opens it with `ArtifactSessions(folder / "quantized")`
and feeds it exactly what KVCache builds for the float graphs.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from toolchain.artifact.manifest import ROPE, Manifest
from toolchain.compile.emit import write_graphs
from toolchain.errors import QuantizeError
from toolchain.ir.graphset import GraphEntry, GraphSet
from toolchain.quantize.calibrate import (
    calibrate_family,
    corpus_tokens,
    family_feeds,
    filler_family,
    tensor_range,
)
from toolchain.quantize.encodings import scheme_summary, write_encodings
from toolchain.quantize.exact_mask import EXACT_MASK_VERSION
from toolchain.quantize.ppl import QUANT_DIR
from toolchain.quantize.qdq import KV_PATTERN, prepare_graph, quantize_graph, uint_params
from toolchain.quantize.schema import QuantizeSpec
from toolchain.runtime.sessions import PART_BUDGET_BYTES, ArtifactSessions


def tie_kv(ranges: dict[str, Any], spec: QuantizeSpec) -> tuple[dict[str, tuple[float, int]], dict[str, Any]]:
    """One (scale, zero point) per key_i / value_i: union of past_* and new_* ranges over all graphs."""
    union: dict[str, list[float]] = {}
    for tensors in ranges.values():
        for name in tensors.data:
            m = KV_PATTERN.match(name)
            if not m:
                continue
            lo, hi = tensor_range(tensors, name)
            key = f"{m.group(2)}_{m.group(3)}"
            cur = union.setdefault(key, [0.0, 0.0])
            cur[0], cur[1] = min(cur[0], lo), max(cur[1], hi)
    bits = 16 if spec.kv_type == "int16" else 8
    params = {k: uint_params(lo, hi, bits) for k, (lo, hi) in union.items()}
    record = {k: {"scale": s, "zero_point": z, "bits": bits, "range": union[k]} for k, (s, z) in params.items()}
    return params, record


def prepare_graphs(folder: Path, sessions: ArtifactSessions, spec: QuantizeSpec,
                   work: Path) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Per graph that the quantizer rewrites first (qdq.prepare_graph: exact masks, source grid):
    the rewritten float graph and its source-grid weights' exact codes."""
    out = {}
    for name, st in sessions.stages.items():
        path = work / f"{name}.prepared.onnx"
        written, fitted = prepare_graph(folder / st.file, path, spec)
        if written:
            out[name] = (path, fitted)
    return out


def prepared_variant(prepared: dict[str, tuple[Path, dict[str, Any]]]) -> str:
    """Cache-key name of the rewrite calibrated: exact masks (version), which weights were split and
    with an offset branch (another recipe may split other weights, e.g. an lm_head kept per channel)."""
    if not prepared:
        return ""
    split = sorted((g, w, gw.offset is not None) for g, (_, fitted) in prepared.items() for w, gw in fitted.items())
    return f"exact_mask:{EXACT_MASK_VERSION},source_grid:" + hashlib.sha256(json.dumps(split).encode()).hexdigest()[:16]


def share_ranges(folder: Path, sessions: ArtifactSessions, ranges: dict[str, Any]) -> int:
    """One range per tensor across graphs: the union, where the same tensor name is produced by the
    same node (decode and prefill are one network at two widths). A width-1 decode graph sees one
    token per calibration call, the prefill graph hundreds; sharing gives decode those tokens' ranges
    and both graphs identical encodings, like one AIMET encodings file for all widths."""
    import onnx
    from onnxruntime.quantization.calibrate import TensorData

    producers = {}
    for name, st in sessions.stages.items():
        g = onnx.load(folder / st.file, load_external_data=False).graph
        producers[name] = {o: n.name for n in g.node for o in n.output} | {i.name: "input" for i in g.input}
    union: dict[tuple[str, str], list[float]] = {}
    for name, tensors in ranges.items():
        for t in tensors.data:
            lo, hi = tensor_range(tensors, t)
            cur = union.setdefault((t, producers[name].get(t, "?")), [lo, hi])
            cur[0], cur[1] = min(cur[0], lo), max(cur[1], hi)
    changed = 0
    for name, tensors in ranges.items():
        for t in list(tensors.data):
            lo, hi = union[(t, producers[name].get(t, "?"))]
            if (lo, hi) != tensor_range(tensors, t):
                tensors.data[t] = TensorData(lowest=np.float32(lo), highest=np.float32(hi))
                changed += 1
    return changed


def run_graph_qat(sessions: ArtifactSessions, spec: QuantizeSpec, tokenizer: Any, tokens: list[int], work: Path,
                  schemes: dict[str, Any], log: Any) -> dict[str, Any]:
    """Learns the free 8-bit activation encodings on the widest graph (graph_qat.py) and writes them
    into every quantized graph in `work` (decode and prefill share tensor and encoding names)."""
    from toolchain.quantize.graph_qat import train_encodings, write_encodings_into

    cfg = spec.qat_spec
    fam = filler_family(sessions)
    chain = sessions.chain(fam)
    if len(chain) != 1:
        raise QuantizeError(f"method: qat trains on one whole step graph, but family {fam!r} is split into "
                            f"{len(chain)} parts; quantize before split_layers/split_parts (drop them from "
                            "passes for the QAT compile) or use method: ptq")
    name = chain[0].name
    # training calls from the calibration text; the calls that choose the checkpoint from held-out text
    # past the tokens `mobc eval ppl` scores, so the reported perplexity never saw the choice
    feeds = list(family_feeds(sessions, fam, tokens, cfg.feeds, seed=spec.calibration.seed + 1))
    val = corpus_tokens(tokenizer, "heldout", spec.eval_tokens + 4 * sessions.layout(fam).context)[spec.eval_tokens:]
    held = list(family_feeds(sessions, fam, val, 2, seed=spec.calibration.seed + 2))
    fixed = {t for s in schemes.values() for t in s["kv_tensors"]}
    net, record = train_encodings(work / f"{name}.onnx", feeds, held, fixed, cfg.steps, cfg.lr,
                                  cfg.temperature, cfg.max_seconds, log=log)
    record["trained_on"] = name
    record["written"] = {g: write_encodings_into(net, work / f"{g}.onnx") for g in sessions.stages}
    return record


def float_residual_graphs(work: Path, sessions: ArtifactSessions, spec: QuantizeSpec,
                          schemes: dict[str, Any]) -> dict[str, Any]:
    """The residual stream and outlier tensors of every quantized graph in `work` in float
    (float_residual.py); after QAT, whose encodings the kept Q/DQ pairs carry."""
    import onnx

    from toolchain.quantize.float_residual import float_residual
    from toolchain.quantize.qdq import save_in_place

    out = {}
    for name in sessions.stages:
        path = work / f"{name}.onnx"
        model = onnx.load(path)
        out[name] = float_residual(model, spec.outlier_ratio, set(schemes[name]["kv_tensors"]))
        save_in_place(model, path)
    return out


def quantize_artifact(folder: Path, spec: QuantizeSpec, tokenizer: Any, log: Any = None) -> dict[str, Any]:
    """Calibrates, quantizes, (for method: qat) learns the activation encodings, emits folder/quantized/.
    Returns the manifest record."""
    log = log or (lambda msg: None)
    t0 = time.perf_counter()
    sessions = ArtifactSessions(folder, max_resident_bytes=PART_BUDGET_BYTES)  # one part's weights at a time
    context = max(s.context for s in sessions.stages.values())
    tokens = corpus_tokens(tokenizer, "calibration", max(4 * context, 4096))
    timings: dict[str, float] = {}
    qat_record: dict[str, Any] | None = None
    out = folder / QUANT_DIR
    shutil.rmtree(out, ignore_errors=True)  # a stale one from another scheme must not survive a failure
    with tempfile.TemporaryDirectory(prefix="mobc-quant-", dir=folder.parent) as tmp:
        work = Path(tmp)
        ranges: dict[str, Any] = {}
        t = time.perf_counter()
        prepared = prepare_graphs(folder, sessions, spec, work)
        if prepared:
            timings["prepare"] = round(time.perf_counter() - t, 2)
            if n_fitted := sum(len(f) for _, f in prepared.values()):
                log(f"source grid kept exact for {n_fitted} weights")
            t = time.perf_counter()
        graphs_for = {name: path for name, (path, _) in prepared.items()}
        for fam in sessions.families():
            ranges.update(calibrate_family(sessions, fam, tokens, spec.calibration.samples,
                                           spec.calibration.seed, work, graphs_for, prepared_variant(prepared)))
            log(f"calibrated {fam}")
        timings["calibration"] = round(time.perf_counter() - t, 2)
        shared = share_ranges(folder, sessions, ranges)
        kv_params, kv_record = tie_kv(ranges, spec)
        t = time.perf_counter()
        graphs = GraphSet()
        schemes: dict[str, Any] = {}
        for name, st in sessions.stages.items():
            src, fitted = prepared.get(name, (folder / st.file, None))
            schemes[name] = quantize_graph(src, work / f"{name}.onnx", spec, ranges[name], kv_params, fitted)
        timings["qdq"] = round(time.perf_counter() - t, 2)
        if spec.method == "qat":
            t = time.perf_counter()
            qat_record = run_graph_qat(sessions, spec, tokenizer, tokens, work, schemes, log)
            timings["qat"] = round(time.perf_counter() - t, 2)
        floated = float_residual_graphs(work, sessions, spec, schemes) if spec.float_residual else {}
        for name, st in sessions.stages.items():
            dst = work / f"{name}.onnx"
            graphs.add(GraphEntry(name=name, model=ir.load(dst), family=st.family, role=st.role,
                                  width=st.width, context=st.context, stage=st.stage, meta=dict(st.meta)))
        out.mkdir()  # only now: calibration, QDQ or QAT failing leaves no quantized/ that looks complete
        records, weights = write_graphs(out, graphs)
    del graphs
    for rec in records:
        enc = write_encodings(out / rec.file, out / f"{Path(rec.file).stem}.encodings.json")
        rec.quantization = scheme_summary(enc)
        rec.encodings = f"{Path(rec.file).stem}.encodings.json"
        rec.float_weight_bytes = sessions.stages[rec.name].weight_bytes
    shutil.copy(folder / ROPE, out / ROPE)
    shutil.copytree(folder / "tokenizer", out / "tokenizer", dirs_exist_ok=True)
    record = {
        "scheme": spec.tag(), "spec": spec.model_dump(mode="json"), "kv_encodings": kv_record,
        "weights_by_graph": {n: s["weights"] for n, s in schemes.items()},
        "lpbq_by_graph": {n: s["lpbq"] for n, s in schemes.items() if s.get("lpbq")},
        "htp_precise_by_graph": {n: s["htp_precise"] for n, s in schemes.items() if s.get("htp_precise")},
        "float_residual_by_graph": floated,
        "calibration_tokens": len(tokens), "timings": timings, "qat": qat_record,
        "ranges_shared_across_graphs": shared,
        "implementation": "onnxruntime.quantization get_qnn_qdq_config + quantize_static (QDQ); "
                          "mobc: feeds, streamed calibration, pattern overrides, tied KV, QAT, encodings",
    }
    float_manifest = sessions.manifest
    Manifest(name=f"{float_manifest.name}-{spec.tag()}", source=float_manifest.source, tools=float_manifest.tools,
             model=float_manifest.model, graphs=records, weights=weights, rope=float_manifest.rope,
             quantization=record).write(out)
    record["seconds"] = round(time.perf_counter() - t0, 2)
    return {"folder": QUANT_DIR, "scheme": spec.tag(), "weights_bytes": weights["bytes"],
            "float_weights_bytes": float_manifest.weights["bytes"],
            "graphs": {r.name: {"weight_bytes": r.weight_bytes, "float_weight_bytes": r.float_weight_bytes,
                                "quantization": r.quantization} for r in records},
            "kv_tied": bool(kv_record), "timings": timings, "qat": qat_record,
            "lpbq_by_graph": record["lpbq_by_graph"], "htp_precise_by_graph": record["htp_precise_by_graph"],
            "float_residual_by_graph": floated}


def pipeline_quantize(folder: Path, recipe: Any, loaded: Any, timer: Any) -> dict[str, Any]:
    """The compile pipeline's quantize stage (after passes, emit and float verification)."""
    from toolchain.quantize.ppl import eval_artifact

    spec: QuantizeSpec = recipe.quantize
    with timer.stage(f"quantize {spec.tag()} (calibrate {spec.calibration.samples} calls/graph"
                     + (", QAT" if spec.method == "qat" else "") + ")"):
        record = quantize_artifact(folder, spec, loaded.tokenizer, log=timer.reporter.note)
    if spec.eval_tokens:
        with timer.stage(f"perplexity float vs {spec.tag()} ({spec.eval_tokens} held-out tokens)"):
            record["perplexity"] = eval_artifact(folder, spec.eval_tokens, tokenizer=loaded.tokenizer)
    return record


def report_section(record: dict[str, Any]) -> str:
    from toolchain.compile.report import markdown_table
    from toolchain.quantize.ppl import ppl_table

    lines = [f"## Quantization ({record['scheme']}, `{record['folder']}/`)", "",
             "| graph | float weights | quantized weights | params | activations |", "|---|---|---|---|---|"]
    for name, g in record["graphs"].items():
        q = g["quantization"]
        lines.append(f"| {name} | {g['float_weight_bytes'] / 1e6:,.1f} MB | {g['weight_bytes'] / 1e6:,.1f} MB | "
                     + ", ".join(f"{k}: {v}" for k, v in q["params"].items()) + " | "
                     + ", ".join(f"{k}: {v}" for k, v in q["activations"].items()) + " |")
    if floated := {g: r for g, r in (record.get("float_residual_by_graph") or {}).items() if r["residual_adds"]}:
        lines += ["", "Float residual stream (`float_residual`; fp16 on the HTP):", "",
                  "| graph | residual Adds | norms (L2 form) | outlier tensors | float weights |", "|---|---|---|---|---|"]
        lines += [f"| {g} | {r['residual_adds']} | {r['norms']} | {len(r['outliers'])} | {r['float_weights']} |"
                  for g, r in floated.items()]
    if record.get("perplexity"):
        p = record["perplexity"]
        lines += ["", f"Perplexity on {p['tokens']} tokens of {p['text']} (not calibration text):", "",
                  markdown_table(ppl_table(p))]
    return "\n".join(lines)
