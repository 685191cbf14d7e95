"""cache_attention: a narrow step graph's attention over the static KV cache as one mobc op that
reads only the cache slots the mask admits.

After attend_past_in_place a layer's attention is ~12 nodes (two score MatMuls, their Concat, the
scale, the mask, Softmax, two Slices, two value MatMuls and their sum), and each call reads all P
cache slots, although a token at position t attends to t of them: everything else carries the
mask's MASK_MIN (-1e4), whose softmax weight is exactly 0 in float32. `CacheAttention`
(toolchain/kernels/cache_attention.c) computes the same softmax(q k * scale + mask) v over the
admitted slots only, so the graph's numbers up to float32 summation order.

A CPU pass (a mobc.cpu op; check_htp refuses it). Requires: attend_past_in_place's form, q as
[G, H, N, D] against a [G, 1, D, P] cache (grouped queries broadcast over H), an additive mask
[1, 1, N, P + Nn] that is a graph input. Layers in any other form are left as they are.
Ensures: no layer in attend_past_in_place's form remains.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from passes.base import GraphPass
from passes.registry import register
from toolchain import kernels
from toolchain.ir.graph import add_initializer, const_array, new_node, remove_unused, scope, shape_of


@dataclass
class _Attention:
    q: ir.Value
    past_key: ir.Value
    new_key: ir.Value
    past_value: ir.Value
    new_value: ir.Value
    mask: ir.Value
    scale: float
    out: ir.Value
    nodes: list[ir.Node]


def _sole_use(value: ir.Value, op: str) -> ir.Node | None:
    uses = list(value.uses())
    return uses[0].node if len(uses) == 1 and uses[0].node.op_type == op else None


def _other(node: ir.Node, value: ir.Value) -> ir.Value | None:
    a, b = node.inputs
    return b if a is value else a if b is value else None


def _is_input(value: ir.Value | None, prefix: str) -> bool:
    return value is not None and value.producer() is None and value.name.startswith(prefix) \
        and value.const_value is None


def _match(score_past: ir.Node) -> _Attention | None:
    """attend_past_in_place's layer form, from its past-score MatMul."""
    q, past_key = score_past.inputs
    if not _is_input(past_key, "past_key_"):
        return None
    cat = _sole_use(score_past.outputs[0], "Concat")
    if cat is None or len(cat.inputs) != 2 or cat.inputs[0] is not score_past.outputs[0]:
        return None
    score_new = cat.inputs[1].producer()
    if score_new is None or score_new.op_type != "MatMul" or score_new.inputs[0] is not q:
        return None
    x, nodes, scale = cat.outputs[0], [score_past, score_new, cat], 1.0
    mul = _sole_use(x, "Mul")
    if mul is not None:
        factor = const_array(_other(mul, x))
        if factor is None or factor.size != 1:
            return None
        scale, x = float(factor.reshape(())), mul.outputs[0]
        nodes.append(mul)
    add = _sole_use(x, "Add")
    mask = _other(add, x) if add is not None else None
    if not _is_input(mask, "attention_mask"):
        return None
    soft = _sole_use(add.outputs[0], "Softmax")
    axis = soft.attributes.get("axis") if soft is not None else None
    if soft is None or (axis is not None and axis.value not in (-1, 3)):
        return None
    nodes += [add, soft]
    slices = [u.node for u in soft.outputs[0].uses()]
    if len(slices) != 2 or any(s.op_type != "Slice" for s in slices):
        return None
    products = [_sole_use(s.outputs[0], "MatMul") for s in slices]
    if any(p is None for p in products):
        return None
    by_value = {_is_input(p.inputs[1], "past_value_"): (s, p) for s, p in zip(slices, products, strict=True)}
    if set(by_value) != {True, False}:
        return None
    (s_past, p_past), (s_new, p_new) = by_value[True], by_value[False]
    total = _sole_use(p_past.outputs[0], "Add")
    if total is None or _other(total, p_past.outputs[0]) is not p_new.outputs[0]:
        return None
    nodes += [s_past, s_new, p_past, p_new, total]
    found = _Attention(q, past_key, score_new.inputs[1], p_past.inputs[1], p_new.inputs[1], mask, scale,
                       total.outputs[0], nodes)
    return found if _shapes_fit(found) and _slices_fit(found, s_past, s_new) else None


def _shapes_fit(a: _Attention) -> bool:
    try:
        g, h, n, d = shape_of(a.q)
        pk, nk, pv, nv, m = (shape_of(v) for v in (a.past_key, a.new_key, a.past_value, a.new_value, a.mask))
    except (TypeError, ValueError):
        return False
    if not all(isinstance(v, int) for v in (g, h, n, d)):
        return False
    p, nn = pk[-1], nk[-1]
    return (pk == [g, 1, d, p] and nk == [g, 1, d, nn] and pv == [g, 1, p, d] and nv == [g, 1, nn, d]
            and m == [1, 1, n, p + nn] and shape_of(a.out) == [g, h, n, d])


def _slices_fit(a: _Attention, past: ir.Node, new: ir.Node) -> bool:
    """The past slice takes [0, P) of the last axis and the new one [P, P + Nn)."""
    p, nn = shape_of(a.past_key)[-1], shape_of(a.new_key)[-1]
    for node, lo, hi in ((past, 0, p), (new, p, p + nn)):
        parts = [const_array(v) for v in node.inputs[1:4]]
        if len(node.inputs) < 4 or any(x is None for x in parts):
            return False
        start, end, axes = (int(x.reshape(-1)[0]) for x in parts)
        if axes not in (-1, 3) or start != lo or end != hi:
            return False
    return True


def find_attention(graph: ir.Graph) -> list[_Attention]:
    found = []
    for node in graph:
        if node.op_type == "MatMul" and len(node.inputs) == 2 and (m := _match(node)) is not None:
            found.append(m)
    return found


@register("cache_attention")
class CacheAttention(GraphPass):
    runs_after = ("attend_past_in_place",)
    runs_before = ("check_htp",)

    def rewrite(self, model: ir.Model) -> bool:
        found = find_attention(model.graph)
        if not found:
            return False
        kernels.require("cache_attention")
        for a in found:
            where = scope(a.nodes[0]) or "attention"
            scale = add_initializer(model.graph, f"cache_attention.scale_{a.scale!r}",
                                    np.array([a.scale], np.float32))
            node = new_node(model.graph, a.nodes[-1], "CacheAttention",
                            [a.q, a.past_key, a.new_key, a.past_value, a.new_value, a.mask, scale],
                            f"{where}/CacheAttention", None, shape_of(a.out), ir.DataType.FLOAT)
            node.domain = kernels.DOMAIN
            ir.convenience.replace_all_uses_with(a.out, node.outputs[0])
            for old in reversed(a.nodes):
                model.graph.remove(old, safe=True)
        model.opset_imports.setdefault(kernels.DOMAIN, kernels.OPSET)
        remove_unused(model)
        return True

    def ensures(self, model: ir.Model) -> None:
        left = find_attention(model.graph)
        if left:
            raise AssertionError(f"{len(left)} layers still attend through MatMul/Softmax over the whole cache")
