"""Keep weights that already sit on a block quantization grid exact.

The real models mobc compiles offline come from GGUF files: SmolLM2's linear layers are Q4_1
(per block of 32 input elements: w = d*q + m, q in 0..15) and its embedding is Q8_0 (w = d*q,
q in -127..127). Requantizing such a weight with a fresh symmetric int4 grid rounds every element
a second time, which is where most of a W4 scheme's perplexity loss came from. If the source grid
is reused instead, the int4 graph computes the very weights the float graph does:

    w = d*q + m = d*k + c      with k = q - 8 in -8..7 (symmetric int4) and c = m + 8d per block

so   x @ W = x @ (d*k)  +  blocksum(x) @ C,    C[b, o] = c of block b, output o.

The first term is a symmetric block-int4 weight with scale d (exact); the second is two tiny
MatMuls (x @ S with S the 0/1 block indicator, then @ C), 1/32 of the main MatMul's work. Q4_0 and
Q8_0 grids are symmetric already (c = 0) and need no offset branch.

Flow: `split_grid_weights` rewrites the float graph before onnxruntime quantizes it and returns
the exact integer codes; `write_exact_codes` replaces onnxruntime's rounded codes and scales with
them afterwards and checks that DequantizeLinear now reproduces the source weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import onnx
from onnx import helper, numpy_helper

from toolchain.ir.block_grid import GridFit, fit_block_grid

__all__ = ["GridFit", "fit_block_grid"]  # re-exported: the quantizer and its tests import them here

NUMPY_INT = {"int4": ml_dtypes.int4, "int8": np.int8}


@dataclass
class GridWeight:
    fit: GridFit
    node: str
    indicator: str | None = None  # S initializer of the offset branch
    offset: str | None = None  # C initializer

    @property
    def prefix(self) -> str:
        """Name prefix of the offset branch's nodes: the projection's, e.g. layers.0.mlp.down_proj."""
        return self.node.rpartition("/")[0] or self.node

    @property
    def nodes(self) -> set[str]:
        """The weight's MatMul and its offset branch's MatMuls."""
        return {self.node, f"{self.prefix}/blocksum", f"{self.prefix}/block_offset"}


def split_grid_weights(model: onnx.ModelProto, plans: dict[str, tuple[str, str, int]]) -> dict[str, GridWeight]:
    """Rewrites MatMul weights that fit their source grid; `plans` maps weight name -> (node, dtype, block).

    Returns the fitted weights (by initializer name) for `write_exact_codes`. Off-grid weights are
    left alone (they are quantized the ordinary way).
    """
    inits = {i.name: i for i in model.graph.initializer}
    nodes = list(model.graph.node)
    fitted: dict[str, GridWeight] = {}
    out_nodes = []
    for node in nodes:
        out_nodes.append(node)
        if node.op_type != "MatMul" or node.input[1] not in plans or node.input[1] not in inits:
            continue
        _, dtype, block = plans[node.input[1]]
        w = numpy_helper.to_array(inits[node.input[1]])
        if w.ndim != 2:
            continue
        fit = fit_block_grid(w, block, dtype)
        if fit is None:
            continue
        gw = GridWeight(fit, node.name)
        fitted[node.input[1]] = gw
        if fit.offset is None:
            continue
        # y = x @ (d*k) + (x @ S) @ C; the symmetric part replaces W under W's name
        inits[node.input[1]].CopyFrom(numpy_helper.from_array(fit.symmetric(), node.input[1]))
        base, n_blocks = node.input[1], w.shape[0] // block
        gw.indicator, gw.offset = f"{base}.block_indicator", f"{base}.block_offset"
        indicator = np.kron(np.eye(n_blocks, dtype=np.float32), np.ones((block, 1), np.float32))
        model.graph.initializer.extend([numpy_helper.from_array(indicator, gw.indicator),
                                        numpy_helper.from_array(fit.offset, gw.offset)])
        prefix, y = gw.prefix, node.output[0]
        main = f"{y}.grid_main"
        node.output[0] = main
        out_nodes += [
            helper.make_node("MatMul", [node.input[0], gw.indicator], [f"{y}.blocksum"], name=f"{prefix}/blocksum"),
            helper.make_node("MatMul", [f"{y}.blocksum", gw.offset], [f"{y}.grid_offset"], name=f"{prefix}/block_offset"),
            helper.make_node("Add", [main, f"{y}.grid_offset"], [y], name=f"{prefix}/grid_add"),
        ]
    del model.graph.node[:]
    model.graph.node.extend(out_nodes)
    return fitted


def _dq_inputs(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    """DequantizeLinear node by the float tensor name it stands for (onnxruntime's W_quantized)."""
    return {n.input[0].removesuffix("_quantized"): n for n in model.graph.node
            if n.op_type == "DequantizeLinear" and n.input[0].endswith("_quantized")}


def set_initializer(inits: dict[str, onnx.TensorProto], name: str, arr: np.ndarray) -> None:
    """Overwrites initializer `name` (in the graph, through its proto) with `arr`."""
    inits[name].CopyFrom(numpy_helper.from_array(arr, name))


def write_exact_codes(model: onnx.ModelProto, fitted: dict[str, GridWeight], block: int) -> list[str]:
    """Overwrites onnxruntime's codes/scales of fitted weights with the exact ones and checks that
    DequantizeLinear now reproduces each source grid; returns the problems found."""
    inits = {i.name: i for i in model.graph.initializer}
    dq = _dq_inputs(model)
    problems = []
    for name, gw in fitted.items():
        node = dq.get(name)
        if node is None or node_attr(node, "block_size") != block or node_attr(node, "axis") != 0:
            problems.append(f"{name}: not block-quantized along the input axis with block {block}")
            continue
        codes = gw.fit.codes.astype(NUMPY_INT[gw.fit.dtype])
        if inits[node.input[0]].data_type != numpy_helper.from_array(codes).data_type:
            problems.append(f"{name}: quantized as another integer type than {gw.fit.dtype}")
            continue
        set_initializer(inits, node.input[0], codes)
        set_initializer(inits, node.input[1], gw.fit.scale)
        if len(node.input) > 2 and node.input[2]:
            set_initializer(inits, node.input[2], np.zeros(gw.fit.scale.shape, dtype=codes.dtype))
        if gw.indicator is not None:
            ind = dq.get(gw.indicator)
            if ind is None:
                problems.append(f"{gw.indicator}: the offset branch's indicator was not quantized")
                continue
            shape = tuple(inits[ind.input[1]].dims)
            old = numpy_helper.to_array(inits[ind.input[0]])
            set_initializer(inits, ind.input[0], (old.astype(np.float32) != 0).astype(np.int8).astype(old.dtype))
            set_initializer(inits, ind.input[1], np.ones(shape, np.float32))
            problems += _offset_per_channel(inits, dq.get(gw.offset), gw)
    for name, gw in fitted.items():
        want = gw.fit.symmetric()
        if name in dq and not np.allclose(dequantized(model, name), want, rtol=0,
                                          atol=1e-6 * float(np.abs(want).max() or 1.0)):
            problems.append(f"{name}: dequantized weight differs from the source grid")
    return problems


def _offset_per_channel(inits: dict[str, onnx.TensorProto], node: onnx.NodeProto | None, gw: GridWeight) -> list[str]:
    """Re-quantizes C [in/block, out] to symmetric int8 per output channel (axis 1, no blocks).

    onnxruntime block-quantizes every weight once a block size is set; C's blocks would either
    run along the output axis, which QNN HTP computes wrongly (measured: a Q4_1 tiny model's HTP
    logits off by 2.7, SmolLM2's by 35, argmax agreement 0%), or span fewer rows than one block
    along the input axis, which HTP rejects. Per-channel int8 on a MatMul weight runs correctly.
    """
    if node is None:
        return [f"{gw.offset}: the offset branch's weight was not quantized"]
    c = gw.fit.offset
    scale = (np.abs(c).max(0) / 127).astype(np.float32)
    scale[scale == 0] = 1.0
    set_initializer(inits, node.input[0], np.clip(np.round(c / scale), -127, 127).astype(np.int8))
    set_initializer(inits, node.input[1], scale)
    if len(node.input) > 2 and node.input[2]:
        set_initializer(inits, node.input[2], np.zeros(scale.shape, np.int8))
    del node.attribute[:]
    node.attribute.append(helper.make_attribute("axis", 1))
    return []


def node_attr(node: onnx.NodeProto, name: str) -> Any:
    """A node's attribute value, or None."""
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), None)


def dequantized(model: onnx.ModelProto, name: str) -> np.ndarray:
    """What a blocked or per-channel DequantizeLinear computes for weight `name` (symmetric: zero point 0)."""
    inits = {i.name: i for i in model.graph.initializer}
    node = _dq_inputs(model)[name]
    q = numpy_helper.to_array(inits[node.input[0]]).astype(np.float32)
    s = numpy_helper.to_array(inits[node.input[1]]).astype(np.float32)
    axis = node_attr(node, "axis") or 0
    block = node_attr(node, "block_size")
    if block is None:  # per channel along `axis` (the offset branch's C), or per tensor
        shape = [1] * q.ndim
        shape[axis] = -1
        return q * (s.reshape(shape) if s.size > 1 else s)
    return q * np.take(np.repeat(s, block, axis=axis), np.arange(q.shape[axis]), axis=axis)
