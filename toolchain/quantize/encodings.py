"""AIMET-style encodings JSON and the manifest's per-tensor scheme record, read back from a QDQ graph.

Reading the emitted graph (not the config that produced it) makes the JSON true by construction:
whatever onnxruntime decided (mixed-precision converts, QNN fixes) is what is recorded.

AIMET conventions (encodings format 1.0.0: one entry per tensor in a list, `enc_type` PER_TENSOR,
PER_CHANNEL or PER_BLOCK, `scale`/`offset` arrays): offset is the integer that maps to real 0 with
the sign flipped, expressed on the *unsigned* grid: for uint with zero point zp, offset = -zp; for
signed symmetric b-bit, offset = -2**(b-1). Beyond AIMET's keys, channel/block entries carry `axis`
and `scale_shape` (the DequantizeLinear scale's shape) so the arrays map back unambiguously.
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


def _short(values: np.ndarray) -> list[float]:
    """float32 values as the shortest decimals that round-trip (9 significant digits at most)."""
    return [float(v) for v in np.char.mod("%.9g", values.astype(np.float32))]


def _encoding(name: str, scale: np.ndarray, zp: np.ndarray, bits: int, signed: bool,
              attrs: dict[str, Any]) -> dict[str, Any]:
    """One AIMET 1.0.0 entry: a tensor's whole encoding, with scale/offset arrays (one per channel/block).

    One object per tensor, not per channel or block: a block-32 int4 graph has millions of blocks
    (the 0.6.1 layout, an object per block, made a 974 MB JSON for SmolLM2).
    """
    # signed grids are shifted onto the unsigned one: q_unsigned = q_signed + 2**(b-1)
    offset = (-(1 << (bits - 1)) - zp) if signed else -zp
    scales = np.atleast_1d(scale)
    enc_type = "PER_BLOCK" if "block_size" in attrs else ("PER_CHANNEL" if scales.size > 1 else "PER_TENSOR")
    entry: dict[str, Any] = {"name": name, "dtype": "INT", "enc_type": enc_type, "bw": bits,
                             "is_sym": bool(signed and not zp.any()),
                             "scale": _short(scales.ravel()), "offset": [int(o) for o in offset.ravel()]}
    if enc_type != "PER_TENSOR":
        entry["axis"] = int(attrs.get("axis", 1))
        entry["scale_shape"] = list(scales.shape)
    if enc_type == "PER_BLOCK":
        entry["block_size"] = int(attrs["block_size"])
    return entry


def _arr(inits: dict[str, onnx.TensorProto], consts: dict[str, np.ndarray], name: str,
         base_dir: str = "") -> np.ndarray | None:
    if name in consts:
        return consts[name]
    if name in inits:
        return numpy_helper.to_array(inits[name], base_dir=base_dir)
    return None


def read_encodings(model: onnx.ModelProto, base_dir: str = "") -> dict[str, Any]:
    """AIMET 1.0.0 {activation_encodings, param_encodings} lists of a QDQ graph (scales and zero points only)."""
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
        zp = np.broadcast_to(zp, np.atleast_1d(scale).shape)
        bits, signed = BITS[zp_init.data_type], zp_init.data_type in SIGNED
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "DequantizeLinear" and node.input[0] in inits:
            name = node.input[0].removesuffix("_quantized")
            params[name] = _encoding(name, scale, zp, bits, signed, attrs)
        elif node.op_type == "QuantizeLinear":
            # graph outputs keep their name on the DQ; onnxruntime renames the Q's input
            name = node.input[0].removesuffix("_QuantizeLinear_Input")
            acts[name] = _encoding(name, scale, zp, bits, signed, attrs)
    return {"version": "1.0.0", "activation_encodings": list(acts.values()), "param_encodings": list(params.values()),
            "excluded_layers": [], "quantizer_args": {"activation_bitwidth": _mode_bits(acts),
                                                      "param_bitwidth": _mode_bits(params)}}


def by_name(entries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{tensor name: entry} of an encodings list."""
    return {e["name"]: e for e in entries}


def _mode_bits(table: dict[str, Any]) -> int | None:
    bits = [e["bw"] for e in table.values()]
    return max(set(bits), key=bits.count) if bits else None


def write_encodings(onnx_path: Path, out: Path) -> dict[str, Any]:
    model = onnx.load(onnx_path, load_external_data=False)
    enc = read_encodings(model, str(onnx_path.parent))
    out.write_text(json.dumps(enc, separators=(",", ":")) + "\n")
    return enc


def scheme_summary(enc: dict[str, Any]) -> dict[str, Any]:
    """Counts for the manifest: how many tensors at which bit width."""
    def count(table: dict[str, Any]) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in table:
            k = f"{e['bw']}-bit" + {"PER_TENSOR": "", "PER_CHANNEL": " per-channel", "PER_BLOCK": " per-block"}[e["enc_type"]]
            out[k] = out.get(k, 0) + 1
        return out

    return {"params": count(enc["param_encodings"]), "activations": count(enc["activation_encodings"])}
