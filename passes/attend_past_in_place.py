"""attend_past_in_place: attention reads the past K/V where they lie instead of concatenating a copy.

A step graph joins the past cache with its N new rows before attending:
    K = Concat(past_key, new_key, axis=-1);  s = q @ K;  ...;  p = Softmax(...);  o = p @ Concat(past_value, new_value)
so every call copies the whole cache of every layer (SmolLM2 decode, CL=512: 2 x 393 KB per layer,
24 MB per token, 9% of the int4 CPU step). Rewritten:
    s = Concat(q @ past_key, q @ new_key, axis=-1)   (the scores: N x CL per query head)
    o = p[..., :P] @ past_value + p[..., P:] @ new_value
which is the same in real arithmetic (each score is the same dot product; o's sum over the CL slots
is split in two). What is concatenated is then the score matrix, Hq*N*CL floats instead of
2*Hkv*D*CL: that is smaller only for narrow graphs, so the pass rewrites a layer only when
N*Hq < 2*Hkv*D (SmolLM2: N < 42; decode and tree widths, not a 128-row prefill). With
`every_width: true` it rewrites every width: for a recipe whose cache_attention then takes each
layer's attention over as one op, the score matrix is never materialized and the rule's reason is gone
(SmolLM2's 128-row prefill then attends through CacheAttention: README).

A CPU pass: NPU compilers place the cache themselves (the HTP graphs keep the Concat form).
Requires: attention as the exporter writes it (the two Concats feed one MatMul each, on its second
input; the value MatMul's first input is the Softmax output). Ensures: in a graph of a width the
rule admits, no Concat of a past_key_* / past_value_* input feeds attention any more.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from passes.base import GraphPass, PassConfig
from passes.registry import register
from toolchain.ir.graph import add_initializer, new_node, remove_unused, scope, shape_of


def _sole_matmul(value: ir.Value, input_index: int) -> ir.Node | None:
    uses = list(value.uses())
    if len(uses) == 1 and uses[0].node.op_type == "MatMul" and uses[0].idx == input_index:
        return uses[0].node
    return None


def _past_concat(node: ir.Node, prefix: str, axis: int) -> tuple[ir.Value, ir.Value] | None:
    """(past, new) when node is Concat(past_<prefix>i, new, axis) with past a graph input."""
    if node.op_type != "Concat" or len(node.inputs) != 2:
        return None
    a = node.attributes.get("axis")
    past, new = node.inputs
    rank = len(shape_of(past)) if past is not None and past.shape is not None else None
    if a is None or rank is None or a.value % rank != axis % rank:
        return None
    if not past.name.startswith(prefix) or past.producer() is not None:
        return None
    return past, new


def find_attention(graph: ir.Graph) -> list[dict]:
    """Every layer's (key concat, score MatMul, value concat, value MatMul), matched by the past inputs."""
    keys, values = {}, {}
    for node in graph:
        if (kv := _past_concat(node, "past_key_", 3)) is not None:
            mm = _sole_matmul(node.outputs[0], 1)
            if mm is not None:
                keys[kv[0].name.removeprefix("past_key_")] = (node, mm, *kv)
        elif (kv := _past_concat(node, "past_value_", 2)) is not None:
            mm = _sole_matmul(node.outputs[0], 1)
            if mm is not None and mm.inputs[0].producer() is not None \
                    and mm.inputs[0].producer().op_type == "Softmax":
                values[kv[0].name.removeprefix("past_value_")] = (node, mm, *kv)
    return [{"layer": i, "key": keys[i], "value": values[i]} for i in keys if i in values]


def worth_it(match: dict) -> bool:
    """Scores (N x CL per query head) are cheaper to join than the cache (2 x Hkv x D x CL)."""
    _, score_mm, past_k, _ = match["key"]
    s = shape_of(score_mm.outputs[0])  # [..., N, CL]
    kv = shape_of(past_k)  # [Hkv, 1, D, P]
    query_rows = 1
    for d in s[:-1]:
        query_rows *= d
    return query_rows < 2 * kv[0] * kv[2]


def _rewrite(graph: ir.Graph, m: dict) -> None:
    cat_k, score_mm, past_k, new_k = m["key"]
    cat_v, value_mm, past_v, new_v = m["value"]
    where = scope(score_mm) or f"layers.{m['layer']}.self_attn"
    q = score_mm.inputs[0]
    s_shape = shape_of(score_mm.outputs[0])
    past_len = shape_of(past_k)[-1]
    new_len = s_shape[-1] - past_len
    dtype = q.dtype
    sp = new_node(graph, score_mm, "MatMul", [q, past_k], f"{where}/scores_past", None,
                  s_shape[:-1] + [past_len], dtype).outputs[0]
    sn = new_node(graph, score_mm, "MatMul", [q, new_k], f"{where}/scores_new", None,
                  s_shape[:-1] + [new_len], dtype).outputs[0]
    scores = new_node(graph, score_mm, "Concat", [sp, sn], f"{where}/scores", {"axis": -1}, s_shape,
                      dtype).outputs[0]
    ir.convenience.replace_all_uses_with(score_mm.outputs[0], scores)

    p = value_mm.inputs[0]
    o_shape = shape_of(value_mm.outputs[0])
    last = add_initializer(graph, "axes.last", _i64([-1]))
    zero = add_initializer(graph, "slice.0", _i64([0]))
    cut = add_initializer(graph, f"slice.{past_len}", _i64([past_len]))
    end = add_initializer(graph, f"slice.{past_len + new_len}", _i64([past_len + new_len]))
    p_shape = shape_of(p)
    pp = new_node(graph, value_mm, "Slice", [p, zero, cut, last], f"{where}/probs_past", None,
                  p_shape[:-1] + [past_len], dtype).outputs[0]
    pn = new_node(graph, value_mm, "Slice", [p, cut, end, last], f"{where}/probs_new", None,
                  p_shape[:-1] + [new_len], dtype).outputs[0]
    op = new_node(graph, value_mm, "MatMul", [pp, past_v], f"{where}/attend_past", None, o_shape,
                  dtype).outputs[0]
    on = new_node(graph, value_mm, "MatMul", [pn, new_v], f"{where}/attend_new", None, o_shape,
                  dtype).outputs[0]
    out = new_node(graph, value_mm, "Add", [op, on], f"{where}/attend", None, o_shape, dtype).outputs[0]
    ir.convenience.replace_all_uses_with(value_mm.outputs[0], out)
    for node in (score_mm, cat_k, value_mm, cat_v):
        graph.remove(node, safe=True)


def _i64(values: list[int]) -> np.ndarray:
    return np.array(values, np.int64)


@register("attend_past_in_place")
class AttendPastInPlace(GraphPass):
    runs_before = ("check_htp",)

    class Config(PassConfig):
        every_width: bool = False  # also where joining the scores costs more than joining the cache

    def _wanted(self, match: dict) -> bool:
        return self.config.every_width or worth_it(match)

    def rewrite(self, model: ir.Model) -> bool:
        matches = [m for m in find_attention(model.graph) if self._wanted(m)]
        for m in matches:
            _rewrite(model.graph, m)
        if matches:
            remove_unused(model)
        return bool(matches)

    def ensures(self, model: ir.Model) -> None:
        left = [m["layer"] for m in find_attention(model.graph) if self._wanted(m)]
        if left:
            raise AssertionError(f"layers {left} still concatenate their past K/V before attending")
