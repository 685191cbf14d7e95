"""mha_to_sha: split every multi-head attention into single-head attentions.

Rewrite rules (per layer, starting at the q/k/v projections):
  - projection `x @ W[C, H*D]` -> H nodes `x @ W_h[C, D]`, W_h a per-head initializer
    `<scope>.weight.h<h>` (sliced at compile time, never a Slice node); a bias or any constant
    spanning the heads is sliced the same way;
  - every following node the heads pass through independently (reshapes, q/k norms, RoPE,
    scaling, soft-capping, mask add, softmax, score and value matmuls, transposes, concats with
    the past cache) is replicated per head with the head axes kept at size 1, so ranks never
    change; reshape targets are recomputed;
  - GQA: a query head h meets KV head h // g through broadcasting in the capture's
    [n_kv, g, N, D] layout, so the per-head score matmul takes KV head h // g directly:
    no Expand, Tile or repeat;
  - a KV cache input [n_kv,1,...] feeding a per-head node is cut by one Split into its heads;
  - where heads meet a node that mixes them (the output projection, a graph output such as
    new_key_i), the per-head tensors are concatenated back: attention outputs concat before
    o_proj, new K/V rows concat into the one [n_kv,1,...] output per layer.
Requires: projections are MatMul with a constant 2-D weight named `*.self_attn.{q,k,v}_proj/MatMul`
  (export.py; run before linear_to_conv), followed by a Reshape that splits the last axis into
  [heads, head_dim].
Ensures: no MatMul between two computed tensors spans more than one head (all its batch dims
  are 1); no q/k/v projection outside a `.head<h>` scope remains; graph inputs and outputs
  (one K and one V tensor per layer) are unchanged.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from passes.base import GraphPass, PassConfig
from passes.registry import register
from toolchain.ir.graph import (
    add_initializer,
    const_array,
    new_node,
    remove_unused,
    scope,
    shape_of,
    take_over,
    unique_value_name,
)

# ops a head passes through on its own, as long as the op does not reduce, slice or concat along
# a head axis (checked per node)
_HEADWISE = {"Add", "Sub", "Mul", "Div", "Pow", "Neg", "Abs", "Clip", "Sqrt", "Reciprocal", "Tanh", "Sigmoid", "Exp",
                "Cast", "Erf", "Relu", "Gelu", "Where", "Max", "Min", "Softmax", "ReduceMean", "ReduceSum",
                "ReduceMax", "Slice", "Concat", "Transpose", "Reshape", "MatMul"}  # fmt: skip
_PROJ = re.compile(r"\.self_attn\.(q|k|v)_proj$")


@dataclass
class Heads:
    """How a tensor's heads are laid out and the per-head copies (row-major over `sizes`)."""

    axes: tuple[int, ...]
    sizes: tuple[int, ...]
    copies: list[ir.Value]
    packed: int = 0  # >0: heads are packed in axes[0], each `packed` wide (e.g. [1,N,H*D])

    def __post_init__(self):
        # a head axis of size 1 (one KV head broadcast against the query heads) carries no head
        # index; dropping it keeps the remaining head axes contiguous for reshapes
        keep = [(a, s) for a, s in zip(self.axes, self.sizes, strict=True) if s > 1]
        if keep and len(keep) < len(self.axes):
            self.axes, self.sizes = tuple(a for a, _ in keep), tuple(s for _, s in keep)

    def head_shape(self, full: list[int]) -> list[int]:
        out = list(full)
        if self.packed:
            out[self.axes[0]] = self.packed
        else:
            for a in self.axes:
                out[a] = 1
        return out


def _unravel(idx: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(idx, sizes)) if sizes else ()


class _Rewriter:
    def __init__(self, model: ir.Model):
        self.graph = model.graph
        self.heads: dict[ir.Value, Heads] = {}
        self.replaced: list[ir.Node] = []
        self.splits: dict[tuple[int, int], list[ir.Value]] = {}

    # -- seeds -------------------------------------------------------------------------------
    def seed(self, node: ir.Node) -> bool:
        w = const_array(node.inputs[1])
        if w is None or w.ndim != 2:
            return False
        reshape = _follow_to_reshape(node.outputs[0])
        if reshape is None:
            return False
        out = shape_of(reshape.outputs[0])
        n_heads, head_dim = out[-2], out[-1]
        if n_heads * head_dim != w.shape[1]:
            return False
        x = node.inputs[0]
        full = shape_of(node.outputs[0])
        copies = []
        for h in range(n_heads):
            wh = add_initializer(
                self.graph, f"{scope(node)}.weight.h{h}", w[:, h * head_dim : (h + 1) * head_dim]
            )
            copies.append(self._emit(node, h, "MatMul", [x, wh], {}, [*full[:-1], head_dim]))
        self.heads[node.outputs[0]] = Heads((len(full) - 1,), (n_heads,), copies, packed=head_dim)
        self.replaced.append(node)
        return True

    def _emit(self, node: ir.Node, h: int, op: str, inputs, attrs, shape) -> ir.Value:
        name = f"{scope(node)}.head{h}/{node.name.rsplit('/', 1)[-1]}"
        out = node.outputs[0]
        return new_node(self.graph, node, op, inputs, name, attrs, shape, out.dtype).outputs[0]

    # -- propagation -------------------------------------------------------------------------
    def visit(self, node: ir.Node) -> None:
        if not any(v in self.heads for v in node.inputs if v is not None):
            return
        if node.op_type not in _HEADWISE or len(node.outputs) != 1:
            return
        try:
            plan = self._plan(node)
        except _Unsupported:
            return
        if plan is None:
            return
        out_heads, per_input, shape_const = plan
        full = shape_of(node.outputs[0])
        head_full = out_heads.head_shape(full)
        attrs = {k: a.value for k, a in node.attributes.items()}
        shape_value = None
        if shape_const is not None:
            shape_value = add_initializer(
                self.graph, f"{scope(node)}.head_shape", np.array(shape_const, np.int64)
            )
        copies = []
        for h in range(math.prod(out_heads.sizes)):
            ins = [pick(h) for pick in per_input]
            if shape_value is not None:
                ins[1] = shape_value
            copies.append(self._emit(node, h, node.op_type, ins, attrs, head_full))
        out_heads.copies = copies
        self.heads[node.outputs[0]] = out_heads
        self.replaced.append(node)

    def _plan(self, node: ir.Node):
        out = node.outputs[0]
        full = shape_of(out)
        rank = len(full)
        headed = [(i, self.heads[v]) for i, v in enumerate(node.inputs) if v is not None and v in self.heads]
        op = node.op_type
        shape_const = None
        if op in ("Reshape", "Transpose"):
            (i0, hin), = headed  # fmt: skip
            if i0 != 0:
                raise _Unsupported
            if op == "Transpose":
                if hin.packed:
                    raise _Unsupported
                perm = list(node.attributes["perm"].value)
                axes = tuple(perm.index(a) for a in hin.axes)
                if list(axes) != sorted(axes):
                    raise _Unsupported
                out_heads = Heads(axes, hin.sizes, [])
            else:
                out_heads = _reshape_heads(shape_of(node.inputs[0]), full, hin)
                shape_const = out_heads.head_shape(full)
            pickers = [lambda h, v=hin: v.copies[h]]
            if op == "Reshape":
                pickers.append(lambda h: None)  # the per-head shape constant goes here
            return out_heads, pickers, shape_const
        # ops that broadcast their inputs against the output (MatMul: batch dims only)
        limit = rank - 2 if op == "MatMul" else rank
        axis_set: dict[int, int] = {}
        packed = 0
        for i, hd in headed:
            off = rank - len(shape_of(node.inputs[i]))
            if hd.packed:
                if op == "MatMul":
                    raise _Unsupported
                packed = hd.packed
            for a, s in zip(hd.axes, hd.sizes, strict=True):
                if a + off >= limit:
                    raise _Unsupported
                axis_set[a + off] = full[a + off] if not hd.packed else s
        axes = tuple(sorted(axis_set))
        sizes = tuple(axis_set[a] for a in axes)
        if packed and len(headed) != sum(1 for _, hd in headed if hd.packed):
            raise _Unsupported
        _check_axis_attr(node, axes, rank)
        out_heads = Heads(axes, sizes, [], packed=packed)
        per_input = []
        for i, v in enumerate(node.inputs):
            per_input.append(self._picker(node, i, v, out_heads, rank, limit))
        return out_heads, per_input, shape_const

    def _picker(self, node, i, v, out_heads: Heads, rank: int, limit: int):
        if v is None:
            return lambda h: None
        if node.op_type in ("Slice", "ReduceMean", "ReduceSum", "ReduceMax") and i > 0:
            return lambda h, v=v: v  # starts/ends/axes operands
        vshape = shape_of(v)
        off = rank - len(vshape)
        if v in self.heads:
            hd = self.heads[v]
            if math.prod(hd.sizes) == 1:
                return lambda h, hd=hd: hd.copies[0]
            own = [out_heads.axes.index(a + off) for a in hd.axes]

            def pick(h, hd=hd, own=own):
                multi = _unravel(h, out_heads.sizes)
                sub = tuple(multi[k] if n > 1 else 0 for k, n in zip(own, hd.sizes, strict=True))
                return hd.copies[int(np.ravel_multi_index(sub, hd.sizes)) if sub else 0]

            return pick
        spans = [(a - off, s) for a, s in zip(out_heads.axes, out_heads.sizes, strict=True) if a - off >= 0]
        width = out_heads.packed
        full_axes = [(a, s) for a, s in spans if vshape[a] != 1]
        if not full_axes:
            return lambda h, v=v: v  # broadcast along the heads: shared by every head
        if len(full_axes) != 1 or vshape[full_axes[0][0]] != full_axes[0][1] * (width or 1):
            raise _Unsupported
        axis, count = full_axes[0]
        pos = [k for k, (a, _) in enumerate(spans) if a == axis][0] + (len(out_heads.axes) - len(spans))
        step = width or 1
        pieces = self._slices(node, v, axis, count, step)
        return lambda h, p=pieces, pos=pos: p[_unravel(h, out_heads.sizes)[pos]]

    def _slices(self, node, v: ir.Value, axis: int, count: int, step: int) -> list[ir.Value]:
        key = (id(v), axis)
        if key in self.splits:
            return self.splits[key]
        arr = const_array(v)
        if arr is not None:
            base = v.name if v.name and not v.name.startswith("val_") else f"{scope(node)}.const"
            index = [slice(None)] * arr.ndim
            pieces = []
            for k in range(count):
                index[axis] = slice(k * step, (k + 1) * step)
                pieces.append(add_initializer(self.graph, f"{base}.h{k}", arr[tuple(index)]))
        else:
            shape = shape_of(v)
            shape[axis] = step
            split = new_node(self.graph, _first_user(self.graph, v), "Split", [v],
                             f"{scope(node)}/Split_{v.name}", {"axis": axis, "num_outputs": count},
                             shape, v.dtype, num_outputs=count)  # fmt: skip
            for o in split.outputs[1:]:
                o.name = unique_value_name(self.graph, split.outputs[0].name)
                o.shape, o.type = ir.Shape(shape), ir.TensorType(v.dtype)
            pieces = list(split.outputs)
        self.splits[key] = pieces
        return pieces

    # -- merging heads back ------------------------------------------------------------------
    def materialize(self) -> None:
        graph_outputs = set(self.graph.outputs)
        dropping = set(self.replaced)
        for node in self.replaced:
            v = node.outputs[0]
            users = [u for u, _ in v.uses() if u not in dropping]
            if not users and v not in graph_outputs:
                continue
            hd = self.heads[v]
            merged = self._concat(node, hd, shape_of(v), v.dtype)
            take_over(v, merged, "mha")

    def _concat(self, node: ir.Node, hd: Heads, full: list[int], dtype) -> ir.Value:
        values = hd.copies
        shape = hd.head_shape(full)
        anchor = node
        for level in reversed(range(len(hd.axes))):  # innermost head axis first
            axis, n = hd.axes[level], hd.sizes[level]
            shape[axis] = full[axis]
            merged = []
            for k in range(0, len(values), n):
                cat = new_node(self.graph, None, "Concat", values[k : k + n], f"{scope(node)}/ConcatHeads",
                               {"axis": axis}, list(shape), dtype, after=anchor)  # fmt: skip
                anchor = cat
                merged.append(cat.outputs[0])
            values = merged
        return values[0]


class _Unsupported(Exception):
    pass


def _check_axis_attr(node: ir.Node, head_axes: tuple[int, ...], rank: int) -> None:
    """Reject reductions/concats/slices along a head axis."""
    axes: list[int] = []
    if "axis" in node.attributes:
        axes.append(node.attributes["axis"].value)
    if node.op_type in ("ReduceMean", "ReduceSum", "ReduceMax"):
        a = const_array(node.inputs[1]) if len(node.inputs) > 1 else None
        if (
            a is None
            or node.attributes.get("keepdims", ir.Attr("keepdims", ir.AttributeType.INT, 1)).value != 1
        ):
            raise _Unsupported
        axes += [int(x) for x in a.reshape(-1)]
    if node.op_type == "Slice":
        a = const_array(node.inputs[3]) if len(node.inputs) > 3 else None
        if a is None:
            raise _Unsupported
        axes += [int(x) for x in a.reshape(-1)]
    if any((x % rank) in head_axes for x in axes):
        raise _Unsupported


def _reshape_heads(src: list[int], dst: list[int], hin: Heads) -> Heads:
    """Where the heads land after a row-major reshape: `pre` elements before them, `block` heads,
    `inner` elements per head after them, in both shapes."""
    block = math.prod(hin.sizes)
    pre = math.prod(src[: hin.axes[0]])
    inner = (hin.packed or 1) * math.prod(src[hin.axes[-1] + 1 :])
    starts = [i for i in range(len(dst)) if math.prod(dst[:i]) == pre]
    for i in reversed(starts) if block > 1 else starts:
        for j in range(i, len(dst)):
            if math.prod(dst[i : j + 1]) == block:
                return Heads(tuple(range(i, j + 1)), tuple(dst[i : j + 1]), [])
        if dst[i] % block == 0 and math.prod(dst[i + 1 :]) * (dst[i] // block) == inner:
            return Heads((i,), (block,), [], packed=dst[i] // block)  # heads merged into axis i
    raise _Unsupported


def _follow_to_reshape(v: ir.Value) -> ir.Node | None:
    for _ in range(3):
        users = [u for u, _ in v.uses()]
        if len(users) != 1:
            return None
        if users[0].op_type == "Reshape":
            return users[0]
        if users[0].op_type not in ("Add", "Mul"):
            return None
        v = users[0].outputs[0]
    return None


def _first_user(graph: ir.Graph, v: ir.Value) -> ir.Node:
    users = {u for u, _ in v.uses()}
    return next(n for n in graph if n in users)


@register("mha_to_sha")
class MhaToSha(GraphPass):
    runs_before = ("linear_to_conv",)

    class Config(PassConfig):
        projections: list[str] = ["q", "k", "v"]  # which projections seed the head split

    def requires(self, model: ir.Model) -> None:
        for node in model.graph:
            if node.op_type == "Conv" and _PROJ.search(scope(node)):
                raise ir.passes.PreconditionError(
                    f"{node.name} is already a Conv: list mha_to_sha before linear_to_conv in the recipe"
                )

    def rewrite(self, model: ir.Model) -> bool:
        rw = _Rewriter(model)
        seeded = False
        for node in list(model.graph):
            m = _PROJ.search(scope(node))
            if (
                node.op_type == "MatMul"
                and m
                and m.group(1) in self.config.projections
                and ".head" not in scope(node)
            ):
                seeded |= rw.seed(node)
            elif rw.heads:
                rw.visit(node)
        if not seeded:
            return False
        rw.materialize()
        for node in reversed(rw.replaced):
            if not any(o.uses() for o in node.outputs) and not set(node.outputs) & set(model.graph.outputs):
                model.graph.remove(node, safe=True)
        remove_unused(model)
        return True

    def ensures(self, model: ir.Model) -> None:
        for node in model.graph:
            s = scope(node)
            if node.op_type == "MatMul" and all(const_array(v) is None for v in node.inputs):
                batch = shape_of(node.outputs[0])[:-2]
                assert math.prod(batch) == 1, f"{node.name} spans {math.prod(batch)} heads"
            m = _PROJ.search(s)
            if m and m.group(1) in self.config.projections and node.op_type == "MatMul":
                raise AssertionError(f"projection {node.name} was not split per head")
