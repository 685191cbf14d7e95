"""fuse_rmsnorm: every RMSNorm as one onnxruntime SimplifiedLayerNormalization node (CPU form).

Rewrite rule (the norm as the exporter writes it, matched by scale_rmsnorm's matcher):
    Pow(x, 2) -> ReduceMean(-1) -> Add(eps) -> Sqrt -> Reciprocal -> r;  Mul(x, r);  Mul(w, .)
  -> SimplifiedLayerNormalization(x, w, axis=-1, epsilon=eps)
which computes x / sqrt(mean(x^2) + eps) * w in float32, in one kernel instead of seven (SmolLM2's
int4 decode step ran 61 norms of 7 small kernels each, ~25 us per norm on one core).

SimplifiedLayerNormalization is an onnxruntime contrib op (registered in the ONNX domain): a CPU
pass, like matmul_nbits; check_htp refuses it. Norms whose weight is not a constant vector of the
normalized width, or whose unweighted output is used elsewhere, are left alone.
Requires: float inputs, the norm over the last axis. Ensures: no Pow(., 2) -> ReduceMean RMSNorm
chain with a constant weight remains.
"""

from __future__ import annotations

import onnx_ir as ir

from passes.base import GraphPass
from passes.registry import register
from passes.scale_rmsnorm import match_rmsnorm
from toolchain.ir.graph import const_array, new_node, remove_unused, scope, shape_of, take_over


def _last_axis_only(mean: ir.Node, rank: int) -> bool:
    axes = const_array(mean.inputs[1]) if len(mean.inputs) > 1 else None
    if axes is None:
        attr = mean.attributes.get("axes")
        axes = None if attr is None else list(attr.value)
    return axes is not None and [int(a) % rank for a in list(axes)] == [rank - 1]


def match(node: ir.Node) -> dict | None:
    """The norm starting at node with its weight Mul, when it can become one fused node."""
    m = match_rmsnorm(node)
    if m is None or len(m["muls"]) != 1:
        return None
    x = m["x"]
    if x.shape is None or not _last_axis_only(m["mean"], len(x.shape)):
        return None
    normed = m["muls"][0].outputs[0]
    uses = list(normed.uses())
    if len(uses) != 1 or uses[0].node.op_type != "Mul":
        return None
    weight_mul = uses[0].node
    other = weight_mul.inputs[1 - uses[0].idx]
    w = const_array(other)
    if w is None or w.ndim != 1 or w.shape[0] != shape_of(x)[-1]:
        return None
    eps = float(const_array(m["add"].inputs[m["eps_index"]]).reshape(-1)[0])
    return {**m, "weight": other, "weight_mul": weight_mul, "eps": eps}


@register("fuse_rmsnorm")
class FuseRmsNorm(GraphPass):
    runs_before = ("check_htp",)
    runs_after = ("scale_rmsnorm",)  # scale_rmsnorm's chains do not match; it is for the NPU

    def rewrite(self, model: ir.Model) -> bool:
        graph = model.graph
        found = [m for node in list(graph) if (m := match(node))]
        for m in found:
            x, out = m["x"], m["weight_mul"].outputs[0]
            fused = new_node(graph, m["weight_mul"], "SimplifiedLayerNormalization", [x, m["weight"]],
                             f"{scope(m['pow']) or 'rmsnorm'}/SimplifiedLayerNormalization",
                             {"axis": -1, "epsilon": m["eps"], "stash_type": 1}, shape_of(out), x.dtype)
            take_over(out, fused.outputs[0], "unfused")  # the old chain is dead: remove_unused drops it
        if found:
            remove_unused(model)
        return bool(found)

    def ensures(self, model: ir.Model) -> None:
        left = [m["pow"].name for node in model.graph if (m := match(node))]
        if left:
            raise AssertionError(f"RMSNorms {left[:3]} were not fused")
