"""The residual stream of a QDQ graph in float (fp16 on QNN HTP), and its outlier tensors with it.

Why (measured, SmolLM2-135M W4A16, the 128-row prefill on the emulated HTP, soc 57 / v75, against
the CPU EP's QDQ arithmetic on one call of real text):

    residual stream                                        top-1 kept   K/V max rel   max |logit diff|
    16-bit, as calibrated                                  93.0%        18.5%         4.3
    residual Adds float                                    95.3%        12.7%         1.96
    + the outlier MLP (layer 11's down path) float         94.5%         8.8%         1.91
    + norms read the float stream (prescaled L2 form)      99.2%         2.2%         0.58

One token (the first) carries a "massive activation": from the MLP that writes it on, every residual
tensor's 16-bit encoding spans +-2.8e4, one step is 0.43, while ordinary tokens' residual values are
O(1-10). Wherever the HTP rounds one step differently from the CPU an ordinary token moves by 0.43,
and that compounds layer by layer. Float tensors (fp16 on the HTP: 11 bits of mantissa *per value*)
do not share one grid across tokens, so the first token no longer coarsens the others.

What `float_residual` rewrites, after quantization:
- residual Adds (an Add one of whose inputs also feeds an RMSNorm) lose the Q->DQ on their output:
  the next Add and the norms read the float sum;
- an RMSNorm whose input is now float becomes x*c / ReduceL2(x*c) * (gamma*sqrt(N)), c a power of two
  that brings the calibrated max |x| under 64: HTP's fp16 RmsNorm op followed by an int4 MatMul fails
  to finalize (QNN_COMMON_ERROR_MEM_ALLOC, measured), and unscaled squares of 2.8e4 overflow fp16.
  epsilon is dropped: eps*c^2 is below fp16's resolution there, and eps/mean(x^2) < 1e-4 on real tokens;
- outlier tensors (`outlier_ratio`): a tensor whose calibrated range exceeds that many times the median
  range of the same tensor in the other layers (the MLP that writes the massive activation) loses its
  Q->DQ too; a weight product that then reads a float input gets its weights as float constants
  (HTP refuses a standalone DequantizeLinear of int4 weights).
K/V cache tensors and graph outputs keep their encodings: the runtime's contract is unchanged.
Float tensors run in the HTP's fp16 mode (`enable_htp_fp16_precision`; onnxruntime-qnn's default, set
explicitly for such graphs).
"""

from __future__ import annotations

import re
from statistics import median
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from toolchain.quantize.graph_index import GraphIndex
from toolchain.quantize.htp_precise import encoding_range

NORM_OPS = {"SimplifiedLayerNormalization"}
# the HTP provider option that runs a quantized graph's float tensors in fp16 (onnxruntime-qnn's default,
# set explicitly for such graphs); an option, not the `fp16` flag, which marks float graphs (gate hints)
FP16_TENSORS = {"enable_htp_fp16_precision": "1"}
PRESCALE_MAX = 64.0  # |x*c| <= 64: squares <= 4096, a 576..4096-wide sum of them stays in fp16
LAYER_INDEX = re.compile(r"\d+")
UINT8_ZERO = numpy_helper.from_array(np.zeros((), np.uint8))  # a QuantizeLinear without a zero point


class _Index(GraphIndex):
    """GraphIndex plus the QDQ-aware lookups float_residual needs."""

    def source(self, tensor: str) -> str:
        """The float tensor behind a DequantizeLinear(QuantizeLinear(t)) pair, else the tensor itself."""
        dq = self.producer.get(tensor)
        if dq is not None and dq.op_type == "DequantizeLinear":
            q = self.producer.get(dq.input[0])
            if q is not None and q.op_type == "QuantizeLinear":
                return q.input[0]
        return tensor

    def readers(self, tensor: str) -> list[onnx.NodeProto]:
        """The non-QDQ nodes reading `tensor`, directly or through its Q->DQ pairs."""
        out = []
        for c in self.consumers.get(tensor, []):
            if c.op_type == "QuantizeLinear":
                for dq in self.consumers.get(c.output[0], []):
                    out += [r for r in self.consumers.get(dq.output[0], []) if r.op_type != "QuantizeLinear"]
            elif c.op_type != "DequantizeLinear":
                out.append(c)
        return out

    def encoding_range(self, tensor: str) -> tuple[float, float] | None:
        """The real range of the QuantizeLinear right after `tensor`, if it has one."""
        for q in self.consumers.get(tensor, []):
            if q.op_type == "QuantizeLinear" and q.input[1] in self.inits:
                scale = float(numpy_helper.to_array(self.inits[q.input[1]]).reshape(-1)[0])
                zp = self.inits.get(q.input[2]) if len(q.input) > 2 else None
                return encoding_range(scale, zp if zp is not None else UINT8_ZERO)
        return None


def _unquantize(idx: _Index, tensor: str) -> None:
    """Drops the Q->DQ pairs after `tensor`: every non-graph-output reader reads it directly."""
    for q in [c for c in idx.consumers.get(tensor, []) if c.op_type == "QuantizeLinear"]:
        for dq in [c for c in idx.consumers.get(q.output[0], []) if c.op_type == "DequantizeLinear"]:
            for reader in idx.consumers.get(dq.output[0], []):
                for k, name in enumerate(reader.input):
                    if name == dq.output[0]:
                        reader.input[k] = tensor


def _residual_adds(idx: _Index) -> list[onnx.NodeProto]:
    """Adds one of whose inputs also feeds an RMSNorm (x + attn(norm(x)), h + mlp(norm(h)))."""
    found = []
    for node in idx.model.graph.node:
        if node.op_type != "Add":
            continue
        for name in node.input:
            if any(r.op_type in NORM_OPS for r in idx.readers(idx.source(name))):
                found.append(node)
                break
    return found


def _const_value(model: onnx.ModelProto, dq: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> np.ndarray:
    """A DequantizeLinear of initializers, evaluated by onnxruntime (int4 blocks, per-axis, per-tensor)."""
    import onnxruntime as ort

    graph = helper.make_graph([dq], "dq", [], [helper.make_tensor_value_info(dq.output[0], onnx.TensorProto.FLOAT, None)],
                              [inits[i] for i in dq.input if i in inits])
    single = helper.make_model(graph, opset_imports=model.opset_import)
    single.ir_version = model.ir_version
    sess = ort.InferenceSession(single.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {})[0].astype(np.float32)


def _l2_norm(idx: _Index, norm: onnx.NodeProto, max_abs: float) -> list[onnx.NodeProto]:
    """x*c / ReduceL2(x*c) * (gamma*sqrt(N)) in place of SimplifiedLayerNormalization(x, gamma)."""
    g = idx.model.graph
    gamma_name = norm.input[1]
    gdq = idx.producer.get(gamma_name)
    if gdq is not None and gdq.op_type == "DequantizeLinear":
        gamma = _const_value(idx.model, gdq, idx.inits)
    else:
        gamma = numpy_helper.to_array(idx.inits[gamma_name]).astype(np.float32)
    n = gamma.shape[-1]
    c = 2.0 ** -max(0, int(np.ceil(np.log2(max(max_abs, 1e-6) / PRESCALE_MAX))))
    x, out, base = norm.input[0], norm.output[0], norm.name or norm.output[0]
    names = {k: f"{base}/l2_{k}" for k in ("c", "gamma", "axes", "xs", "l2", "unit")}
    g.initializer.extend([numpy_helper.from_array(np.array(c, np.float32), names["c"]),
                          numpy_helper.from_array((gamma * np.sqrt(n)).astype(np.float32), names["gamma"]),
                          numpy_helper.from_array(np.array([-1], np.int64), names["axes"])])
    return [helper.make_node("Mul", [x, names["c"]], [names["xs"]], name=f"{base}/prescale"),
            helper.make_node("ReduceL2", [names["xs"], names["axes"]], [names["l2"]], keepdims=1, name=f"{base}/l2"),
            helper.make_node("Div", [names["xs"], names["l2"]], [names["unit"]], name=f"{base}/unit"),
            helper.make_node("Mul", [names["unit"], names["gamma"]], [out], name=f"{base}/gamma")]


def _outliers(idx: _Index, ratio: float, kv: set[str]) -> list[str]:
    """Quantized tensors whose calibrated range exceeds `ratio` x the median range of their role
    (the same producer name with the layer index wildcarded) over the graph's layers."""
    roles: dict[str, list[tuple[str, float]]] = {}
    for node in idx.model.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") or not node.output:
            continue
        t = node.output[0]
        if t in kv or t in idx.outputs:
            continue
        rng = idx.encoding_range(t)
        if rng is None:
            continue
        roles.setdefault(LAYER_INDEX.sub("#", node.name or t), []).append((t, max(abs(rng[0]), abs(rng[1]))))
    found = []
    for members in roles.values():
        if len(members) < 4:  # too few layers to call one of them an outlier
            continue
        typical = median(r for _, r in members)
        found += [t for t, r in members if r > ratio * typical]
    return found


def _float_weights(idx: _Index, floated: set[str]) -> int:
    """A node reading or writing a float tensor runs float: its DQ'd initializers become float constants."""
    g = idx.model.graph
    done = 0
    for node in list(g.node):
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") or floated.isdisjoint([*node.input, *node.output]):
            continue
        for k, name in enumerate(node.input):
            dq = idx.producer.get(name)
            if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in idx.inits:
                continue
            const = f"{name}/float"
            if const not in idx.inits:
                g.initializer.append(numpy_helper.from_array(_const_value(idx.model, dq, idx.inits), const))
                idx.inits[const] = g.initializer[-1]
                done += 1
            node.input[k] = const
    return done


def _sweep(model: onnx.ModelProto) -> None:
    """Removes QDQ nodes and initializers nothing reads any more."""
    g = model.graph
    while True:
        used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
        dead = [n for n in g.node if n.op_type in ("QuantizeLinear", "DequantizeLinear") and n.output[0] not in used]
        if not dead:
            break
        for n in dead:
            g.node.remove(n)
    used = {i for n in g.node for i in n.input}
    for init in [i for i in g.initializer if i.name not in used]:
        g.initializer.remove(init)


def float_residual(model: onnx.ModelProto, outlier_ratio: float, kv_tensors: set[str]) -> dict[str, Any]:
    """Rewrites a QDQ graph in place (see module doc). Returns what changed."""
    idx = _Index(model)
    adds = _residual_adds(idx)
    ranges = {a.output[0]: idx.encoding_range(a.output[0]) for a in adds}
    floated = {a.output[0] for a in adds}
    for t in floated:
        _unquantize(idx, t)
    outliers = _outliers(idx, outlier_ratio, kv_tensors) if outlier_ratio > 0 else []
    for t in outliers:
        ranges[t] = idx.encoding_range(t)
        _unquantize(idx, t)
    floated |= set(outliers)
    idx = _Index(model)
    norms = 0
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        if node.op_type in NORM_OPS and node.input[0] in floated:
            rng = ranges.get(node.input[0]) or (0.0, 1.0)
            nodes += _l2_norm(idx, node, max(abs(rng[0]), abs(rng[1])))
            norms += 1
        else:
            nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    idx = _Index(model)
    weights = _float_weights(idx, floated)
    _sweep(model)
    return {"residual_adds": len(adds), "norms": norms, "outliers": sorted(outliers), "float_weights": weights}


def has_float_tensors(quantization: dict[str, Any] | None) -> bool:
    """Whether a quantized artifact's graphs (its manifest `quantization` record) hold float tensors,
    which the HTP runs only in its fp16 mode."""
    by_graph = (quantization or {}).get("float_residual_by_graph") or {}
    return any(r["residual_adds"] or r["outliers"] for r in by_graph.values())
