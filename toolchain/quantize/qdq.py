"""QDQ emission with onnxruntime.quantization's QNN-oriented tooling, driven by mobc's recipe.

What onnxruntime does (unchanged): `get_qnn_qdq_config` (QNN compatibility fixes and
mixed-precision converts between 8- and 16-bit regions) and `quantize_static` (Q/DQ insertion,
int4/int8 weights per channel or per block, opset-21 DequantizeLinear).

What mobc adds here, because onnxruntime cannot know it:
- per-tensor overrides from name patterns (recipe `overrides:`) onto the weights and outputs of
  matching nodes, so `lm_head*: {weights: int8}` or `*norm*: {activations: int16}` work on any
  graph (plain export, SHA, conv) without knowing generated tensor names like val_2752;
- constant Transposes of weights folded first (the tied lm_head is Transpose(embedding)), else
  onnxruntime would quantize the weight as an activation, per tensor;
- KV cache encodings tied: past_key_i and new_key_i (and past_value_i/new_value_i) of every
  graph family get one explicit scale/zero-point from the union of their calibrated ranges, so
  the runtime can feed outputs back as inputs without requantizing;
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper
from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize_static
from onnxruntime.quantization.calibrate import TensorsData, save_tensors_data
from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

from toolchain.errors import QuantizeError
from toolchain.quantize.exact_mask import SOFTMAX_SPAN, exact_attention_masks
from toolchain.quantize.fuse import fuse_rmsnorm
from toolchain.quantize.htp_precise import precise_products
from toolchain.quantize.lpbq import to_htp_forms
from toolchain.quantize.schema import QuantizeSpec
from toolchain.quantize.source_grid import split_grid_weights, write_exact_codes

WEIGHT_QTYPES = {"int4": QuantType.QInt4, "int8": QuantType.QInt8, "int16": QuantType.QInt16}
# QNN HTP convention: activations unsigned with a zero point (asymmetric)
ACT_QTYPES = {"int8": QuantType.QUInt8, "int16": QuantType.QUInt16}
KV_PATTERN = re.compile(r"^(past|new)_(key|value)_(\d+)$")
WEIGHT_OPS = {"MatMul": 1, "Gemm": 1, "Conv": 1}


def uint_params(lo: float, hi: float, bits: int) -> tuple[float, int]:
    """Asymmetric unsigned scale/zero-point with 0 exactly representable (as onnxruntime computes)."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    qmax = (1 << bits) - 1
    scale = max(hi - lo, 1e-4) / qmax
    zp = int(np.clip(round(-lo / scale), 0, qmax))
    return float(scale), zp


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, f"*{pattern}")


def fold_weight_transposes(model: onnx.ModelProto) -> int:
    """Transpose(initializer) -> a transposed initializer, so every weight is a real initializer."""
    inits = {i.name: i for i in model.graph.initializer}
    keep, folded = [], 0
    for node in model.graph.node:
        if node.op_type == "Transpose" and node.input[0] in inits:
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
            arr = numpy_helper.to_array(inits[node.input[0]])
            model.graph.initializer.append(numpy_helper.from_array(np.transpose(arr, perm).copy(), node.output[0]))
            folded += 1
            continue
        keep.append(node)
    if folded:
        del model.graph.node[:]
        model.graph.node.extend(keep)
        used = {i for n in keep for i in n.input}
        unused = [i for i in model.graph.initializer if i.name not in used]
        for i in unused:
            model.graph.initializer.remove(i)
    return folded


def weight_axis(op: str, rank: int, block: bool) -> int:
    """Per-channel axis = output channels; block axis = the reduction (input) axis."""
    if op == "Conv":
        return 1 if block else 0
    if op == "Gemm":
        return 1 if block else 0  # mobc exports Gemm with transB=1: [out, in]
    return 0 if block else rank - 1  # MatMul [in, out]


def node_overrides(spec: QuantizeSpec, node_name: str) -> dict[str, Any]:
    """Merged overrides of every pattern matching the node name (later patterns win)."""
    merged: dict[str, Any] = {}
    for pattern, ov in spec.overrides.items():
        if _matches(node_name, pattern):
            merged.update(ov.model_dump(exclude_none=True))
    return merged


def build_overrides(model: onnx.ModelProto, spec: QuantizeSpec, kv_params: dict[str, tuple[float, int]],
                    ranges: TensorsData | None = None, wide: frozenset[str] = frozenset(),
                    ) -> tuple[dict, dict, list[str], dict]:
    """TensorQuantOverrides (general, KV cache) + excluded node names + each weight's scheme.

    wide: tensors written at 16 bits whatever the recipe says (the source grid's partial sums)."""
    inits = {i.name: i for i in model.graph.initializer}
    ov: dict[str, list[dict[str, Any]]] = {}
    kv: dict[str, list[dict[str, Any]]] = {}
    exclude: list[str] = []
    schemes: dict[str, dict[str, Any]] = {}
    for node in model.graph.node:
        o = node_overrides(spec, node.name)
        if o.get("weights") == "float" or o.get("activations") == "float":
            exclude.append(node.name)
            continue
        widx = WEIGHT_OPS.get(node.op_type)
        if widx is not None and len(node.input) > widx and node.input[widx] in inits:
            w = inits[node.input[widx]]
            wtype = o.get("weights", spec.weights)
            gran = o.get("granularity", spec.granularity)
            entry: dict[str, Any] = {"quant_type": WEIGHT_QTYPES[wtype], "symmetric": True}
            if gran != "per_tensor":
                entry["axis"] = weight_axis(node.op_type, len(w.dims), gran == "block")
            ov[w.name] = [entry]
            schemes[w.name] = {"node": node.name, "dtype": wtype, "granularity": gran,
                               "axis": entry.get("axis"), "symmetric": True,
                               "block_size": spec.block_size if gran == "block" else None}
        if node.op_type == "Gather" and node.input[0] in inits:
            etype = o.get("weights", spec.embedding)
            if etype == "float":
                exclude.append(node.name)
            else:
                ov[node.input[0]] = [{"quant_type": ACT_QTYPES.get(etype, WEIGHT_QTYPES.get(etype))}]
                schemes[node.input[0]] = {"node": node.name, "dtype": etype, "granularity": "per_tensor"}
        if node.op_type == "Softmax" and ranges is not None and node.input[0] in ranges.data:
            # scores + additive mask span [-1e4, ~20]: a grid over that wastes every level on the
            # mask; below max - SOFTMAX_SPAN exp() is 0 anyway, so clip there
            lo, hi = (float(np.asarray(v).reshape(-1)[0]) for v in ranges.data[node.input[0]].range_value)
            if hi - lo > SOFTMAX_SPAN:
                ov.setdefault(node.input[0], [{}])[0].update(rmin=np.float32(hi - SOFTMAX_SPAN), rmax=np.float32(hi))
        if "activations" in o:
            for out in node.output:
                if out and not KV_PATTERN.match(out):
                    ov.setdefault(out, [{}])[0]["quant_type"] = ACT_QTYPES[o["activations"]]
    kv_bits = 16 if spec.kv_type == "int16" else 8
    producer = {o: n for n in model.graph.node for o in n.output}
    names = [v.name for v in model.graph.input] + [v.name for v in model.graph.output]
    for name in names:
        m = KV_PATTERN.match(name)
        if not m:
            continue
        scale, zp = kv_params[f"{m.group(2)}_{m.group(3)}"]
        enc = {"quant_type": ACT_QTYPES[spec.kv_type], "scale": np.array(scale, np.float32),
               "zero_point": np.array(zp, np.uint16 if kv_bits == 16 else np.uint8)}
        chain = kv_chain(name, producer)
        kv[name] = [dict(enc)]
        if len(chain) == 1:
            continue
        # onnxruntime gives a Transpose/Reshape output its input's encoding, so the tie must be set
        # on the tensor that really produces the K/V rows (a MatMul or RoPE Add). If the KV type
        # differs from that producer's, the producer keeps its own type and a Convert (Q/DQ pair)
        # feeds the K/V path: HTP rejects e.g. a MatMul with 16-bit input and 8-bit output.
        # A weight product (MatMul/Gemm/Conv) writes at least its input's width: HTP refuses a MatMul
        # with a 16-bit input and block weights writing 8 bits (a tiny W4A8 with 16-bit norms).
        head, first = chain[-1], producer[chain[-2]]
        head_type = _act_type(ov, head, spec)
        source = producer.get(head)
        if source is not None and source.op_type in WEIGHT_OPS:
            head_type = max(head_type, _act_type(ov, source.input[0], spec), key=_bits)
        elif source is not None and source.op_type == "Add" and wide.issuperset(source.input):
            # the source grid's Add of two 16-bit partial sums likewise: HTP's u16 + u16 -> u8 Add put
            # W4A8's layer-0 value row 17 steps off where its main partial sat at the top of its range
            # (a CPU-exact 0.2305 came out 0.2993); written at 16 bits and converted, 0 steps (measured)
            head_type = max(head_type, QuantType.QUInt16, key=_bits)
        if head_type == ACT_QTYPES[spec.kv_type] and head not in ov:
            kv[head] = [dict(enc)]
        else:
            kv[head] = [{"quant_type": head_type, "convert": {**enc, "recv_nodes": {first.name}}}]
    return ov, kv, exclude, schemes


def _act_type(ov: dict[str, list[dict[str, Any]]], tensor: str, spec: QuantizeSpec) -> QuantType:
    """The activation type a tensor gets: its override's, else the recipe's."""
    return ov.get(tensor, [{}])[0].get("quant_type", ACT_QTYPES[spec.activations])


def _bits(qtype: QuantType) -> int:
    return 16 if qtype in (QuantType.QUInt16, QuantType.QInt16) else 8


PASSTHROUGH = {"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"}


def kv_chain(name: str, producer: dict[str, onnx.NodeProto]) -> list[str]:
    chain = [name]
    node = producer.get(name)
    while node is not None and node.op_type in PASSTHROUGH:
        chain.append(node.input[0])
        node = producer.get(node.input[0])
    return chain


def grid_plans(model: onnx.ModelProto, spec: QuantizeSpec) -> dict[str, tuple[str, str, int]]:
    """Weights whose scheme is block-quantized int4/int8: candidates for keeping their source grid."""
    inits = {i.name for i in model.graph.initializer}
    plans = {}
    for node in model.graph.node:
        if node.op_type != "MatMul" or len(node.input) < 2 or node.input[1] not in inits:
            continue
        o = node_overrides(spec, node.name)
        wtype = o.get("weights", spec.weights)
        if o.get("granularity", spec.granularity) == "block" and wtype in ("int4", "int8"):
            plans[node.input[1]] = (node.name, wtype, spec.block_size)
    return plans


def _exact_codes(dst: Path, fitted: dict[str, Any], block: int) -> None:
    """Puts the source-grid codes into onnxruntime's output file; fails if any weight is not exact."""
    model = onnx.load(dst)
    problems = write_exact_codes(model, fitted, block)
    if problems:
        raise RuntimeError("source-grid quantization failed: " + "; ".join(problems[:5]))
    save_in_place(model, dst)


def _htp_forms(dst: Path) -> list[dict[str, Any]]:
    """LPBQ / per-channel weights where HTP needs them next to 8-bit activations (lpbq.py)."""
    model = onnx.load(dst)
    records = to_htp_forms(model)
    if records:
        save_in_place(model, dst)
    return records


def htp_precise_forms(path: Path) -> dict[str, int]:
    """The 16-bit attention products of a QDQ graph file in the forms HTP keeps precise (htp_precise.py):
    how many of each form."""
    model = onnx.load(path)
    counts = dict(Counter(record["form"] for record in precise_products(model)))
    if counts:
        save_in_place(model, path)
    return counts


def save_in_place(model: onnx.ModelProto, dst: Path) -> None:
    """Overwrites graph file `dst` and its external data (written afresh beside it)."""
    data = dst.name + ".data"
    (dst.parent / data).unlink(missing_ok=True)
    onnx.save_model(model, dst, save_as_external_data=True, all_tensors_to_one_file=True, location=data)


class _ListReader(CalibrationDataReader):
    def __init__(self, feeds: Iterator[dict[str, np.ndarray]]):
        self.feeds = feeds

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.feeds, None)


def prepare_graph(src: Path, dst: Path, spec: QuantizeSpec) -> tuple[bool, dict[str, Any]]:
    """Writes `src` rewritten for calibration and quantization to `dst`: masked Softmaxes made exact
    (exact_mask.py) and, with `source_grid`, source-grid weights split (source_grid.py). Returns
    (whether `dst` was written, the fitted weights); nothing is written when nothing changed."""
    model = onnx.load(src)
    fold_weight_transposes(model)
    masked = exact_attention_masks(model, SOFTMAX_SPAN)
    fitted = split_grid_weights(model, grid_plans(model, spec)) if spec.source_grid else {}
    if masked or fitted:
        onnx.save_model(model, dst, save_as_external_data=True, all_tensors_to_one_file=True,
                        location=dst.name + ".data")
    return bool(masked or fitted), fitted


def quantize_graph(src: Path, dst: Path, spec: QuantizeSpec, ranges: TensorsData,
                   kv_params: dict[str, tuple[float, int]], fitted: dict[str, Any] | None = None) -> dict[str, Any]:
    """Float graph file -> QDQ graph file (external data beside it). Returns the weight schemes.

    fitted: source-grid weights of a `src` written by prepare_graph."""
    model = onnx.load(src)
    folded = fold_weight_transposes(model)
    fused = fuse_rmsnorm(model)
    fitted = fitted or {}
    outputs = {n.name: n.output[0] for n in model.graph.node}
    # the split's partial sums (main, blocksum, offset) are written at 16 bits (below)
    wide = frozenset(outputs[n] for gw in fitted.values() if gw.offset for n in gw.nodes if n in outputs)
    ov, kv, exclude, schemes = build_overrides(model, spec, kv_params, ranges, wide)
    for name, gw in fitted.items():
        schemes[name]["source_grid"] = "exact" + (" + block offset" if gw.offset else "")
        if gw.offset:
            # the split's partial sums (main, blocksum, offset) are one linear's internals: 16-bit, so
            # only the final Add is rounded at the activation width, like the unsplit linear's output
            # (8-bit partials tripled the rounding: measured, each removed 5-11% of W4A8's logit KL)
            for node in sorted(gw.nodes):
                out = outputs.get(node)
                if out and _act_type(ov, out, spec) == QuantType.QUInt8:
                    ov.setdefault(out, [{}])[0]["quant_type"] = QuantType.QUInt16
            # C: small and off-grid; write_exact_codes makes it 8-bit per output channel
            ov[gw.offset] = [{"quant_type": QuantType.QInt8, "symmetric": True, "axis": 0}]
            schemes[gw.offset] = {"node": gw.node, "dtype": "int8", "granularity": "per_channel", "axis": 1,
                                  "symmetric": True}
            schemes.pop(gw.indicator, None)
    cache = dst.parent / f".{dst.stem}.calib.json"
    # tensors that became initializers (folded transposes) must not keep an activation range
    inits = {i.name for i in model.graph.initializer}
    save_tensors_data(TensorsData(ranges.calibration_method,
                                  {k: v for k, v in ranges.data.items() if k not in inits}), cache)
    act = ACT_QTYPES[spec.activations]
    try:
        cfg = get_qnn_qdq_config(model, _ListReader(iter(())), activation_type=act,
                                 weight_type=WEIGHT_QTYPES[spec.weights], init_overrides=ov,
                                 nodes_to_exclude=exclude or None)
    except ValueError as exc:  # onnxruntime's mixed-precision fixer: conflicting widths around a tensor
        raise QuantizeError(
            f"quantize.overrides: onnxruntime cannot place the 8/16-bit conversions these overrides need "
            f"({exc}). A tensor whose producer and consumers were given different activation widths must "
            "get one width: extend the override to the neighbouring nodes (e.g. the Add before a Softmax), "
            "or drop it") from exc
    extra = dict(cfg.extra_options)
    # KV encodings are explicit scale/zero-point: set after onnxruntime's mixed-precision fixer,
    # which rejects a fixed 8-bit chain (producer -> Transpose -> output) inside a 16-bit graph
    extra["TensorQuantOverrides"] = {**extra["TensorQuantOverrides"], **kv}
    if spec.granularity == "block":
        extra["BlockSize"] = spec.block_size
    logging.getLogger().setLevel(logging.ERROR)  # onnxruntime warns about pre-processing on every call
    quantize_static(model, dst, calibration_data_reader=None, op_types_to_quantize=cfg.op_types_to_quantize,
                    activation_type=act, weight_type=WEIGHT_QTYPES[spec.weights], nodes_to_exclude=exclude or None,
                    use_external_data_format=True, extra_options=extra, calibration_cache_path=cache)
    cache.unlink(missing_ok=True)
    if fitted:
        _exact_codes(dst, fitted, spec.block_size)
    lpbq = _htp_forms(dst) if spec.lpbq else []
    # before QAT (which then trains the products' encodings too) and before anything reads the graph
    precise = htp_precise_forms(dst) if spec.htp_precise else {}
    return {"lpbq": lpbq, "htp_precise": precise, "weights": schemes, "folded_transposes": folded, "fused_rmsnorms": fused, "excluded_nodes": exclude,
            "kv_tensors": sorted(kv)}
