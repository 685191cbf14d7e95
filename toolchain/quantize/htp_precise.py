"""Attention products of a 16-bit QDQ graph in forms QNN HTP computes at 16-bit precision.

Measured on the emulated HTP (onnxruntime-qnn, soc 57 / v75) against numpy's QDQ arithmetic, error
in steps of the 16-bit output encoding (tests/toolchain/quantize/test_htp_precise.py):

    product                                        HTP MatMul    HTP Mul + ReduceSum   HTP split   CPU EP
    q @ k, both uint16 ([2,3,2,64] x [2,1,64,40])  207 steps     3 steps               8 steps     0 / 3
    q @ k, [1,9,128,64] x [1,9,64,256]             302 steps     (too large)           11 steps    0 / 3
    x @ int4 blocks of 32 (constant weight)         21 steps     (left as MatMul)      -           0*

With two 16-bit activation inputs the HTP's MatMul rounds its *second* input to 8 bits (snapping B to
an 8-bit grid beforehand brings 344 steps to 5; snapping A changes nothing); its Mul and ReduceSum
stay at 16 bits. A MatMul with a constant quantized weight is fine on the HTP (a 1x1 Conv form
measured the same 21 steps), so it stays.
(*) the CPU EP is exact only with QDQ_EXACT (artifact/qdq_arithmetic.py): by default it fuses the int4
weights into MatMulNBits with int8 activations, 223 steps off — that, not the HTP, was most of the
W4A16 binaries' distance from their "CPU simulation" (per-tensor localisation in issue 21's note).

`precise_products` rewrites every MatMul of two 16-bit activations, exactly in real arithmetic:
- where the products stay small (decode and tree attention): A [b1, b2, M, K] @ B [c1, c2, K, N] ->
  Mul of A as [b1, b2*M, K, 1] and B (broadcast; GQA's c2 = 1 lets M rows fold into the head axis)
  -> ReduceSum over K -> Reshape [b1, b2, M, N]. The products get a 16-bit encoding over the bound
  max|A| * max|B| of the inputs' encodings; each Reshape sits between a DequantizeLinear and a
  QuantizeLinear of one encoding, so every tensor keeps a single encoding.
- otherwise (a 128-row prefill: ~1e7 products per head group): B split on an 8-bit grid,
  A @ B = A @ B_hi + A @ B_lo, B_hi = B on the uint8 grid of B's range (scale x257), B_lo = B - B_hi,
  an integer number of B's steps in [-128, 128], as uint8 at B's own scale. Both second inputs are
  8-bit, which the HTP keeps; twice the MatMul work instead of a Mul intermediate of every product.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from toolchain.quantize.graph_index import GraphIndex
from toolchain.quantize.lpbq import activation_bits

PRODUCT_BUDGET = 1 << 22  # elements of a Mul+ReduceSum intermediate (decode attention: ~3e5); beyond: split


class _Graph(GraphIndex):
    """The indexes a rewrite needs, and the new nodes it queues in place of old ones."""

    def __init__(self, model: onnx.ModelProto):
        super().__init__(model)
        self.shapes = _static_shapes(model)
        self.replaced: dict[int, list[onnx.NodeProto]] = {}

    def constant(self, name: str, arr: np.ndarray) -> str:
        self.model.graph.initializer.append(numpy_helper.from_array(arr, name))
        self.inits[name] = self.model.graph.initializer[-1]
        return name

    def qdq_matmul(self, mm: onnx.NodeProto) -> tuple[onnx.NodeProto, onnx.NodeProto] | None:
        """(the Q before input 0's DequantizeLinear, the Q after the MatMul) when mm sits in the QDQ
        pattern onnxruntime's quantizer writes, with 16-bit input 0 and a static output shape."""
        xdq = self.producer.get(mm.input[0])
        outs = self.consumers.get(mm.output[0], [])
        if (activation_bits(xdq, self.inits) or 0) < 16 or len(outs) != 1 or outs[0].op_type != "QuantizeLinear":
            return None
        xq = self.producer.get(xdq.input[0])
        if xq is None or xq.op_type != "QuantizeLinear" or mm.output[0] not in self.shapes:
            return None
        return xq, outs[0]

    def requantized(self, name: str, like: onnx.NodeProto, base: str) -> tuple[onnx.NodeProto, onnx.NodeProto]:
        """Q/DQ of `name` with the encoding (and attributes) of QuantizeLinear `like`."""
        enc = list(like.input[1:])
        attrs = [a for a in like.attribute if a.name != "axis"]
        q = helper.make_node("QuantizeLinear", [name, *enc], [f"{base}_q"], name=f"{base}_q")
        dq = helper.make_node("DequantizeLinear", [f"{base}_q", *enc], [f"{base}_dq"], name=f"{base}_dq")
        q.attribute.extend(attrs)
        dq.attribute.extend(attrs)
        return q, dq

    def step(self, nodes: list[onnx.NodeProto], node: onnx.NodeProto, like: onnx.NodeProto) -> str:
        """Appends node and a Q/DQ of its output in `like`'s encoding; returns the dequantized name."""
        nodes.append(node)
        q, dq = self.requantized(node.output[0], like, node.name)
        nodes.extend([q, dq])
        return dq.output[0]

    def reshape(self, src: str, shape: list[int], out: str, base: str) -> onnx.NodeProto:
        return helper.make_node("Reshape", [src, self.constant(f"{base}_shape", np.array(shape, np.int64))], [out],
                                name=base)

    def commit(self) -> None:
        if not self.replaced:
            return
        nodes = []
        for node in self.model.graph.node:
            nodes.extend(self.replaced.get(id(node), [node]))
        del self.model.graph.node[:]
        self.model.graph.node.extend(nodes)


def _static_shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    """Tensor name -> fully static shape, from shape inference (initializer dims suffice)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    shapes = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output) + list(inferred.graph.input):
        if vi.type.tensor_type.HasField("shape"):
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in vi.type.tensor_type.shape.dim]
            if dims and min(dims) > 0:
                shapes[vi.name] = dims
    return shapes


def _encoding(g: _Graph, q: onnx.NodeProto) -> tuple[float, int]:
    """(scale, zero point) of a per-tensor QuantizeLinear."""
    scale = float(numpy_helper.to_array(g.inits[q.input[1]]).reshape(-1)[0])
    return scale, int(numpy_helper.to_array(g.inits[q.input[2]]).reshape(-1)[0])


def encoding_range(scale: float, zero_point: onnx.TensorProto) -> tuple[float, float]:
    """The real range [lo, hi] a per-tensor (scale, zero point) encoding represents."""
    zp = int(numpy_helper.to_array(zero_point).reshape(-1)[0])
    top = {TensorProto.UINT16: 65535, TensorProto.UINT8: 255, TensorProto.INT16: 32767,
           TensorProto.INT8: 127}[zero_point.data_type]
    bottom = 0 if zero_point.data_type in (TensorProto.UINT16, TensorProto.UINT8) else -top - 1
    return scale * (bottom - zp), scale * (top - zp)


def _bound(g: _Graph, q: onnx.NodeProto) -> float:
    """Largest |value| the encoding of QuantizeLinear q represents."""
    lo, hi = encoding_range(_encoding(g, q)[0], g.inits[q.input[2]])
    return max(abs(lo), abs(hi))


def _qdq(g: _Graph, nodes: list[onnx.NodeProto], src: str, base: str, scale: float, zero: np.generic) -> str:
    """Appends Q/DQ of `src` with a new per-tensor encoding; returns the dequantized name."""
    s = g.constant(f"{base}_scale", np.array(scale, np.float32))
    z = g.constant(f"{base}_zero", np.array(zero))
    nodes.append(helper.make_node("QuantizeLinear", [src, s, z], [f"{base}_q"], name=f"{base}_q"))
    nodes.append(helper.make_node("DequantizeLinear", [f"{base}_q", s, z], [f"{base}_dq"], name=f"{base}_dq"))
    return f"{base}_dq"


def _reduce_form(g: _Graph, mm: onnx.NodeProto, xq: onnx.NodeProto, yq: onnx.NodeProto, bq: onnx.NodeProto,
                 a4_shape: list[int], y_shape: list[int], base: str) -> tuple[list[onnx.NodeProto], float]:
    nodes: list[onnx.NodeProto] = []
    a4 = g.step(nodes, g.reshape(mm.input[0], a4_shape, f"{base}/prod_a", base=f"{base}/prod_a"), xq)
    mul = helper.make_node("Mul", [a4, mm.input[1]], [f"{base}/prod"], name=f"{base}/prod")
    bound = _bound(g, xq) * _bound(g, bq)
    nodes.append(mul)
    prod = _qdq(g, nodes, mul.output[0], f"{base}/prod", 2 * bound / 65535, np.uint16(32768))
    axes = g.constant(f"{base}/sum_axes", np.array([2], np.int64))
    red = helper.make_node("ReduceSum", [prod, axes], [f"{base}/sum"], keepdims=1, name=f"{base}/sum")
    nodes.append(g.reshape(g.step(nodes, red, yq), y_shape, mm.output[0], base=f"{base}/sum_back"))
    return nodes, bound


def _split_form(g: _Graph, mm: onnx.NodeProto, xq: onnx.NodeProto, yq: onnx.NodeProto, bq: onnx.NodeProto,
                k: int, base: str) -> tuple[list[onnx.NodeProto], float]:
    """A @ B_hi + A @ B_lo with both B parts on 8-bit grids that together hold B's 16-bit values."""
    step, zero = _encoding(g, bq)
    nodes: list[onnx.NodeProto] = []
    hi = _qdq(g, nodes, mm.input[1], f"{base}/b_hi", step * 257, np.uint8(np.clip(round(zero / 257), 0, 255)))
    nodes.append(helper.make_node("Sub", [mm.input[1], hi], [f"{base}/b_rest"], name=f"{base}/b_rest"))
    lo = _qdq(g, nodes, f"{base}/b_rest", f"{base}/b_lo", step, np.uint8(128))
    y_hi = g.step(nodes, helper.make_node("MatMul", [mm.input[0], hi], [f"{base}/y_hi"], name=f"{base}/y_hi"), yq)
    lo_bound = _bound(g, xq) * k * 128 * step
    nodes.append(helper.make_node("MatMul", [mm.input[0], lo], [f"{base}/y_lo"], name=f"{base}/y_lo"))
    y_lo = _qdq(g, nodes, f"{base}/y_lo", f"{base}/y_lo", 2 * lo_bound / 65535, np.uint16(32768))
    nodes.append(helper.make_node("Add", [y_hi, y_lo], [mm.output[0]], name=f"{base}/y"))
    return nodes, lo_bound


def precise_products(model: onnx.ModelProto, budget: int = PRODUCT_BUDGET) -> list[dict[str, Any]]:
    """Every MatMul of two 16-bit activations -> Mul + ReduceSum where its [B, M, K, N] products fit
    `budget` elements, else the 8-bit split of its second input (in place)."""
    g = _Graph(model)
    records = []
    for mm in list(model.graph.node):
        if mm.op_type != "MatMul" or mm.input[1] in g.inits:
            continue
        pattern = g.qdq_matmul(mm)
        bdq = g.producer.get(mm.input[1])
        if pattern is None or (activation_bits(bdq, g.inits) or 0) < 16:
            continue
        bq = g.producer.get(bdq.input[0])
        a_shape, b_shape, y_shape = (g.shapes.get(t) for t in (mm.input[0], mm.input[1], mm.output[0]))
        if bq is None or bq.op_type != "QuantizeLinear" or a_shape is None or b_shape is None:
            continue
        xq, yq = pattern
        base = mm.name or mm.output[0]
        (m, k), n = a_shape[-2:], b_shape[-1]
        products = int(np.prod(np.broadcast_shapes(tuple(a_shape[:-2]), tuple(b_shape[:-2])))) * m * k * n
        # A [b1, b2, M, K] -> [b1, b2*M, K, 1]; B [c1, c2, K, N] broadcasts against it (c2 == 1 when M > 1)
        foldable = len(a_shape) == 4 and len(b_shape) == 4 and (m == 1 or b_shape[1] == 1)
        if foldable and products <= budget:
            nodes, bound = _reduce_form(g, mm, xq, yq, bq, [a_shape[0], a_shape[1] * m, k, 1], y_shape, base)
            records.append({"matmul": mm.name, "form": "mul+reducesum", "products": products, "product_bound": bound})
        else:
            nodes, bound = _split_form(g, mm, xq, yq, bq, k, base)
            records.append({"matmul": mm.name, "form": "split", "products": products, "low_bound": bound})
        g.replaced[id(mm)] = nodes
    g.commit()
    return records
