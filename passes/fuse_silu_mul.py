"""fuse_silu_mul: a gated MLP's silu(gate) * up from the fused gate/up projection as one mobc op.

After fuse_projections a Llama-style MLP computes Split(h) -> gate, up; Sigmoid(gate); Mul(gate,
sigmoid) (or onnxruntime's QuickGelu(gate, alpha=1)); Mul(silu, up): four nodes of a few
microseconds' work each on a one-row step, whose dispatch costs more than the work.
`SiluMul(h)` (toolchain/kernels/layer_ops.c) computes the same in one call; its sigmoid comes from a
vectorized exp (~1 ulp), so the result moves by float32 rounding only.

A CPU pass (a mobc.cpu op; check_htp refuses it). Requires: the Split into two equal halves along the
last axis, each intermediate used only inside the pattern. Other activations (Gemma's GELU) are left
alone. Ensures: no such pattern remains.
"""

from __future__ import annotations

import onnx_ir as ir

from passes.base import GraphPass
from passes.registry import register
from toolchain import kernels
from toolchain.ir.graph import new_node, onnx_op, remove_unused, scope, shape_of, sole_reader


def _silu(gate: ir.Value) -> tuple[list[ir.Node], ir.Value] | None:
    """The nodes computing silu(gate) from gate (its only readers) and their result."""
    gelu = sole_reader(gate, "QuickGelu")
    if gelu is not None:
        alpha = gelu.attributes.get("alpha")
        return ([gelu], gelu.outputs[0]) if alpha is None or alpha.as_float() == 1.0 else None
    uses = [] if gate.is_graph_output() else [u.node for u in gate.uses()]
    if len(uses) != 2 or {u.op_type for u in uses} != {"Sigmoid", "Mul"}:
        return None
    sigmoid = next(u for u in uses if u.op_type == "Sigmoid")
    mul = next(u for u in uses if u.op_type == "Mul")
    if set(map(id, mul.inputs)) != {id(gate), id(sigmoid.outputs[0])} or sole_reader(sigmoid.outputs[0], "Mul") is not mul:
        return None
    return [sigmoid, mul], mul.outputs[0]


def _match(split: ir.Node) -> tuple[ir.Value, list[ir.Node], ir.Value] | None:
    """(h, the nodes SiluMul(h) replaces, their result)"""
    if len(split.outputs) != 2 or not onnx_op(split):
        return None
    try:
        shape = shape_of(split.inputs[0])
        halves = [shape_of(v)[-1] for v in split.outputs]
    except (ValueError, TypeError):
        return None
    axis = split.attributes.get("axis")
    if (axis.as_int() if axis is not None else 0) not in (-1, len(shape) - 1) or halves[0] != halves[1]:
        return None
    gate, up = split.outputs
    silu = _silu(gate)
    if silu is None:
        return None
    nodes, activated = silu
    product = sole_reader(activated, "Mul")
    if product is None or sole_reader(up, "Mul") is not product:
        return None
    return split.inputs[0], [split, *nodes, product], product.outputs[0]


@register("fuse_silu_mul")
class FuseSiluMul(GraphPass):
    runs_after = ("fuse_projections",)
    runs_before = ("check_htp",)

    def rewrite(self, model: ir.Model) -> bool:
        found = [m for node in model.graph if node.op_type == "Split" and (m := _match(node))]
        if not found:
            return False
        kernels.require("fuse_silu_mul")
        for h, nodes, result in found:
            node = new_node(model.graph, nodes[-1], "SiluMul", [h], f"{scope(nodes[-1]) or 'mlp'}/SiluMul", None,
                            shape_of(result), ir.DataType.FLOAT)
            node.domain = kernels.DOMAIN
            ir.convenience.replace_all_uses_with(result, node.outputs[0], replace_graph_outputs=True)
            for old in reversed(nodes):
                model.graph.remove(old, safe=True)
        model.opset_imports.setdefault(kernels.DOMAIN, kernels.OPSET)
        remove_unused(model)
        return True

    def ensures(self, model: ir.Model) -> None:
        left = [n.name for n in model.graph if n.op_type == "Split" and _match(n)]
        if left:
            raise AssertionError(f"gated MLPs {left[:3]} still run as Split, Sigmoid and two Muls")
