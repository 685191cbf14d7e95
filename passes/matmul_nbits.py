"""matmul_nbits: projections whose weights sit on a GGUF block grid run as onnxruntime's CPU int4/int8
MatMulNBits, with the source's own codes (no second rounding).

Rewrite rules (blocks of `block_size` along the input axis):
  - `x @ W[C, O]` (W constant, or `Transpose(E)` of a constant E[O, C], a tied lm_head) where W
    fits a symmetric int4 grid (Q4_0: w = d*k, k in -8..7) -> `MatMulNBits(x, q = k + 8, d)`,
    bits 4 (its default zero point 8 makes the dequantized weight exactly d*k).
  - an asymmetric int4 grid (Q4_1: w = d*k + c per block) -> the same, plus
    `ReduceSum(blocks(x)) @ Cb` (Cb [C/block, O] the per-block offsets, 1/block of the work)
    added to its output: x @ W = x @ (d*k) + blocksum(x) @ Cb exactly in real arithmetic.
  - with `int8: true`, a weight on no int4 grid but on a symmetric int8 one (Q8_0: embeddings and
    lm_head) -> `MatMulNBits(x, q = k + 128, d)`, bits 8 (fast only with accuracy_level 4).
  - weights on no grid stay float MatMuls (a random-weight model has none on a grid), unless
    `round_bits` rounds them to a symmetric grid first (a draft head's trained weights: a second
    rounding, so never for a target).
`accuracy_level` is MatMulNBits' own: 0 computes in float32 (the float graph's semantics, the
default), 4 quantizes activations to int8 inside the kernel (faster, no longer exact).
`split_rows: R` runs graphs of at most R rows through the int8 kernel at float32 precision, their
activations split into three int8-exact parts (passes/activation_split.py).
`kernel_rows: R` runs the int4 projections of graphs of at most R rows as mobc's own `MatMulQ4`
(toolchain/kernels/: float32 activations, the Q4_1 offset inside the kernel, columns packed in groups
of four, GGUF's float16 scales kept as float16; several times level 0's speed on one row); it takes
precedence over split_rows for those graphs, and projections whose column count is no multiple of 4
keep MatMulNBits. `kernel_activations: int16` makes them `MatMulQ4I16` instead: each 32-block of an
activation row rounded to int16 on its own scale and exact integer dot products, faster, no longer
float32's arithmetic (the compile's checks decide).
Requires: MatMul weights (run it before linear_to_conv, or without it: this is the CPU form;
check_htp refuses com.microsoft ops). Ensures: no MatMul with a constant 2-D weight on a grid the
pass converts remains, and every MatMulNBits' packed codes match its K, N, bits and block size.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import onnx_ir as ir

from passes import activation_split
from passes.base import GraphPass, PassConfig
from passes.registry import register
from toolchain import kernels
from toolchain.ir.block_grid import GridFit, fit_block_grid
from toolchain.ir.graph import (
    add_initializer,
    const_array,
    linear_weight,
    new_node,
    remove_unused,
    scope,
    shape_of,
    take_over,
)

DOMAIN = "com.microsoft"
KERNEL_OPS = {"float32": "MatMulQ4", "int16": "MatMulQ4I16"}  # kernel_activations -> mobc.cpu op


def _weight(node: ir.Node) -> np.ndarray | None:
    """The [C, O] weight of a projection (blocks run along C, its input axis), or None."""
    found = linear_weight(node)
    return None if found is None else found[0].T


def _fit(w: np.ndarray, block: int, int8: bool, round_bits: int = 0) -> tuple[GridFit, int] | None:
    if w.dtype != np.float32 or w.shape[0] % block:
        return None
    fit = fit_block_grid(w, block, "int4")
    if fit is not None:
        return fit, 4
    if int8:
        fit = fit_block_grid(w, block, "int8")
        if fit is not None and fit.offset is None:
            return fit, 8
    if round_bits:
        return round_to_grid(w, block, round_bits), round_bits
    return None


def round_to_grid(w: np.ndarray, block: int, bits: int) -> GridFit:
    """W[C, O] rounded to the nearest point of a symmetric grid per block of `block` inputs (GGUF's
    Q8_0 for 8 bits; 4 bits: k in -7..7, d = max|w_b| / 7), the way llama.cpp quantizes a float
    tensor: a second rounding, for graphs whose outputs are guesses (a draft head), not exact ones."""
    top = (1 << (bits - 1)) - 1
    blocks = w.reshape(w.shape[0] // block, block, w.shape[1])
    d = np.abs(blocks).max(1) / top  # [C/block, O]
    safe = np.where(d > 0, d, 1.0)
    k = np.clip(np.rint(blocks / safe[:, None]), -top, top).astype(np.int8).reshape(w.shape)
    return GridFit(codes=k, scale=d.astype(np.float32), offset=None, dtype=f"int{bits}")


def pack_codes(codes: np.ndarray, bits: int, block: int) -> np.ndarray:
    """int codes [C, O] (k in -8..7 or -128..127) -> MatMulNBits' B: uint8 [O, C/block, block*bits/8]."""
    c, o = codes.shape
    q = (codes.astype(np.int16) + (1 << (bits - 1))).astype(np.uint8).T.reshape(o, c // block, block)
    if bits == 8:
        return np.ascontiguousarray(q)
    return np.ascontiguousarray(q[..., 0::2] | (q[..., 1::2] << 4))  # element 2i low nibble, 2i+1 high


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of pack_codes: uint8 q [O, C/block, block]."""
    if bits == 8:
        return packed
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), np.uint8)
    out[..., 0::2], out[..., 1::2] = packed & 0x0F, packed >> 4
    return out


def pack_q4_kernel(codes: np.ndarray) -> np.ndarray:
    """int4 codes [C, O] (k in -8..7, O a multiple of 4) -> MatMulQ4's packed uint8 [O/4, C/32, 4, 16]:
    per column block four 32-bit words, element e = 8k + j in word j % 4 at nibble 2k + (j >= 4), and
    a block of four columns side by side (toolchain/kernels/q4_matmul.h)."""
    c, o = codes.shape
    q = (codes.astype(np.int16) + 8).astype(np.uint32).T.reshape(o, c // kernels.BLOCK, kernels.BLOCK)
    e = np.arange(kernels.BLOCK)
    k, j = e // 8, e % 8
    shift = (4 * (2 * k + (j >= 4))).astype(np.uint32)
    words = np.zeros((o, c // kernels.BLOCK, 4), np.uint32)
    for i in range(kernels.BLOCK):
        words[..., j[i] % 4] |= q[..., i] << shift[i]
    per_column = words.astype("<u4").view(np.uint8)  # [O, C/32, 16]
    return np.ascontiguousarray(_grouped(per_column))


def unpack_q4_kernel(packed: np.ndarray) -> np.ndarray:
    """The inverse of pack_q4_kernel: uint8 q = k + 8 [O, C/32, 32]."""
    g, blocks = packed.shape[:2]
    per_column = np.ascontiguousarray(packed.transpose(0, 2, 1, 3)).reshape(g * kernels.GROUP, blocks, 16)
    words = per_column.view("<u4").astype(np.uint32)
    e = np.arange(kernels.BLOCK)
    k, j = e // 8, e % 8
    return ((words[..., j % 4] >> (4 * (2 * k + (j >= 4)))) & 0x0F).astype(np.uint8)


def _grouped(per_column: np.ndarray) -> np.ndarray:
    """[O, C/32, ...] -> [O/4, C/32, 4, ...]: each block's four columns of a group side by side."""
    o, blocks = per_column.shape[:2]
    grouped = per_column.reshape(o // kernels.GROUP, kernels.GROUP, blocks, *per_column.shape[2:])
    return np.swapaxes(grouped, 1, 2)


def q4_kernel_scales(scale: np.ndarray, offset: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """A grid's per-block scales and offsets [C/32, O] as MatMulQ4's [O/4, C/32, 4] inputs: float16
    when every value is one exactly (GGUF stores them so: half the bytes the kernel streams), else
    float32. W = d * k + c = d * (q - 8) + c for the codes q = k + 8."""
    c = np.zeros_like(scale) if offset is None else offset
    d16, c16 = scale.astype(np.float16), c.astype(np.float16)
    exact = (np.isfinite(d16).all() and np.isfinite(c16).all() and np.array_equal(d16.astype(np.float32), scale)
             and np.array_equal(c16.astype(np.float32), c))
    dtype = np.float16 if exact else np.float32
    return (np.ascontiguousarray(_grouped(scale.T.astype(dtype))),
            np.ascontiguousarray(_grouped(c.T.astype(dtype))))


def _q4_kernel(graph: ir.Graph, node: ir.Node, fit: GridFit, base: str, shape: list[int], op: str) -> ir.Value:
    """`x @ W` as mobc's MatMulQ4 (or MatMulQ4I16, the same inputs)."""
    scales, offsets = q4_kernel_scales(fit.scale, fit.offset)
    inputs = [node.inputs[0],
              add_initializer(graph, f"{base}.q4_codes", pack_q4_kernel(fit.codes)),
              add_initializer(graph, f"{base}.q4_scales", scales),
              add_initializer(graph, f"{base}.q4_offsets", offsets)]
    out = new_node(graph, node, op, inputs, f"{base}/{op}", None, shape, ir.DataType.FLOAT)
    out.domain = kernels.DOMAIN
    return out.outputs[0]


def _nbits_node(graph: ir.Graph, before: ir.Node, inputs: list[ir.Value], name: str, attrs: dict,
                shape: list[int]) -> ir.Node:
    node = new_node(graph, before, "MatMulNBits", inputs, name, attrs, shape, ir.DataType.FLOAT)
    node.domain = DOMAIN
    return node


def _convert(graph: ir.Graph, node: ir.Node, fit: GridFit, bits: int, block: int, level: int,
             split_rows: int, kernel_rows: int, kernel_op: str = "MatMulQ4") -> None:
    x, out = node.inputs[0], node.outputs[0]
    c, o = fit.codes.shape
    base = scope(node)
    lead = shape_of(x)[:-1]
    rows = math.prod(lead) if lead else 0  # 0: no rows axis (to stack split parts on), never narrow
    if (bits == 4 and block == kernels.BLOCK and c <= kernels.MAX_K and o % kernels.GROUP == 0
            and 0 < rows <= kernel_rows):
        take_over(out, _q4_kernel(graph, node, fit, base, shape_of(out), kernel_op), "float")
        graph.remove(node, safe=True)
        return
    b = add_initializer(graph, f"{base}.nbits_weight", pack_codes(fit.codes, bits, block))
    s = add_initializer(graph, f"{base}.nbits_scales", np.ascontiguousarray(fit.scale.T).reshape(-1))
    full = shape_of(out)
    split = level == 0 and 0 < rows <= split_rows
    xr = activation_split.blocked_view(graph, node, x, lead, c, block, base) if split or fit.offset is not None else None
    attrs = {"K": c, "N": o, "bits": bits, "block_size": block, "accuracy_level": 4 if split else level}
    if split:  # three int8-exact rows per row through the int8 kernel, then their outputs summed
        parts = activation_split.split_rows(graph, node, xr, lead, c, f"{base}/split")
        part_shape = lead[:-1] + [activation_split.PARTS * lead[-1], o]
        y = _nbits_node(graph, node, [parts, b, s], f"{base}/MatMulNBits", attrs, part_shape).outputs[0]
        y = activation_split.sum_parts(graph, node, y, lead, o, f"{base}/split")
    else:
        y = _nbits_node(graph, node, [x, b, s], f"{base}/MatMulNBits", attrs, full).outputs[0]
    if fit.offset is not None:
        axes = add_initializer(graph, "axes.last", np.array([-1], np.int64))
        cb = add_initializer(graph, f"{base}.block_offset", np.ascontiguousarray(fit.offset))
        sums = new_node(graph, node, "ReduceSum", [xr, axes], f"{base}/blocksum", {"keepdims": 0},
                        lead + [c // block], x.dtype).outputs[0]
        off = new_node(graph, node, "MatMul", [sums, cb], f"{base}/block_offset", None, full, x.dtype).outputs[0]
        y = new_node(graph, node, "Add", [y, off], f"{base}/with_offset", None, full, x.dtype).outputs[0]
    take_over(out, y, "float")
    graph.remove(node, safe=True)


@register("matmul_nbits")
class MatMulNBits(GraphPass):
    runs_before = ("linear_to_conv", "check_htp")

    class Config(PassConfig):
        block_size: int = 32  # GGUF's Q4_0 / Q4_1 / Q8_0 block
        # Q8_0 weights (the tied lm_head) as 8-bit MatMulNBits: on the CPU EP only fast at
        # accuracy_level 4 (measured, SmolLM2's lm_head, 1 thread: 0.03x float's speed at level 0,
        # 3.4x at level 4), so off by default
        int8: bool = False
        accuracy_level: int = 0  # 0: float32 compute (exact); 4: int8 activations in the kernel
        # at level 0, calls of at most this many rows (a decode graph's 1) run the int8 kernel on
        # their activations split into three int8-exact parts (passes/activation_split.py):
        # float32's precision at the int8 kernel's speed; wider calls do not gain. 0: off
        split_rows: int = 0
        # calls of at most this many rows (a decode graph's 1) run their int4 projections as mobc's
        # MatMulQ4 (toolchain/kernels/): float32 activations at ~2.5x level 0's speed on one row,
        # no split ops; at 8+ rows onnxruntime's dequantize-and-SGEMM path is as fast or faster.
        # Needs a C compiler at compile time (built once). 0: off
        kernel_rows: int = 0
        # the kernel's activations: float32 (MatMulQ4, the float model's arithmetic) or int16
        # (MatMulQ4I16: each 32-block of a row rounded to int16 on its own scale, error at most
        # max|x_b| / 65534 per element, exact integer dot products; ~1.5x MatMulQ4's speed)
        kernel_activations: Literal["float32", "int16"] = "float32"
        # weights on no grid rounded to a symmetric grid of this many bits per block (8: Q8_0, with
        # int8: true and accuracy_level 4 the fast int8 kernel; 4: k in -7..7) instead of staying
        # float: for draft heads, whose numbers need only be good guesses (the recipe's tolerance
        # and the bench's acceptance say how good). None: never round a second time
        round_bits: Literal[4, 8] | None = None

    def rewrite(self, model: ir.Model) -> bool:
        cfg = self.config
        changed = False
        for node in list(model.graph):
            found = _weight(node)
            fitted = _fit(found, cfg.block_size, cfg.int8, cfg.round_bits or 0) if found is not None else None
            if fitted is None:
                continue
            if cfg.kernel_rows and fitted[1] == 4:
                kernels.require("matmul_nbits: {kernel_rows: ...}")
            _convert(model.graph, node, fitted[0], fitted[1], cfg.block_size, cfg.accuracy_level,
                     cfg.split_rows, cfg.kernel_rows, KERNEL_OPS[cfg.kernel_activations])
            changed = True
        if changed:
            model.opset_imports.setdefault(DOMAIN, 1)
            if any(n.domain == kernels.DOMAIN for n in model.graph):
                model.opset_imports.setdefault(kernels.DOMAIN, kernels.OPSET)
            remove_unused(model)
        return changed

    def ensures(self, model: ir.Model) -> None:
        for node in model.graph:
            found = _weight(node)
            if found is not None and _fit(found, self.config.block_size, self.config.int8,
                                          self.config.round_bits or 0) is not None:
                raise AssertionError(f"MatMul {node.name} has a weight on a block grid and was not converted")
            if node.op_type in KERNEL_OPS.values() and node.domain == kernels.DOMAIN:
                packed, scales, offsets = (const_array(v) for v in node.inputs[1:4])
                groups, blocks = scales.shape[:2]
                if (packed.shape != (groups, blocks, kernels.GROUP, 16) or scales.shape != (groups, blocks, kernels.GROUP)
                        or offsets.shape != scales.shape or offsets.dtype != scales.dtype):
                    raise AssertionError(f"{node.name}: packed {packed.shape}, scales {scales.shape} {scales.dtype}, "
                                         f"offsets {offsets.shape} {offsets.dtype} disagree")
            if node.op_type == "MatMulNBits":
                a = {k: v.value for k, v in node.attributes.items()}
                packed = const_array(node.inputs[1])
                blob = a["block_size"] * a["bits"] // 8
                want = (a["N"], math.ceil(a["K"] / a["block_size"]), blob)
                if packed is None or packed.dtype != np.uint8 or packed.shape != want:
                    raise AssertionError(f"{node.name}: packed codes {None if packed is None else packed.shape}, "
                                         f"expected uint8 {want}")
