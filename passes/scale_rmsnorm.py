"""scale_rmsnorm: compute every RMSNorm on x·s with eps·s², so fp16 NPUs compile and run it.

Rewrite rule (matched on structure, per norm; the weight Mul after it is untouched):
    Pow(x, 2) -> ReduceMean -> Add(eps) -> Sqrt -> Reciprocal -> r;   Mul(x, r)
  becomes
    xs = x·s;   Mul(xs, xs) -> ReduceMean -> Add(eps·s²) -> Sqrt -> Reciprocal -> r';   Mul(x, r'·s)
  and x·r'·s = x / sqrt(mean(x²) + eps) exactly in real arithmetic, for any s > 0. The output
  multiplies the unscaled x by the per-row scalar r'·s = 1/rms (normal fp16 range): multiplying
  xs instead made the HTP lose the small entries of rows with one massive entry (see below).
  scale = "dynamic" (default): s = 1/mx per row, mx = clip(max|x| over the norm axis, 2^-14, 2^14),
    so |xs| <= 4 with a largest entry >= 1: no fp16 overflow, no underflow of what matters, at any
    magnitude (Abs, ReduceMax, Clip, Div nodes; eps' = (sqrt(eps)·s)²). CPU diff ~1e-6.
  scale = a power of two: a constant s (Mul), bit-exact on CPU, but squares of small-magnitude
    rows underflow fp16 (|x·s| < ~2e-3), which costs accuracy (measured below).
  Norms whose node names contain one of `unscaled` get s = 1 (only Pow -> Mul): the per-head q/k
  norms of Qwen3/Gemma3, whose inputs are O(1) by construction.

Why, measured with onnxruntime-qnn 2.7 (HTP emulation, soc 57 / v75, fp16 mode):
  - the Pow form of RMSNorm fails HTP finalize with QNN_COMMON_ERROR_MEM_ALLOC even in a 64-wide
    toy graph, fp16 or not; the Mul form finalizes;
  - SmolLM2's residual reaches |x| ~ 25k on the first (attention-sink) token, so x² overflows
    fp16. SmolLM2 decode (N=1, CL=512), max |logit - CPU| over 8 greedy steps: s = 1: 10-16;
    s = 2^-8: 0.3-2.2; dynamic: ~0.2-0.4, greedy tokens identical to CPU;
  - the HTP divides through a reciprocal and flushes fp16 subnormals: without the 2^14 clip,
    1/max|x| of the sink token became 0, zeroing its K/V from layer 12 on; SmolLM2 prefill
    (N=128) then matched CPU argmax on 18/37 prompt rows (max logit diff 25); with it, 37/37 (0.24).

Requires: RMSNorms as the torch dynamo exporter writes HF RMSNorm modules (above), float inputs.
Ensures: no Pow(·, 2) feeds a ReduceMean; every rewritten norm squares one value with
  '<scope>/Mul_square'; a scaled norm squares the output of '<scope>/Div_scale' (dynamic) or
  '<scope>/Mul_scale' (constant s) and outputs x·(1/rms) through '<scope>/Div_rms' / '/Mul_rms'.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import onnx_ir as ir
from pydantic import field_validator

from passes.base import GraphPass, PassConfig
from passes.registry import register
from toolchain.ir.graph import add_initializer, const_array, new_node, remove_unused, scope


def _sole_use(value: ir.Value, op_type: str) -> ir.Node | None:
    uses = list(value.uses())
    if len(uses) == 1 and uses[0].node.op_type == op_type:
        return uses[0].node
    return None


def _scalar(value: ir.Value | None) -> float | None:
    arr = const_array(value)
    return float(arr.reshape(-1)[0]) if arr is not None and arr.size == 1 else None


def match_rmsnorm(pow_node: ir.Node) -> dict | None:
    """The RMSNorm chain starting at Pow(x, 2), or None when pow_node does not start one."""
    if pow_node.op_type != "Pow" or _scalar(pow_node.inputs[1]) != 2.0:
        return None
    x = pow_node.inputs[0]
    mean = _sole_use(pow_node.outputs[0], "ReduceMean")
    add = mean and _sole_use(mean.outputs[0], "Add")
    if add is None or mean.inputs[0] is not pow_node.outputs[0]:
        return None
    eps_index = 1 if add.inputs[0] is mean.outputs[0] else 0
    if _scalar(add.inputs[eps_index]) is None:
        return None
    sqrt = _sole_use(add.outputs[0], "Sqrt")
    recip = sqrt and _sole_use(sqrt.outputs[0], "Reciprocal")
    if recip is None:
        return None
    muls = [u.node for u in recip.outputs[0].uses()]
    # every use of the rsqrt must be Mul(x, r) with the same x, or the rescaling would leak
    if not muls or any(m.op_type != "Mul" or x not in m.inputs for m in muls):
        return None
    return {"x": x, "pow": pow_node, "mean": mean, "add": add, "eps_index": eps_index, "recip": recip,
            "muls": muls}


@register("scale_rmsnorm")
class ScaleRmsNorm(GraphPass):
    class Config(PassConfig):
        # "dynamic": s = 1/max|x| per row (see _dynamic); or a constant power of two (bit-exact)
        scale: float | Literal["dynamic"] = "dynamic"
        unscaled: list[str] = ["q_norm", "k_norm"]  # name parts of norms rewritten with s = 1

        @field_validator("scale")
        @classmethod
        def _power_of_two(cls, v: float | str) -> float | str:
            if v != "dynamic" and not (v > 0 and math.frexp(v)[0] == 0.5):
                raise ValueError(f"scale must be a positive power of two such as 0.00390625 (got {v})")
            return v

    def rewrite(self, model: ir.Model) -> bool:
        graph = model.graph
        matches = [m for node in list(graph) if (m := match_rmsnorm(node))]
        for m in matches:
            self._rewrite(graph, m)
        if matches:
            remove_unused(model)  # the shared exponent constant 2.0
        return bool(matches)

    def _rewrite(self, graph: ir.Graph, m: dict) -> None:
        x: ir.Value = m["x"]
        pow_node: ir.Node = m["pow"]
        where = scope(pow_node) or "rmsnorm"
        unscaled = any(part in where for part in self.config.unscaled)
        dtype = x.dtype or ir.DataType.FLOAT
        np_dtype = dtype.numpy()
        shape = list(x.shape) if x.shape is not None else None
        xs = x
        if not unscaled and self.config.scale != 1.0:
            if self.config.scale == "dynamic":
                xs, new_eps, per_row = self._dynamic(graph, m, where, dtype, shape)
            else:
                sc = float(self.config.scale)
                per_row = add_initializer(graph, f"rmsnorm.scale_{sc:g}", np.array(sc, dtype=np_dtype))
                xs = new_node(graph, pow_node, "Mul", [x, per_row], f"{where}/Mul_scale", shape=shape,
                              dtype=dtype).outputs[0]
                eps = const_array(m["add"].inputs[m["eps_index"]]).astype(np.float64) * sc * sc
                new_eps = add_initializer(graph, "rmsnorm.eps_scaled", eps.astype(np_dtype))
            m["add"].replace_input_with(m["eps_index"], new_eps)
            # r' = 1/rms(x·s), so 1/rms(x) = r'·s: a per-row scalar in fp16's normal range. The
            # output multiplies the *unscaled* x by it, so x·s (subnormal for small entries next
            # to a massive one) never reaches the output.
            recip: ir.Node = m["recip"]
            r = recip.outputs[0]
            op = "Div" if self.config.scale == "dynamic" else "Mul"
            inv = new_node(graph, None, op, [r, per_row], f"{where}/{op}_rms", shape=list(r.shape or []) or None,
                           dtype=dtype, after=recip).outputs[0]
            for mul in m["muls"]:
                for i, v in enumerate(mul.inputs):
                    if v is r:
                        mul.replace_input_with(i, inv)
        square = new_node(graph, pow_node, "Mul", [xs, xs], f"{where}/Mul_square", shape=shape, dtype=dtype)
        ir.convenience.replace_all_uses_with(pow_node.outputs[0], square.outputs[0])
        graph.remove(pow_node, safe=True)

    def _dynamic(self, graph: ir.Graph, m: dict, where: str, dtype: ir.DataType, shape: list | None):
        """xs = x / mx with mx = max(max|x| over the norm axes, 2^-14); eps' = (sqrt(eps) / mx)².

        Returns (xs, eps', mx); 1/rms(x) = r' / mx.

        x/mx lies in [-1, 1] and its largest square is 1, so mean(xs²) >= 1/width: neither overflow
        nor underflow, whatever the magnitude of x. The floor keeps an all-zero row finite and
        (sqrt(eps)/mx)² < 65504 in fp16.
        """
        x, pow_node, mean = m["x"], m["pow"], m["mean"]
        np_dtype = dtype.numpy()
        keep = mean.attributes.get_int("keepdims", 1)
        red_shape = None
        if shape is not None and keep:
            axes = const_array(mean.inputs[1]) if len(mean.inputs) > 1 else None
            rank = len(shape)
            red = {int(a) % rank for a in (axes if axes is not None else range(rank))}
            red_shape = [1 if i in red else d for i, d in enumerate(shape)]

        def node(op: str, inputs: list, suffix: str, out_shape) -> ir.Value:
            return new_node(graph, pow_node, op, inputs, f"{where}/{suffix}", shape=out_shape,
                            dtype=dtype).outputs[0]

        floor = add_initializer(graph, "rmsnorm.max_floor", np.array(2.0**-14, dtype=np_dtype))
        ceil = add_initializer(graph, "rmsnorm.max_ceil", np.array(2.0**14, dtype=np_dtype))
        eps = float(const_array(m["add"].inputs[m["eps_index"]]).reshape(-1)[0])
        root = add_initializer(graph, "rmsnorm.sqrt_eps", np.array(math.sqrt(eps), dtype=np_dtype))
        absx = node("Abs", [x], "Abs_scale", shape)
        red_inputs = [absx] + list(mean.inputs[1:2])
        mx = new_node(graph, pow_node, "ReduceMax", red_inputs, f"{where}/ReduceMax_scale",
                      attributes={"keepdims": keep}, shape=red_shape, dtype=dtype).outputs[0]
        mx = node("Clip", [mx, floor, ceil], "Clip_scale", red_shape)
        xs = node("Div", [x, mx], "Div_scale", shape)
        e = node("Div", [root, mx], "Div_eps", red_shape)
        return xs, node("Mul", [e, e], "Mul_eps", red_shape), mx

    def ensures(self, model: ir.Model) -> None:
        rms_scopes = {scope(n) for n in model.graph if n.name and ("/Div_rms" in n.name or "/Mul_rms" in n.name)}
        for node in model.graph:
            if node.op_type == "Pow" and _scalar(node.inputs[1]) == 2.0:
                uses = [u.node.op_type for u in node.outputs[0].uses()]
                assert "ReduceMean" not in uses, f"RMSNorm {node.name} still squares with Pow"
            if node.op_type == "Mul" and "/Mul_square" in (node.name or ""):
                a, b = node.inputs
                assert a is b, f"{node.name} does not square one value"
                where = scope(node)
                if not any(part in where for part in self.config.unscaled) and self.config.scale != 1.0:
                    producer = a.producer()
                    want = "/Div_scale" if self.config.scale == "dynamic" else "/Mul_scale"
                    assert producer is not None and want in (producer.name or ""), (
                        f"{node.name} squares an unscaled value"
                    )
                    assert where in rms_scopes, f"norm {where} does not output x·(1/rms)"
