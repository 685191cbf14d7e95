"""simplify_layout: collapse the reshape/transpose chains that head splitting and NCHW leave.

Rewrite rules (onnxscript rewriter patterns, applied until nothing matches):
  - Transpose that only moves size-1 axes (the non-1 axes keep their order) -> Reshape
    (same element order; a Reshape is free on HTP, a Transpose moves data);
  - Reshape(Reshape(x)) -> Reshape(x)                 (onnxscript ReshapeReshape);
  - Transpose(Transpose(x)) -> one Transpose or x     (onnxscript TransposeTranspose);
  - Reshape to the shape x already has, identity Transpose -> x.
After mha_to_sha + linear_to_conv a decode head goes Conv [1,D,1,1] -> one Reshape instead of
Reshape -> Reshape -> Reshape -> Transpose.
Nodes the rewriter creates are renamed into the scope of the node they feed, so layer
prefixes (which split_layers relies on) survive.
Requires: static shapes.
Ensures: no Reshape feeds a Reshape, no Transpose feeds a Transpose, no Transpose only moves
  size-1 axes, no Reshape keeps its input's shape.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import IdentityEliminationPass, RemoveUnusedNodesPass
from onnxscript.rewriter import RewritePass
from onnxscript.rewriter._basics import MatchResult
from onnxscript.rewriter._rewrite_rule import RewriteRuleClassBase
from onnxscript.rewriter.rules.common import _basic_rules as basic

from passes.base import GraphPass, PassConfig
from passes.registry import register
from toolchain.ir.graph import mark_names_stale, scope, unique_node_name


def _static(value: ir.Value) -> list[int] | None:
    if value.shape is None or not value.shape.is_static():
        return None
    return [int(d) for d in value.shape]


def moves_only_unit_axes(shape: list[int], perm: list[int]) -> bool:
    kept = [p for p in perm if shape[p] != 1]
    return kept == sorted(kept)


class UnitTransposeToReshape(RewriteRuleClassBase):
    def pattern(self, op, x):
        return op.Transpose(x, _outputs=["out"])

    def check(self, context, x, out) -> MatchResult:
        result = MatchResult()
        perm = context.nodes[0].attributes.get("perm")
        shape, out_shape = _static(x), _static(out)
        if perm is None or shape is None or out_shape is None:
            return result.fail("no static shape or perm")
        if list(perm.as_ints()) == list(range(len(shape))) or not moves_only_unit_axes(
            shape, list(perm.as_ints())
        ):
            return result.fail("transpose reorders data")
        self._shape = np.array(out_shape, np.int64)
        self._name = f"{out.name}/shape"
        return result

    def rewrite(self, op, x, out):
        return op.Reshape(x, op.initializer(ir.tensor(self._shape, name=self._name), name=self._name))


class NoOpReshape(RewriteRuleClassBase):
    def pattern(self, op, x, shape):
        return op.Reshape(x, shape, _outputs=["out"])

    def check(self, context, x, shape, out) -> MatchResult:
        result = MatchResult()
        a, b = _static(x), _static(out)
        if a is None or a != b:
            return result.fail("reshape changes the shape")
        return result

    def rewrite(self, op, x, shape, out):
        return op.Identity(x)


RULES = [
    UnitTransposeToReshape.rule(),
    NoOpReshape.rule(),
    basic.reshape_reshape_rule,
    basic.transpose_transpose_rule,
    basic.no_op_transpose_rule,
]


def _skip_shared_reshapes(graph: ir.Graph) -> bool:
    """Reshape(Reshape(x)) -> Reshape(x) where the inner Reshape has other users too (the
    rewriter's rule leaves those alone: its match would orphan them); the inner one stays for them."""
    changed = False
    for node in graph:
        src = node.inputs[0].producer() if node.op_type == "Reshape" and node.inputs[0] is not None else None
        if src is not None and src.op_type == "Reshape" and _static(node.outputs[0]) is not None:
            node.replace_input_with(0, src.inputs[0])
            changed = True
    return changed


def simplify(model: ir.Model, max_rounds: int = 4) -> bool:
    before = set(model.graph)  # the nodes themselves (ids of freed nodes get reused)
    changed = False
    for _ in range(max_rounds):
        rewritten = RewritePass(RULES)(model).modified
        if not (_skip_shared_reshapes(model.graph) or rewritten):
            break
        changed = True
    if not changed:
        return False
    IdentityEliminationPass()(model)
    RemoveUnusedNodesPass()(model)
    mark_names_stale(model.graph)
    for node in model.graph:  # rewriter-made nodes are named node_<Op>_<k>: give them a scope
        if node in before:
            continue
        users = [u for o in node.outputs for u, _ in o.uses()]
        src = node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None
        near = next((n for n in [*users, src] if n is not None and scope(n)), None)
        node.name = unique_node_name(model.graph, f"{scope(near) if near else 'graph'}/{node.op_type}")
    return True


@register("simplify_layout")
class SimplifyLayout(GraphPass):
    class Config(PassConfig):
        pass

    def rewrite(self, model: ir.Model) -> bool:
        return simplify(model)

    def ensures(self, model: ir.Model) -> None:
        for node in model.graph:
            src = node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None
            if node.op_type in ("Reshape", "Transpose") and src is not None:
                assert src.op_type != node.op_type, f"{src.name} -> {node.name} not collapsed"
            shape = _static(node.inputs[0]) if node.inputs and node.inputs[0] is not None else None
            if node.op_type == "Transpose" and shape is not None:
                assert not moves_only_unit_axes(shape, list(node.attributes["perm"].as_ints())), node.name
            if node.op_type == "Reshape" and shape is not None:
                assert shape != _static(node.outputs[0]), f"no-op reshape {node.name}"
