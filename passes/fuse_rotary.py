"""fuse_rotary: every RoPE rotation as one onnxruntime RotaryEmbedding node (CPU form).

Rewrite rule (HF's rotate_half form, as the exporter writes it for q and k of every layer):
    Add(Mul(x, C), Mul(Concat(Neg(Slice(x, h:D)), Slice(x, 0:h)), S))
  with C = Concat(position_cos, position_cos) and S likewise (reshaped, unsqueezed), x [1, H, N, D]
  -> RotaryEmbedding(x, position_ids = [0..N-1], cos_cache = position_cos as [N, D/2], sin_cache)
The step graph's RoPE inputs already hold the rows of this call's positions, so the kernel's
position ids are the rows 0..N-1 of its cache: x1*cos - x2*sin, x2*cos + x1*sin per row, the same
products and sums as the seven nodes it replaces (SmolLM2: 14 small kernels per layer).

RotaryEmbedding is a com.microsoft contrib op: a CPU pass (check_htp refuses it).
Requires: the rotation over the whole head (h = D/2), tables fed by the graph's position_cos* /
position_sin* inputs. Ensures: no such rotation remains.
"""

from __future__ import annotations

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
    shape_constant,
    shape_of,
    take_over,
)

DOMAIN = "com.microsoft"


def _producer(v: ir.Value | None, op: str) -> ir.Node | None:
    p = v.producer() if v is not None else None
    return p if p is not None and p.op_type == op else None


def _table(v: ir.Value, kind: str) -> ir.Value | None:
    """The graph input position_<kind>* that v repeats twice along its last axis, through
    Reshape/Unsqueeze, or None."""
    while (p := v.producer()) is not None and p.op_type in ("Reshape", "Unsqueeze"):
        v = p.inputs[0]
    cat = _producer(v, "Concat")
    if cat is None or len(cat.inputs) != 2 or cat.inputs[0] is not cat.inputs[1]:
        return None
    src = cat.inputs[0]
    if src.producer() is not None or not src.name.startswith(f"position_{kind}"):
        return None
    return src


def _slice_bounds(node: ir.Node | None) -> tuple[ir.Value, int, int] | None:
    if node is None or node.op_type != "Slice" or len(node.inputs) < 4:
        return None
    starts, ends, axes = (const_array(node.inputs[i]) for i in (1, 2, 3))
    x = node.inputs[0]
    if starts is None or ends is None or axes is None or x.shape is None:
        return None
    if starts.size != 1 or int(axes.reshape(-1)[0]) % len(x.shape) != len(x.shape) - 1:
        return None
    if len(node.inputs) > 4 and node.inputs[4] is not None:
        steps = const_array(node.inputs[4])
        if steps is None or int(steps.reshape(-1)[0]) != 1:
            return None
    return x, int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0])


def _split_mul(mul: ir.Node | None, table_kind: str) -> tuple[ir.Value, ir.Value] | None:
    """Mul(a, T) in either order with T a repeated position table: (a, table input)."""
    if mul is None or mul.op_type != "Mul":
        return None
    for i in (0, 1):
        t = _table(mul.inputs[1 - i], table_kind)
        if t is not None:
            return mul.inputs[i], t
    return None


def match(add: ir.Node) -> dict | None:
    if add.op_type != "Add" or len(add.inputs) != 2:
        return None
    for a, b in ((0, 1), (1, 0)):
        cos_part = _split_mul(add.inputs[a].producer(), "cos")
        sin_part = _split_mul(add.inputs[b].producer(), "sin")
        if cos_part is None or sin_part is None:
            continue
        x, cos = cos_part
        rotated, sin = sin_part
        if cos.name.removeprefix("position_cos") != sin.name.removeprefix("position_sin"):
            continue
        cat = _producer(rotated, "Concat")
        if cat is None or len(cat.inputs) != 2:
            continue
        neg = _producer(cat.inputs[0], "Neg")
        hi = _slice_bounds(neg.inputs[0].producer()) if neg is not None else None
        lo = _slice_bounds(cat.inputs[1].producer())
        if x.shape is None or len(x.shape) != 4 or hi is None or lo is None:
            continue
        d = shape_of(x)[-1]
        half = d // 2
        if hi[0] is not x or lo[0] is not x or (lo[1], lo[2]) != (0, half) or hi[1] != half or hi[2] < d:
            continue
        if shape_of(cos)[-1] != half:
            continue
        return {"add": add, "x": x, "cos": cos, "sin": sin}
    return None


def _cache(graph: ir.Graph, table: ir.Value, before: ir.Node, made: dict) -> ir.Value:
    """position_cos [1, 1, N, D/2] as the kernel's cos_cache [N, D/2] (one Reshape per table)."""
    if table.name not in made:
        n, half = shape_of(table)[-2:]
        first = next(iter(graph))
        made[table.name] = new_node(graph, first, "Reshape", [table, shape_constant(graph, [n, half])], f"rotary/{table.name}_cache",
                                    None, [n, half], table.dtype).outputs[0]
    return made[table.name]


@register("fuse_rotary")
class FuseRotary(GraphPass):
    runs_before = ("check_htp",)

    def rewrite(self, model: ir.Model) -> bool:
        graph = model.graph
        found = [m for node in list(graph) if (m := match(node))]
        made: dict[str, ir.Value] = {}
        for m in found:
            x, add = m["x"], m["add"]
            n = shape_of(x)[2]
            pos = add_initializer(graph, f"rotary.rows_{n}", np.arange(n, dtype=np.int64).reshape(1, n))
            cos, sin = _cache(graph, m["cos"], add, made), _cache(graph, m["sin"], add, made)
            node = new_node(graph, add, "RotaryEmbedding", [x, pos, cos, sin],
                            f"{scope(add) or 'rotary'}/RotaryEmbedding", {"interleaved": 0}, shape_of(x), x.dtype)
            node.domain = DOMAIN
            take_over(add.outputs[0], node.outputs[0], "unfused")  # the old rotation is dead now
        if found:
            model.opset_imports.setdefault(DOMAIN, 1)
            remove_unused(model)
        return bool(found)

    def ensures(self, model: ir.Model) -> None:
        left = [n.name for n in model.graph if match(n)]
        if left:
            raise AssertionError(f"rotations {left[:3]} were not fused")
