"""fuse_skip_rmsnorm: a residual Add feeding an RMSNorm as one SkipSimplifiedLayerNormalization.

After fuse_rmsnorm each layer adds its attention and its MLP output to the residual stream and
normalizes the sum right away:

    s = Add(a, b);  y = SimplifiedLayerNormalization(s, w)      (s also read by the next residual Add)
  -> y, _, _, s = SkipSimplifiedLayerNormalization(a, b, w)    (com.microsoft, output 3 is the sum)

one onnxruntime kernel and one pass over the row instead of two (SmolLM2: 60 pairs per step). The
sum is the same float32 addition; the norm is onnxruntime's (float32, as SimplifiedLayerNormalization).

A CPU pass (onnxruntime contrib op; check_htp refuses it). Requires: fuse_rmsnorm's nodes. Pairs whose
Add operands differ in shape (a broadcast) or whose norm weight is not a constant vector are left
alone. Ensures: no Add feeds a SimplifiedLayerNormalization it could fuse with.
"""

from __future__ import annotations

import onnx_ir as ir

from passes.base import GraphPass
from passes.registry import register
from toolchain.ir.graph import const_array, new_node, onnx_op, remove_unused, scope, shape_of, take_over

DOMAIN = "com.microsoft"


def _match(norm: ir.Node) -> ir.Node | None:
    """The Add whose sum `norm` normalizes, when the two can be one node."""
    if not onnx_op(norm, "SimplifiedLayerNormalization") or len(norm.outputs) != 1:
        return None
    add = norm.inputs[0].producer()
    if not onnx_op(add, "Add"):
        return None
    axis = norm.attributes.get("axis")
    weight = const_array(norm.inputs[1]) if len(norm.inputs) > 1 else None
    try:
        a, b, s = (shape_of(v) for v in (*add.inputs, add.outputs[0]))
    except (TypeError, ValueError):
        return None
    if a != b or a != s or weight is None or weight.ndim != 1 or weight.shape[0] != s[-1]:
        return None
    if axis is not None and axis.as_int() not in (-1, len(s) - 1):
        return None
    if any(v.const_value is not None for v in add.inputs):  # a constant operand: leave it to folding
        return None
    return add


@register("fuse_skip_rmsnorm")
class FuseSkipRmsnorm(GraphPass):
    runs_after = ("fuse_rmsnorm",)
    runs_before = ("check_htp",)

    def rewrite(self, model: ir.Model) -> bool:
        found = [(norm, add) for norm in model.graph if (add := _match(norm)) is not None]
        for norm, add in found:
            eps = norm.attributes.get("epsilon")
            attrs = {"epsilon": eps.as_float()} if eps is not None else {}
            # at the Add's place: whatever reads the sum comes after it
            node = new_node(model.graph, add, "SkipSimplifiedLayerNormalization", [*add.inputs, norm.inputs[1]],
                            f"{scope(norm) or 'norm'}/SkipSimplifiedLayerNormalization", attrs,
                            shape_of(norm.outputs[0]), norm.outputs[0].dtype, num_outputs=4)
            node.domain = DOMAIN
            total = node.outputs[3]
            total.shape, total.type = ir.Shape(shape_of(add.outputs[0])), ir.TensorType(add.outputs[0].dtype)
            for unused in node.outputs[1:3]:  # mean, inverse std: not wanted
                unused.name = ""
            take_over(norm.outputs[0], node.outputs[0], "unfused")
            take_over(add.outputs[0], total, "unfused")
        if found:
            model.opset_imports.setdefault(DOMAIN, 1)
            remove_unused(model)
        return bool(found)

    def ensures(self, model: ir.Model) -> None:
        left = [n.name for n in model.graph if _match(n) is not None]
        if left:
            raise AssertionError(f"norms {left[:3]} still read a separate residual Add")
