"""Block-quantized weights in the forms QNN HTP accepts next to 8-bit activations.

Measured on the emulated HTP (onnxruntime-qnn, soc 57 / v75, a MatMul with a [128, 64] weight):

    weight form                                   uint8 activations   uint16 activations
    int4 blocks, float scale per block (BQ)       rejected            runs
    int8 blocks (BQ)                              rejected            runs
    int4 LPBQ: per-channel float scale x          runs (1 step)       runs
      4-bit integer scale (1..16) per block

LPBQ (Qualcomm's low-power block quantization) writes each block's scale as s_b = k_b * s_c with
s_c one float per output channel and k_b a 4-bit integer; onnxruntime-qnn recognises it as a
DequantizeLinear of the uint8 k's (scale s_c, axis 1) feeding the block scale input of the int4
weight's DequantizeLinear. `to_htp_forms` rewrites, in a QDQ graph, every MatMul whose activation
input is dequantized from 8 bits:
  - int4 block weights -> LPBQ. Not exact: a block scale moves to the nearest k_b * s_c (s_c = the
    channel's largest block scale / 16) and the codes are rounded again on the new scale, so a GGUF
    source grid is kept only where its scales land on that grid; the change per weight is recorded;
  - int8 block weights whose block scales are equal along each channel (source_grid's 0/1 block
    indicator) -> per-channel int8, exactly;
  - other int8 block weights -> an error naming the MatMul (give its input 16-bit activations).
MatMuls with 16-bit inputs keep their block weights (exact source grids).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from toolchain.errors import QuantizeError
from toolchain.quantize.source_grid import node_attr, set_initializer

LPBQ_LEVELS = 16  # 4-bit integer block scales 1..16 (4-bit codes expanded to 8 on the HTP)


def lpbq_scales(scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Block scales [blocks, out] -> (k uint8 [blocks, out] in 1..16, s_c float32 [out]) with k*s_c
    the nearest LPBQ scale (s_c: the channel's largest block scale / 16, so its largest block is exact)."""
    per_channel = (np.abs(scale).max(0) / LPBQ_LEVELS).astype(np.float32)
    per_channel[per_channel == 0] = 1.0
    k = np.clip(np.round(np.abs(scale) / per_channel), 1, LPBQ_LEVELS).astype(np.uint8)
    return k, per_channel


def activation_bits(dq_input: onnx.NodeProto | None, inits: dict[str, onnx.TensorProto]) -> int | None:
    """Bits of the integer tensor a DequantizeLinear reads (from its zero point's type)."""
    if dq_input is None or dq_input.op_type != "DequantizeLinear" or len(dq_input.input) < 3:
        return None
    zp = inits.get(dq_input.input[2])
    if zp is None:
        return None
    return {TensorProto.UINT8: 8, TensorProto.INT8: 8, TensorProto.UINT16: 16, TensorProto.INT16: 16}.get(zp.data_type)


def to_htp_forms(model: onnx.ModelProto) -> list[dict[str, Any]]:
    """Rewrites the block weights of 8-bit-input MatMuls in place (module docstring); one record each."""
    inits = {i.name: i for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    records = []
    new_nodes: list[tuple[onnx.NodeProto, onnx.NodeProto]] = []  # (before, node to insert)
    for mm in model.graph.node:
        if mm.op_type != "MatMul" or activation_bits(producer.get(mm.input[0]), inits) != 8:
            continue
        wdq = producer.get(mm.input[1])
        if wdq is None or wdq.op_type != "DequantizeLinear" or not node_attr(wdq, "block_size"):
            continue
        if wdq.input[0] not in inits or wdq.input[1] not in inits or node_attr(wdq, "axis") != 0:
            continue
        codes_t, scale_t = inits[wdq.input[0]], inits[wdq.input[1]]
        codes = numpy_helper.to_array(codes_t).astype(np.int32)
        scale = numpy_helper.to_array(scale_t).astype(np.float32)
        block = int(node_attr(wdq, "block_size"))
        if codes_t.data_type == TensorProto.INT8:
            if not np.all(scale == scale[:1]):
                raise QuantizeError(
                    f"MatMul {mm.name!r}: int8 block weights next to 8-bit activations have no QNN HTP form; "
                    "give the node's input 16-bit activations (a quantize.overrides entry) or int4 weights")
            set_initializer(inits, scale_t.name, scale[0])
            if len(wdq.input) > 2 and wdq.input[2] in inits:
                set_initializer(inits, wdq.input[2], np.zeros(scale.shape[1], np.int8))
            del wdq.attribute[:]
            wdq.attribute.append(helper.make_attribute("axis", 1))
            records.append({"matmul": mm.name, "weight": wdq.input[0], "form": "per-channel int8 (exact)"})
            continue
        if codes_t.data_type != TensorProto.INT4:
            continue
        w = codes * np.repeat(scale, block, axis=0)
        k, per_channel = lpbq_scales(scale)
        new_scale = k.astype(np.float32) * per_channel
        new_codes = np.clip(np.round(w / np.repeat(new_scale, block, axis=0)), -8, 7)
        err = np.abs(new_codes * np.repeat(new_scale, block, axis=0) - w)
        set_initializer(inits, codes_t.name, new_codes.astype(ml_dtypes.int4))
        base = scale_t.name
        k_name, s_name, z_name = f"{base}.lpbq_int", f"{base}.lpbq_channel", f"{base}.lpbq_zero"
        for name, arr in ((k_name, k), (s_name, per_channel), (z_name, np.zeros(per_channel.shape, np.uint8))):
            model.graph.initializer.append(numpy_helper.from_array(arr, name))
        model.graph.initializer.remove(scale_t)
        del inits[base]
        new_nodes.append((wdq, helper.make_node("DequantizeLinear", [k_name, s_name, z_name], [base], axis=1,
                                                name=f"{wdq.name}/lpbq_scale")))
        if len(wdq.input) < 3 or not wdq.input[2]:  # the LPBQ match reads int4 from the zero point's type
            zp = f"{wdq.input[0]}.zero"
            model.graph.initializer.append(helper.make_tensor(zp, TensorProto.INT4, scale.shape, [0] * scale.size))
            del wdq.input[2:]
            wdq.input.append(zp)
        records.append({"matmul": mm.name, "weight": wdq.input[0], "form": "lpbq int4",
                        "max_abs_change": float(err.max()), "rel_change": float(err.max() / max(np.abs(w).max(), 1e-12)),
                        "codes_changed": float((new_codes != codes).mean())})
    for before, node in new_nodes:
        nodes = list(model.graph.node)
        model.graph.node.insert(nodes.index(before), node)
    return records

