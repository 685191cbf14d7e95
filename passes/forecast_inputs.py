"""forecast_inputs: m learned forecast embeddings as graph inputs (DS2D self-speculation).

DS2D lets the base model propose several future tokens in the pass that verifies the previous
proposal: after a token, the runtime appends m "forecast" rows whose input is not a token
embedding but a learned vector; row i's logits then guess the token i+1 steps after the one the
token's own row predicts. The vectors are trained by `mobc train forecast` (prefix tuning, base
frozen) and bound at run time, so training them again needs no recompile.

Rewrite rule: the embedding output e [1, N, C] (the value the `embed_tokens` scope hands to the
first layer, after any embedding scale) becomes
    e * (1 - ReduceSum(forecast_select, -1)) + forecast_select @ forecast_embeds
with new inputs forecast_embeds [m, C] and forecast_select [1, N, m] (row n one-hot on the
forecast slot it carries, all zero for an ordinary token). All-zero inputs give e * 1 + 0 = e
exactly, so verification and plain decoding see the base graph.
Requires: exactly one value leaves the `embed_tokens` scope.
Ensures: the first layer reads the mixed embedding; both inputs are used.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from pydantic import Field

from passes.base import GraphPass, PassConfig
from passes.registry import register
from toolchain.errors import PassError
from toolchain.ir.graph import add_initializer, new_node, scope, shape_of

EMBEDS_INPUT = "forecast_embeds"
SELECT_INPUT = "forecast_select"
MIX_SCOPE = "embed_tokens.forecast"


def embedding_output(model: ir.Model) -> ir.Value:
    outs = []
    for node in model.graph:
        if scope(node) != "embed_tokens":
            continue
        for o in node.outputs:
            if any(scope(u.node) != "embed_tokens" for u in o.uses()):
                outs.append(o)
    if len(outs) != 1:
        raise PassError(f"forecast_inputs: expected one embedding output leaving embed_tokens, found {len(outs)}; "
                        "run forecast_inputs on an exported step graph before passes that split it")
    return outs[0]


@register("forecast_inputs")
class ForecastInputs(GraphPass):
    runs_before = ("split_layers", "split_parts", "split_lm_head")

    class Config(PassConfig):
        m: int = Field(3, ge=1, le=16, description="forecast embeddings (future tokens proposed per token)")

    def rewrite(self, model: ir.Model) -> bool:
        graph = model.graph
        if any(v.name == EMBEDS_INPUT for v in graph.inputs):
            raise PassError("forecast_inputs: the graph already has forecast inputs; list the pass once")
        e = embedding_output(model)
        shape = shape_of(e)  # [1, N, C]
        m, c = self.config.m, shape[-1]
        f32 = ir.DataType.FLOAT
        embeds = ir.Value(name=EMBEDS_INPUT, shape=ir.Shape([m, c]), type=ir.TensorType(f32))
        select = ir.Value(name=SELECT_INPUT, shape=ir.Shape([*shape[:-1], m]), type=ir.TensorType(f32))
        graph.inputs.extend([embeds, select])
        readers = [(u.node, u.idx) for u in e.uses()]
        after = e.producer()
        axes = add_initializer(graph, f"{MIX_SCOPE}.axes", np.array([-1], np.int64))
        one = add_initializer(graph, f"{MIX_SCOPE}.one", np.array(1.0, np.float32))
        row = [*shape[:-1], 1]
        n1 = new_node(graph, None, "ReduceSum", [select, axes], f"{MIX_SCOPE}/ReduceSum", {"keepdims": 1},
                      row, f32, after=after)
        n2 = new_node(graph, None, "Sub", [one, n1.outputs[0]], f"{MIX_SCOPE}/Sub", shape=row, dtype=f32, after=n1)
        n3 = new_node(graph, None, "Mul", [e, n2.outputs[0]], f"{MIX_SCOPE}/Mul", shape=shape, dtype=f32, after=n2)
        n4 = new_node(graph, None, "MatMul", [select, embeds], f"{MIX_SCOPE}/MatMul", shape=shape, dtype=f32,
                      after=n3)
        n5 = new_node(graph, None, "Add", [n3.outputs[0], n4.outputs[0]], f"{MIX_SCOPE}/Add", shape=shape,
                      dtype=f32, after=n4)
        for node, idx in readers:
            node.replace_input_with(idx, n5.outputs[0])
        return True

    def ensures(self, model: ir.Model) -> None:
        ins = {v.name: v for v in model.graph.inputs}
        assert ins[EMBEDS_INPUT].uses() and ins[SELECT_INPUT].uses(), "forecast inputs unused"
        mixed = [n for n in model.graph if n.name == f"{MIX_SCOPE}/Add"]
        assert mixed and all(scope(u.node).startswith("layers.0") for u in mixed[0].outputs[0].uses()), \
            "the first layer does not read the forecast-mixed embedding"
