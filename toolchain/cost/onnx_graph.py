"""Derive a GraphCost (weight bytes per layer, FLOPs, KV and I/O bytes) from an ONNX graph.

Rules, chosen so the numbers mean "bytes the NPU reads in one call":
- A weight is an initializer. Its layer is the index in its name ('model.layers.3.mlp...',
  'layers_3_...', 'h.3.', 'blocks.3.') or, for names the exporter invented ('val_105' for a
  pre-transposed weight), the one index in the names of the nodes that read it
  ('layers.0.mlp.gate_proj/MatMul'); anything else is shared (lm_head, final norm).
- An initializer read only through Gather (embedding tables, also behind DequantizeLinear)
  costs only the gathered rows, not the whole table; a tied lm_head that also feeds a
  MatMul costs the whole table.
- FLOPs: MatMul/Gemm/MatMulNBits = 2 x numel(output) x K; Conv = 2 x numel(output) x
  Cin/group x kernel. Attention MatMuls between activations count when shapes are known.
  Elementwise ops are ignored (they are a rounding error next to the matmuls).
- KV bytes: inputs/outputs named past_/new_/present_ key/value; other I/O is io_bytes.
- Precision: the widest QuantizeLinear activation type (16-bit -> int16, 8-bit -> int8);
  a float graph runs as fp16 on HTP, so its float32 weights count 2 bytes per element there
  (graph inputs/outputs keep their ONNX types: the runtime feeds them as declared).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import onnx_ir as ir

from toolchain.cost.model import DeviceProfileError, GraphCost

_LAYER_RE = re.compile(r"(?:^|[./_:])(?:layers|layer|h|blocks|block)[._](\d+)(?=[._/:]|$)")
_KV_RE = re.compile(r"(past|new|present)[._]?(key|value)|past_key_values|present\.", re.IGNORECASE)
_PASS_THROUGH = {"DequantizeLinear", "Cast", "Identity", "Reshape", "Transpose", "Squeeze", "Unsqueeze"}
_WIDTH_INPUTS = ("input_ids", "inputs_embeds", "hidden", "hidden_states")


def layer_index(name: str) -> int | None:
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def _numel(shape: ir.Shape | None) -> int | None:
    if shape is None:
        return None
    n = 1
    for d in shape:
        if not isinstance(d, int):
            return None
        n *= d
    return n


def _value_bytes(v: ir.Value) -> int:
    n = _numel(v.shape)
    if n is None or v.dtype is None:
        return 0
    return math.ceil(n * v.dtype.itemsize)


def _const_shape(v: ir.Value | None) -> tuple[int, ...] | None:
    """Static shape of a value that is (or is derived only from) an initializer."""
    if v is None:
        return None
    if v.const_value is not None:
        return tuple(v.const_value.shape)
    if v.shape is not None and _numel(v.shape) is not None:
        return tuple(int(d) for d in v.shape)  # type: ignore[arg-type]
    return None


def _readers(v: ir.Value) -> list[tuple[ir.Node, int]]:
    """(node, input index) of the ops that really read v, looking through dequant/reshape ops."""
    out: list[tuple[ir.Node, int]] = []
    for node, idx in v.uses():
        if node.op_type in _PASS_THROUGH and idx == 0 and node.outputs:
            out.extend(_readers(node.outputs[0]))
        else:
            out.append((node, idx))
    return out


def _gathered_bytes(init: ir.Value, nbytes: int, width: int) -> int | None:
    """Bytes of an embedding-like table read per call, or None when it is read whole."""
    readers = _readers(init)
    if not readers or any(n.op_type != "Gather" or i != 0 for n, i in readers):
        return None
    shape = _const_shape(init)
    if not shape or shape[0] == 0:
        return None
    row = nbytes / shape[0]
    rows = 0
    for node, _ in readers:
        idx = node.inputs[1] if len(node.inputs) > 1 else None
        n = _numel(idx.shape) if idx is not None else None
        rows += n if n is not None else width
    return math.ceil(min(rows, shape[0]) * row)


def _owner_layer(name: str, init: ir.Value) -> int | None:
    idx = layer_index(name)
    if idx is not None:
        return idx
    found = {layer_index(node.name or "") for node, _ in _readers(init)}
    return found.pop() if len(found) == 1 else None


def _width(graph: ir.Graph) -> int:
    for key in _WIDTH_INPUTS:
        for v in graph.inputs:
            if v.name and key in v.name and v.shape is not None and len(v.shape) >= 2:
                d = v.shape[1]
                if isinstance(d, int):
                    return d
    return 1


def _node_flops(node: ir.Node, width: int) -> float:
    op = node.op_type
    out = node.outputs[0] if node.outputs else None
    out_n = _numel(out.shape) if out is not None else None
    if op in ("MatMul", "Gemm", "MatMulNBits"):
        a = node.inputs[0]
        b = node.inputs[1] if len(node.inputs) > 1 else None
        k: int | None = None
        if op == "MatMulNBits":
            attr = node.attributes.get("K")
            k = attr.as_int() if attr is not None else None
        elif a is not None and a.shape is not None and isinstance(a.shape[-1], int):
            k = a.shape[-1]
            if op == "Gemm" and (t := node.attributes.get("transA")) is not None and t.as_int():
                k = a.shape[0] if isinstance(a.shape[0], int) else None
        if k is None:
            bshape = _const_shape(b)
            if bshape is not None and len(bshape) >= 2:
                k = bshape[-2]
        if k is None:
            return 0.0
        if out_n is None:
            bshape = _const_shape(b)  # constant weight [K, N]: assume [1, width, K] activations
            if bshape is None or len(bshape) != 2:
                return 0.0
            n_out = bshape[1] if op != "MatMulNBits" else node.attributes["N"].as_int()
            out_n = width * n_out
        return 2.0 * out_n * k
    if op == "Conv" and out_n is not None:
        w = _const_shape(node.inputs[1])
        if w is None or len(w) < 2:
            return 0.0
        return 2.0 * out_n * math.prod(w[1:])
    return 0.0


def _precision(graph: ir.Graph) -> str:
    bits = 0
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if node.op_type != "QuantizeLinear":
            continue
        dt = None
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            dt = node.inputs[2].dtype
        if dt is None and node.outputs:
            dt = node.outputs[0].dtype
        if dt is not None:
            bits = max(bits, int(dt.itemsize * 8))
    if bits >= 16:
        return "int16"
    if bits >= 4:
        return "int8"
    return "fp16"


def graph_cost(model: ir.Model | str | Path, width: int | None = None, name: str = "") -> GraphCost:
    """GraphCost of one call of `model` (an onnx_ir model or an .onnx path)."""
    if not isinstance(model, ir.Model):
        path = Path(model)
        if not path.is_file():
            raise DeviceProfileError(f"cannot cost graph {path}: no such .onnx file")
        name = name or path.stem
        model = ir.load(path)
    graph = model.graph
    w = width or _width(graph)

    precision = _precision(graph)
    layers: dict[int, int] = {}
    shared = 0
    for init_name, init in graph.initializers.items():
        tensor = init.const_value
        if tensor is None:
            continue
        nbytes = int(tensor.nbytes)
        if precision == "fp16" and tensor.dtype == ir.DataType.FLOAT:
            nbytes //= 2  # HTP holds a float graph's weights in fp16
        gathered = _gathered_bytes(init, nbytes, w)
        if gathered is not None:
            nbytes = gathered
        idx = _owner_layer(init_name, init)
        if idx is None:
            shared += nbytes
        else:
            layers[idx] = layers.get(idx, 0) + nbytes

    flops = sum(_node_flops(n, w) for n in ir.traversal.RecursiveGraphIterator(graph))

    kv = io = 0
    for v in list(graph.inputs) + list(graph.outputs):
        if v.is_initializer():
            continue
        if v.name and _KV_RE.search(v.name):
            kv += _value_bytes(v)
        else:
            io += _value_bytes(v)

    return GraphCost(
        layer_weight_bytes=layers,
        shared_weight_bytes=shared,
        flops_per_token=flops / w,
        width=w,
        kv_bytes=kv,
        io_bytes=io,
        precision=precision,
        name=name,
    )
