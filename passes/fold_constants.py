"""fold_constants: constant folding through onnxscript's optimizer, then dead-code removal.

Rewrite rules:
  - every node whose inputs are all constants is replaced by its computed output
    (onnxscript FoldConstantsPass), within `input_size_limit` / `output_size_limit` elements;
  - Identity nodes are removed (onnx_ir IdentityEliminationPass);
  - nodes whose outputs nothing uses, and unused initializers, are removed
    (onnx_ir RemoveUnusedNodesPass).
Requires: a model with static shapes (any opset).
Ensures: no node whose inputs are all small constants remains (`ensures` checks nodes whose
  inputs are all constants and within the size limits), no unused node, no unused initializer.

The default output limit keeps the tied-embedding transpose (lm_head = embeddingᵀ) unfolded on
real models, so the weight is not stored twice; linear_to_conv absorbs that transpose instead.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import IdentityEliminationPass, RemoveUnusedNodesPass
from onnxscript.optimizer import fold_constants

from passes.base import GraphPass, PassConfig
from passes.registry import register


@register("fold_constants")
class FoldConstants(GraphPass):
    class Config(PassConfig):
        input_size_limit: int = 8192  # elements of a constant input a folded node may read
        output_size_limit: int = 512 * 512  # elements a folded output may have

    def rewrite(self, model: ir.Model) -> bool:
        before = len(model.graph)
        fold_constants(
            model,
            input_size_limit=self.config.input_size_limit,
            output_size_limit=self.config.output_size_limit,
        )
        IdentityEliminationPass()(model)
        RemoveUnusedNodesPass()(model)
        return len(model.graph) != before

    def ensures(self, model: ir.Model) -> None:
        graph_outputs = set(model.graph.outputs)
        for node in model.graph:
            assert node.op_type != "Identity", f"Identity node {node.name} left"
            assert any(o.uses() or o in graph_outputs for o in node.outputs), f"unused node {node.name}"
            ins = [v for v in node.inputs if v is not None]
            if ins and all(v.const_value is not None for v in ins):
                small_in = all(v.const_value.size <= self.config.input_size_limit for v in ins)
                out_size = sum(_size(o) for o in node.outputs)
                assert not (small_in and out_size <= self.config.output_size_limit), (
                    f"foldable node {node.name} ({node.op_type}) left"
                )
        inputs = set(model.graph.inputs)
        for init in model.graph.initializers.values():
            assert init.uses() or init in graph_outputs or init in inputs, f"unused initializer {init.name}"


def _size(value: ir.Value) -> int:
    if value.shape is None or not value.shape.is_static():
        return 1 << 62
    n = 1
    for d in value.shape:
        n *= int(d)
    return n
