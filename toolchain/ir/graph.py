"""Small onnx_ir helpers shared by the passes (no pass lives here).

Node names follow toolchain/compile/export.py: '<module path>/<op>[_k]', e.g. 'layers.3.self_attn.q_proj/MatMul'.
Passes that add nodes keep the module-path prefix of the node they replace, so later passes
(split_layers, split_lm_head) can still tell which layer or head a node belongs to.
"""

from __future__ import annotations

import re

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from toolchain.ir import disk

_LAYER = re.compile(r"^layers\.(\d+)[./]")


def scope(node: ir.Node) -> str:
    """'layers.3.self_attn.q_proj/MatMul' -> 'layers.3.self_attn.q_proj'."""
    name = node.name or ""
    return name.rsplit("/", 1)[0] if "/" in name else ""


def layer_of(node: ir.Node) -> int | None:
    m = _LAYER.match(node.name or "")
    return int(m.group(1)) if m else None


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """The constant behind a value (initializer or folded constant), else None."""
    if value is None or value.const_value is None:
        return None
    return value.const_value.numpy()


def linear_weight(node: ir.Node) -> tuple[np.ndarray, str] | None:
    """The [O, C] weight behind a MatMul's second input (a constant W[C, O], or Transpose(E) of a
    constant E[O, C] as a tied lm_head) and its initializer's name, or None when it is not a constant."""
    if node.op_type != "MatMul" or len(node.inputs) != 2:
        return None
    w = node.inputs[1]
    arr = const_array(w)
    if arr is not None and arr.ndim == 2:
        return np.ascontiguousarray(arr.T), w.name
    prod = w.producer() if w is not None else None
    if prod is not None and prod.op_type == "Transpose":
        src = const_array(prod.inputs[0])
        perm = prod.attributes.get("perm")
        if src is not None and src.ndim == 2 and (perm is None or list(perm.value) == [1, 0]):
            return src, prod.inputs[0].name  # tied lm_head: the embedding table is already [O, C]
    return None


ONNX_DOMAINS = ("", "ai.onnx")


def onnx_op(node: ir.Node | None, *op_types: str) -> bool:
    """Whether node is a standard ONNX op (one of op_types, if any are given), not a contrib or
    custom one that only shares its name."""
    return node is not None and node.domain in ONNX_DOMAINS and (not op_types or node.op_type in op_types)


def sole_reader(value: ir.Value, op_type: str | None = None) -> ir.Node | None:
    """The one node reading `value` (of op_type, if given) when nothing else reads it and it is not
    a graph output: a value a fusion may swallow together with its producer."""
    uses = list(value.uses())
    if value.is_graph_output() or len(uses) != 1:
        return None
    node = uses[0].node
    return node if op_type is None or node.op_type == op_type else None


def is_initializer(value: ir.Value | None) -> bool:
    return value is not None and value.is_initializer()


def add_initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """Adds (or reuses, when the same name already holds the same bytes) a named initializer.

    Deterministic names are what lets graphs of different widths share weights on disk.
    """
    existing = graph.initializers.get(name)
    if existing is not None:
        old = existing.const_value.numpy()
        if old.shape == array.shape and old.dtype == array.dtype and np.array_equal(old, array):
            return existing
        k = 1
        while f"{name}_{k}" in graph.initializers:
            k += 1
        name = f"{name}_{k}"
    array = np.ascontiguousarray(array)
    value = ir.Value(
        name=name,
        shape=ir.Shape(array.shape),
        type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
        const_value=disk.as_tensor(name, array),  # large arrays go to disk while a spill is active
    )
    graph.register_initializer(value)
    return value



def shape_constant(graph: ir.Graph, shape: list[int]) -> ir.Value:
    """The int64 target of a Reshape to `shape`, named by its dims so every node (and graph) shares it."""
    return add_initializer(graph, "shape." + "x".join(map(str, shape)), np.array(shape, np.int64))
def new_node(
    graph: ir.Graph,
    before: ir.Node | None,
    op: str,
    inputs: list[ir.Value | None],
    name: str,
    attributes: dict | None = None,
    shape: list[int] | None = None,
    dtype: ir.DataType | None = None,
    num_outputs: int = 1,
    after: ir.Node | None = None,
) -> ir.Node:
    """Creates a node named `name`, inserts it before `before` (or after `after`, or appends)
    and types output 0."""
    attrs = [ir.Attr(k, _attr_type(v), v) for k, v in (attributes or {}).items()]
    name = unique_node_name(graph, name)
    node = ir.Node("", op, inputs, attributes=attrs, num_outputs=num_outputs, name=name)
    if after is not None:
        graph.insert_after(after, node)
    elif before is None:
        graph.append(node)
    else:
        graph.insert_before(before, node)
    out = node.outputs[0]
    out.name = unique_value_name(graph, name.replace("/", "_"))
    if shape is not None:
        out.shape = ir.Shape(shape)
    if dtype is not None:
        out.type = ir.TensorType(dtype)
    return node


def _names(graph: ir.Graph) -> tuple[set[str], set[str]]:
    """(value names, node names) in use, kept on the graph and rebuilt after a pass marks them
    stale (passes that add nodes through onnxscript or onnx_ir directly call mark_names_stale)."""
    if getattr(graph, "_mobc_names_stale", True) or not hasattr(graph, "_mobc_names"):
        values = {v.name for v in graph.inputs} | set(graph.initializers)
        nodes = set()
        for n in graph:
            values.update(o.name for o in n.outputs if o.name)
            nodes.add(n.name)
        graph._mobc_names = (values, nodes)  # type: ignore[attr-defined]
        graph._mobc_names_stale = False  # type: ignore[attr-defined]
    return graph._mobc_names  # type: ignore[attr-defined]


def _unique(used: set[str], base: str, sep: str) -> str:
    name, k = base, 1
    while name in used:
        name = f"{base}{sep}{k}"
        k += 1
    used.add(name)
    return name


def unique_value_name(graph: ir.Graph, base: str) -> str:
    """Deterministic unique value names per graph (graph order decides suffixes)."""
    return _unique(_names(graph)[0], base, "_")


def unique_node_name(graph: ir.Graph, base: str) -> str:
    return _unique(_names(graph)[1], base, "_")


def mark_names_stale(graph: ir.Graph) -> None:
    graph._mobc_names_stale = True  # type: ignore[attr-defined]


def _attr_type(v) -> ir.AttributeType:
    if isinstance(v, bool | int):
        return ir.AttributeType.INT
    if isinstance(v, float):
        return ir.AttributeType.FLOAT
    if isinstance(v, str):
        return ir.AttributeType.STRING
    if isinstance(v, list | tuple):
        if all(isinstance(x, int) for x in v):
            return ir.AttributeType.INTS
        return ir.AttributeType.FLOATS
    raise TypeError(f"unsupported attribute value {v!r}")


def shape_of(value: ir.Value) -> list[int]:
    if value.shape is None or not value.shape.is_static():
        raise ValueError(f"value {value.name} has no static shape; mobc graphs are fully static")
    return [int(d) for d in value.shape]


def take_over(old: ir.Value, new: ir.Value, suffix: str) -> None:
    """`new` replaces `old` everywhere (graph outputs too) and takes its name, so graph I/O names
    and the names later passes look for stay put; `old` is renamed `<name>__<suffix>` until it is
    dropped as dead."""
    name = old.name
    ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
    old.name, new.name = f"{name}__{suffix}", name


def remove_unused(model: ir.Model) -> None:
    RemoveUnusedNodesPass()(model)


def weight_bytes(model: ir.Model) -> int:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def extract(model: ir.Model, inputs: list[str], outputs: list[str], name: str) -> ir.Model:
    """A new model computing `outputs` (value names) from graph inputs and the values named in
    `inputs`, which become graph inputs. Weights are shared with `model`, not copied.

    Nodes that both sides need (RoPE table prep, say) are simply computed in both.
    """
    clone = model.clone()
    graph = clone.graph
    values = ir.convenience.create_value_mapping(graph)
    old_inputs = [v for v in graph.inputs]
    new_inputs = []
    for vname in inputs:
        if any(v.name == vname for v in old_inputs):
            continue
        v = values[vname]
        fresh = ir.Value(name=vname, shape=v.shape, type=v.type)
        v.name = f"{vname}__cut"
        ir.convenience.replace_all_uses_with(v, fresh)
        new_inputs.append(fresh)
    outs = [values[o] for o in outputs]
    graph.outputs.clear()
    graph.outputs.extend(outs)
    for i, v in enumerate(new_inputs):  # cut interfaces first: they are what the chain feeds
        graph.inputs.insert(i, v)
    remove_unused(clone)
    kept = [v for v in graph.inputs if v.uses() or v in outs]
    graph.inputs.clear()
    graph.inputs.extend(kept)
    graph.name = name
    mark_names_stale(graph)
    return clone
