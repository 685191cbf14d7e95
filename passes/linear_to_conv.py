"""linear_to_conv: every projection with a constant 2-D weight becomes a 1x1 Conv on NCHW.

Rewrite rules:
  - `x[..., T, C] @ W[C, O]` (W constant, or `Transpose(E)` of a constant E[O, C] as a tied
    lm_head) -> `to_nchw(x)` [1, C, 1, T] -> Conv(weight [O, C, 1, 1], kernel 1x1) [1, O, 1, T]
    -> `from_nchw` -> [..., T, O]. to_nchw is Reshape [1,1,T,C] + Transpose(0,3,1,2) (a single
    Reshape when T == 1, as in decode graphs); from_nchw is its inverse. One to_nchw per input
    tensor is shared by every projection reading it (q/k/v heads, gate/up).
  - a following `Add` of a constant bias [O] is folded into the Conv's bias input.
  - with `keep_layout: nchw` (default), from_nchw is pushed through elementwise ops whose other
    inputs are NCHW too or scalar constants (SiLU/GELU gating, products), and to_nchw(from_nchw(y))
    cancels to y, so an MLP stays NCHW from gate/up to down_proj; from_nchw is only emitted
    where a consumer needs the [.., T, O] layout (residual adds, attention reshapes, outputs).
    `keep_layout: none` wraps every Conv on its own. With nchw, the chains that remain are
    collapsed by simplify_layout's rules (Reshape∘Reshape, Transpose∘Transpose, unit-axis
    Transposes), so a decode projection is Reshape -> Conv -> Reshape.
Conv weights are named `<node scope>.weight` (deterministic across widths, so weights dedup).
Requires: static shapes (leading dims of x are flattened into T).
Ensures: no MatMul or Gemm with a constant 2-D weight (directly or through a Transpose) remains.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import onnx_ir as ir

from passes.base import GraphPass, PassConfig
from passes.registry import register
from passes.simplify_layout import simplify
from toolchain.ir.graph import (
    add_initializer,
    const_array,
    linear_weight,
    new_node,
    remove_unused,
    scope,
    shape_constant,
    shape_of,
    take_over,
)

_PUSH = {
    "Sigmoid",
    "Tanh",
    "Gelu",
    "Relu",
    "Neg",
    "Erf",
    "Exp",
    "Sqrt",
    "Reciprocal",
    "Add",
    "Mul",
    "Sub",
    "Div",
}


class _Converter:
    def __init__(self, model: ir.Model, push: bool):
        self.graph = model.graph
        self.push = push
        self.nchw: dict[ir.Value, ir.Value] = {}  # [.., T, C] value -> its [1, C, 1, T] twin
        self.replaced: list[ir.Node] = []
        self.done: set[ir.Node] = set()

    def to_nchw(self, x: ir.Value, before: ir.Node) -> ir.Value:
        if x in self.nchw:
            return self.nchw[x]
        shape = shape_of(x)
        t, c = math.prod(shape[:-1]), shape[-1]
        base = f"{scope(x.producer()) if x.producer() else 'graph'}/ToNCHW"
        first = _first_user(self.graph, x, before)
        if t == 1:
            out = self._reshape(x, [1, c, 1, 1], base, first)
        else:
            r = self._reshape(x, [1, 1, t, c], base, first)
            out = new_node(self.graph, first, "Transpose", [r], base, {"perm": [0, 3, 1, 2]}, [1, c, 1, t],
                           x.dtype).outputs[0]  # fmt: skip
        self.nchw[x] = out
        return out

    def from_nchw(self, y: ir.Value, full: list[int], after: ir.Node) -> ir.Value:
        o, t = full[-1], math.prod(full[:-1])
        base = f"{scope(after)}/FromNCHW"
        if t == 1:
            return self._reshape(y, full, base, None, after)
        tr = new_node(self.graph, None, "Transpose", [y], base, {"perm": [0, 2, 3, 1]}, [1, 1, t, o], y.dtype,
                      after=after)  # fmt: skip
        return self._reshape(tr.outputs[0], full, base, None, tr)

    def _reshape(self, x, shape, base, before, after=None) -> ir.Value:
        return new_node(
            self.graph, before, "Reshape", [x, shape_constant(self.graph, shape)], base, None, shape, x.dtype, after=after
        ).outputs[0]

    def convert(self, node: ir.Node, weight: np.ndarray) -> None:
        x, out = node.inputs[0], node.outputs[0]
        full = shape_of(out)
        o, t = full[-1], math.prod(full[:-1])
        xn = self.to_nchw(x, node)
        old = node.inputs[1]
        if old.is_initializer() and len(old.uses()) == 1:
            del self.graph.initializers[old.name]  # frees its name for the conv weight
        w = add_initializer(self.graph, f"{scope(node)}.weight", weight.reshape(*weight.shape, 1, 1))
        inputs = [xn, w]
        bias_add = _bias_add(node, o)
        if bias_add is not None:
            b = const_array(next(v for v in bias_add.inputs if v is not out)).reshape(o)
            inputs.append(add_initializer(self.graph, f"{scope(node)}.bias", b.astype(weight.dtype)))
        conv = new_node(self.graph, node, "Conv", inputs, f"{scope(node)}/Conv", {"kernel_shape": [1, 1]},
                        [1, o, 1, t], out.dtype)  # fmt: skip
        self.replaced.append(node)
        self.nchw[out] = conv.outputs[0]
        if bias_add is not None:
            self.replaced.append(bias_add)
            self.done.add(bias_add)
            self.nchw[bias_add.outputs[0]] = conv.outputs[0]

    def visit(self, node: ir.Node) -> None:
        if not self.push or node.op_type not in _PUSH or len(node.outputs) != 1:
            return
        out = node.outputs[0]
        full = shape_of(out)
        ins = []
        for v in node.inputs:
            if v in self.nchw and shape_of(v) == full:
                ins.append(self.nchw[v])
            elif v is not None and v.const_value is not None and v.const_value.size == 1:
                ins.append(v)
            else:
                return
        if not any(v in self.nchw for v in node.inputs):
            return
        t = math.prod(full[:-1])
        new = new_node(self.graph, node, node.op_type, ins, node.name, {k: a.value for k, a in node.attributes.items()},
                       [1, full[-1], 1, t], out.dtype)  # fmt: skip
        self.replaced.append(node)
        self.nchw[out] = new.outputs[0]

    def materialize(self) -> None:
        dropping = set(self.replaced)
        outputs = set(self.graph.outputs)
        for node in self.replaced:
            v = node.outputs[0]
            users = [u for u, _ in v.uses() if u not in dropping]
            if not users and v not in outputs:
                continue
            back = self.from_nchw(self.nchw[v], shape_of(v), self.nchw[v].producer())
            take_over(v, back, "nchw")
        for node in reversed(self.replaced):
            if not any(o.uses() for o in node.outputs):
                self.graph.remove(node, safe=True)


def _bias_add(node: ir.Node, o: int) -> ir.Node | None:
    users = list(node.outputs[0].uses())
    if len(users) != 1 or users[0][0].op_type != "Add":
        return None
    add = users[0][0]
    other = [v for v in add.inputs if v is not node.outputs[0]]
    arr = const_array(other[0]) if len(other) == 1 else None
    if arr is None or arr.size != o or (arr.ndim and arr.shape[-1] != o):
        return None
    return add


def _first_user(graph: ir.Graph, x: ir.Value, default: ir.Node) -> ir.Node:
    users = {u for u, _ in x.uses()}
    return next((n for n in graph if n in users), default)


@register("linear_to_conv")
class LinearToConv(GraphPass):
    class Config(PassConfig):
        keep_layout: Literal["nchw", "none"] = "nchw"  # push layout changes through elementwise ops

    def rewrite(self, model: ir.Model) -> bool:
        cv = _Converter(model, self.config.keep_layout == "nchw")
        for node in list(model.graph):
            w = linear_weight(node)
            if w is not None:
                cv.convert(node, w[0])
            elif node not in cv.done:
                cv.visit(node)
        if not cv.replaced:
            return False
        cv.materialize()
        remove_unused(model)
        if cv.push:
            simplify(model)  # cancel the reshape/transpose chains left at block boundaries
        return True

    def ensures(self, model: ir.Model) -> None:
        for node in model.graph:
            if node.op_type == "Gemm" and const_array(node.inputs[1]) is not None:
                raise AssertionError(f"Gemm {node.name} with a constant weight remains")
            if linear_weight(node) is not None:
                raise AssertionError(f"MatMul {node.name} with a constant 2-D weight remains")
