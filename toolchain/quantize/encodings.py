"""AIMET-style encodings JSON and the manifest's per-tensor scheme record, read back from a QDQ graph.

Reading the emitted graph (not the config that produced it) makes the JSON true by construction:
whatever onnxruntime decided (mixed-precision converts, QNN fixes) is what is recorded.

AIMET conventions (encodings format 0.6.1): offset is the integer that maps to real 0 with the sign
flipped, expressed on the *unsigned* grid: for uint with zero point zp, offset = -zp; for signed
symmetric b-bit, offset = -2**(b-1). min = offset*scale, max = min + (2**b - 1)*scale.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

BITS = {onnx.TensorProto.INT4: 4, onnx.TensorProto.UINT4: 4, onnx.TensorProto.INT8: 8, onnx.TensorProto.UINT8: 8,
        onnx.TensorProto.INT16: 16, onnx.TensorProto.UINT16: 16}
SIGNED = {onnx.TensorProto.INT4, onnx.TensorProto.INT8, onnx.TensorProto.INT16}


def _encoding(scale: float, zp: int, bits: int, signed: bool) -> dict[str, Any]:
    # signed grids are shifted onto the unsigned one: q_unsigned = q_signed + 2**(b-1)
    offset = -(1 << (bits - 1)) - zp if signed else -zp
    lo = offset * scale
    return {"bitwidth": bits, "dtype": "int", "is_symmetric": str(signed and zp == 0),
            "min": lo, "max": lo + ((1 << bits) - 1) * scale, "offset": int(offset), "scale": scale}


def _arr(inits: dict[str, onnx.TensorProto], consts: dict[str, np.ndarray], name: str,
         base_dir: str = "") -> np.ndarray | None:
    if name in consts:
        return consts[name]
    if name in inits:
        return numpy_helper.to_array(inits[name], base_dir=base_dir)
    return None


def read_encodings(model: onnx.ModelProto, base_dir: str = "") -> dict[str, Any]:
    """{param_encodings, activation_encodings} of a QDQ graph; only scales and zero points are read."""
    inits = {i.name: i for i in model.graph.initializer}
    consts = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node
              if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"}
    params: dict[str, Any] = {}
    acts: dict[str, Any] = {}
    for node in model.graph.node:
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        scale = _arr(inits, consts, node.input[1], base_dir)
        zp_name = node.input[2] if len(node.input) > 2 else ""
        zp_init = inits.get(zp_name)
        if scale is None or zp_init is None:
            continue
        zp = numpy_helper.to_array(zp_init, base_dir=base_dir).astype(np.int64)
        bits, signed = BITS[zp_init.data_type], zp_init.data_type in SIGNED
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        scales = np.atleast_1d(scale).ravel()
        zps = np.broadcast_to(zp, np.atleast_1d(scale).shape).ravel()
        encs = [_encoding(float(s), int(z), bits, signed) for s, z in zip(scales, zps, strict=True)]
        if node.op_type == "DequantizeLinear" and node.input[0] in inits:
            name = node.input[0].removesuffix("_quantized")
            params[name] = encs
            if "block_size" in attrs:
                for e in encs:
                    e["block_size"] = int(attrs["block_size"])
                    e["axis"] = int(attrs.get("axis", 1))
        elif node.op_type == "QuantizeLinear":
            # graph outputs keep their name on the DQ; onnxruntime renames the Q's input
            acts[node.input[0].removesuffix("_QuantizeLinear_Input")] = encs
    return {"version": "0.6.1", "activation_encodings": acts, "param_encodings": params,
            "excluded_layers": [], "quantizer_args": {"activation_bitwidth": _mode_bits(acts),
                                                      "param_bitwidth": _mode_bits(params)}}


def _mode_bits(table: dict[str, Any]) -> int | None:
    bits = [e[0]["bitwidth"] for e in table.values()]
    return max(set(bits), key=bits.count) if bits else None


def write_encodings(onnx_path: Path, out: Path) -> dict[str, Any]:
    model = onnx.load(onnx_path, load_external_data=False)
    enc = read_encodings(model, str(onnx_path.parent))
    out.write_text(json.dumps(enc, indent=1) + "\n")
    return enc


def scheme_summary(enc: dict[str, Any]) -> dict[str, Any]:
    """Counts for the manifest: how many tensors at which bit width."""
    def count(table: dict[str, Any]) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in table.values():
            k = f"{e[0]['bitwidth']}-bit" + (" per-channel/block" if len(e) > 1 else "")
            out[k] = out.get(k, 0) + 1
        return out

    return {"params": count(enc["param_encodings"]), "activations": count(enc["activation_encodings"])}
