"""Float32-precise activations through MatMulNBits' int8 kernel: x as three int8-exact parts.

onnxruntime's MatMulNBits at accuracy_level 4 quantizes each row of its input to int8 per block
of `block` values (scale = the block's max |x| / 127, round to nearest) and runs integer dot
products: 3-4x faster than level 0's float32 path on a one-row call on this AVX2 CPU (SmolLM2's
gate/up, 576 x 3072: 93 vs 352 us), but 8 bits of activation is not the float model.

Rows that are already on that grid pass through the kernel's quantization unchanged, so the
graph hands the kernel three rows per row of x instead of one:
  hi  = s0 * round(x / s0),       s0 = max|x_b| / 127 per block  (on the kernel's grid: exact)
  mid = s1 * round(r / s1),       r = x - hi, s1 = max|r_b| / 127 (on the grid again: exact)
  lo  = r - mid                   (|lo| <= s1 / 2, quantized by the kernel: error <= s1 / 254)
and sums the three output rows. W @ (hi + mid + lo) = W @ x, and the only rounding left is the
kernel's on `lo`: max|x_b| * 2^-16 / 254 per value, float32's own order (measured on SmolLM2
shapes: 3e-7 of the output's range, like level 0's 2e-7; level 4 alone: 1.4e-2). The kernel's
cost grows little from one row to three, so a one-row call pays ~20 small ops for ~2x.
Wider calls do not gain (8 rows: 24 int8 rows cost more than level 0's 8), so the pass applies
this to graphs of few rows only.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from toolchain.ir.graph import add_initializer, new_node, shape_constant

PARTS = 3  # hi, mid, lo: two exact levels, then the kernel's own rounding on a 2^-16 remainder
_TINY = 1e-30  # an all-zero block has scale 0: lift it, so x / s stays 0 instead of NaN


def blocked_view(graph: ir.Graph, before: ir.Node, x: ir.Value, lead: list[int], k: int, block: int,
                 base: str) -> ir.Value:
    """x [*lead, k] as [*lead, k/block, block]."""
    shape = lead + [k // block, block]
    return new_node(graph, before, "Reshape", [x, shape_constant(graph, shape)], f"{base}/blocks", None, shape, x.dtype).outputs[0]


def _on_grid(graph: ir.Graph, before: ir.Node, r: ir.Value, shape: list[int], base: str) -> ir.Value:
    """r rounded to the int8 grid the kernel would put it on (its block scale, 127 levels)."""
    axes = add_initializer(graph, "axes.last", np.array([-1], np.int64))
    tiny = add_initializer(graph, "const.tiny_scale", np.array(_TINY, np.float32))
    levels = add_initializer(graph, "const.int8_levels", np.array(127, np.float32))
    scale_shape = shape[:-1] + [1]
    mag = new_node(graph, before, "Abs", [r], f"{base}/abs", None, shape, r.dtype).outputs[0]
    top = new_node(graph, before, "ReduceMax", [mag, axes], f"{base}/block_max", {"keepdims": 1}, scale_shape,
                   r.dtype).outputs[0]
    # + tiny leaves any block max above ~1e-23 as it is (so its largest value maps to 127 exactly)
    top = new_node(graph, before, "Add", [top, tiny], f"{base}/floored", None, scale_shape, r.dtype).outputs[0]
    inv = new_node(graph, before, "Div", [levels, top], f"{base}/inv_scale", None, scale_shape, r.dtype).outputs[0]
    q = new_node(graph, before, "Mul", [r, inv], f"{base}/codes", None, shape, r.dtype).outputs[0]
    q = new_node(graph, before, "Round", [q], f"{base}/round", None, shape, r.dtype).outputs[0]
    return new_node(graph, before, "Div", [q, inv], f"{base}/on_grid", None, shape, r.dtype).outputs[0]


def split_rows(graph: ir.Graph, before: ir.Node, blocks: ir.Value, lead: list[int], k: int,
               base: str) -> ir.Value:
    """[*lead, k/b, b] blocks of x -> [*lead[:-1], 3 * rows, k]: rows hi, then mid, then lo."""
    shape = [int(d) for d in blocks.shape]
    hi = _on_grid(graph, before, blocks, shape, f"{base}/hi")
    r = new_node(graph, before, "Sub", [blocks, hi], f"{base}/rest", None, shape, blocks.dtype).outputs[0]
    mid = _on_grid(graph, before, r, shape, f"{base}/mid")
    lo = new_node(graph, before, "Sub", [r, mid], f"{base}/lo", None, shape, blocks.dtype).outputs[0]
    axis = len(lead) - 1
    cat_shape = list(shape)
    cat_shape[axis] *= PARTS
    cat = new_node(graph, before, "Concat", [hi, mid, lo], f"{base}/parts", {"axis": axis}, cat_shape,
                   blocks.dtype).outputs[0]
    flat = lead[:-1] + [PARTS * lead[-1], k]
    return new_node(graph, before, "Reshape", [cat, shape_constant(graph, flat)], f"{base}/part_rows", None, flat,
                    blocks.dtype).outputs[0]


def sum_parts(graph: ir.Graph, before: ir.Node, y: ir.Value, lead: list[int], n: int, base: str) -> ir.Value:
    """[*lead[:-1], 3 * rows, n] -> [*lead, n]: each row's three parts added."""
    axis = len(lead) - 1
    if lead[-1] != 1:
        grouped = lead[:-1] + [PARTS, lead[-1], n]
        y = new_node(graph, before, "Reshape", [y, shape_constant(graph, grouped)], f"{base}/by_part", None, grouped, y.dtype).outputs[0]
    axes = add_initializer(graph, f"axes.{axis}", np.array([axis], np.int64))
    return new_node(graph, before, "ReduceSum", [y, axes], f"{base}/sum_parts", {"keepdims": int(lead[-1] == 1)},
                    lead + [n], y.dtype).outputs[0]
