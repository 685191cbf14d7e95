"""fuse_projections: projections that read the same input run as one MatMul (q/k/v, gate/up).

Rewrite rule: MatMul(x, W_1[C, O_1]), ..., MatMul(x, W_k[C, O_k]) with constant 2-D weights and the
same x (k >= 2) -> Split(MatMul(x, Concat(W_1..W_k, axis=1)), [O_1..O_k], axis=-1). Each output
element is the same dot product as before, so the graph computes the same numbers.

Why: a one-token CPU step is a chain of small kernels, and per-kernel work that does not scale with
the weight (launch, reading x, and in the int4 form the Q4_1 offset branch: Reshape, ReduceSum,
MatMul, Add per projection) is paid once per group instead of once per projection: 7 projections
per Llama layer become 4. Run it before matmul_nbits: concatenating columns keeps every column
block on its GGUF grid, so the fused weight converts exactly as its parts would have.

Requires: MatMul weights (before linear_to_conv). Ensures: no two MatMuls with constant 2-D
weights read the same value.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx_ir as ir

from passes.base import GraphPass
from passes.registry import register
from toolchain.ir.graph import (
    add_initializer,
    const_array,
    new_node,
    remove_unused,
    scope,
    shape_of,
    take_over,
)


def _constant_weight(node: ir.Node) -> np.ndarray | None:
    if node.op_type != "MatMul" or len(node.inputs) != 2 or not node.inputs[1].is_initializer():
        return None
    w = const_array(node.inputs[1])
    return w if w is not None and w.ndim == 2 else None


def sibling_groups(graph: ir.Graph) -> list[list[ir.Node]]:
    """Groups (in graph order) of >= 2 constant-weight MatMuls reading the same first input."""
    by_input: dict[int, list[ir.Node]] = defaultdict(list)
    for node in graph:
        if _constant_weight(node) is not None:
            by_input[id(node.inputs[0])].append(node)
    return [nodes for nodes in by_input.values() if len(nodes) >= 2]


def fused_name(nodes: list[ir.Node]) -> str:
    """layers.3.self_attn.q_proj, .k_proj, .v_proj -> layers.3.self_attn.q_proj_k_proj_v_proj."""
    scopes = [scope(n) or n.name for n in nodes]
    head = scopes[0].rsplit(".", 1)[0]
    if all(s.rsplit(".", 1)[0] == head and "." in s for s in scopes):
        return head + "." + "_".join(s.rsplit(".", 1)[1] for s in scopes)
    return "_".join(s.replace(".", "_") for s in scopes)


def _fuse(graph: ir.Graph, nodes: list[ir.Node]) -> None:
    x = nodes[0].inputs[0]
    weights = [_constant_weight(n) for n in nodes]
    widths = [w.shape[1] for w in weights]
    name = fused_name(nodes)
    first = nodes[0]
    w = add_initializer(graph, f"{name}.weight", np.concatenate(weights, axis=1))
    out_shape = shape_of(first.outputs[0])[:-1] + [sum(widths)]
    y = new_node(graph, first, "MatMul", [x, w], f"{name}/MatMul", None, out_shape, x.dtype).outputs[0]
    sizes = add_initializer(graph, "split." + "_".join(map(str, widths)), np.array(widths, np.int64))
    split = new_node(graph, first, "Split", [y, sizes], f"{name}/Split", {"axis": -1}, None, x.dtype,
                     num_outputs=len(nodes))
    for node, part, width in zip(nodes, split.outputs, widths, strict=True):
        old = node.outputs[0]
        part.shape = ir.Shape(shape_of(old)[:-1] + [width])
        part.type = ir.TensorType(x.dtype)
        take_over(old, part, "unfused")
        graph.remove(node, safe=True)


@register("fuse_projections")
class FuseProjections(GraphPass):
    runs_before = ("matmul_nbits", "linear_to_conv", "mha_to_sha", "check_htp")

    def rewrite(self, model: ir.Model) -> bool:
        groups = sibling_groups(model.graph)
        for nodes in groups:
            _fuse(model.graph, nodes)
        if groups:
            remove_unused(model)
        return bool(groups)

    def ensures(self, model: ir.Model) -> None:
        groups = sibling_groups(model.graph)
        if groups:
            raise AssertionError(f"MatMuls {[n.name for n in groups[0]]} read one input and were not fused")
