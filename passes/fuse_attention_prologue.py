"""fuse_attention_prologue: a layer's q/k/v split, rotations and CacheAttention as one mobc op.

After fuse_projections, fuse_rotary, simplify_layout and cache_attention a Llama-style layer goes
from its fused q/k/v projection to the o_proj through ~11 nodes: Split, a Reshape (and Transpose)
per head kind, two RotaryEmbeddings, the Transposes/Reshapes that put the new keys and values in the
cache's layout, CacheAttention, and the Reshapes (and Transpose) back to [.., N, Hq D]. Each node
costs onnxruntime ~0.5-1.5 us of dispatch (more with two threads) on a one-row step whose real work
is a few microseconds. `QKVCacheAttention` (toolchain/kernels/layer_ops.c) does the same in one call:

    out, new_key, new_value = QKVCacheAttention(qkv, cos, sin, past_key, past_value, mask, scale)

Layout ops are recognized by what they do, not by how the exporter spelled them: every chain of
Reshape/Transpose nodes is replayed on an index array and must move elements exactly as the fused
op does (queries [.., N, Hq D] -> [1, Hq, N, D] -> [G, Hq/G, N, D]; keys -> [G, 1, D, N]; values
-> [G, 1, N, D]; the result [G, Hq/G, N, D] -> [.., N, Hq D]). The rotations must be the halves
layout over the whole head with positions 0..N-1 into per-call tables of N rows (fuse_rotary's form).
The new keys and values keep their names, so they stay the graph's `new_key_i` / `new_value_i`.
Biases added to each kind after the split (Qwen2) become one Add of their concatenation before it.

A CPU pass (a mobc.cpu op; check_htp refuses it). Requires: cache_attention's CacheAttention nodes.
Layers in any other form (q/k norms between the split and the rotation, as Qwen3 and Gemma 3 have)
are left as they are. Ensures: no CacheAttention is fed by a chain this pass would fuse.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from passes.base import GraphPass
from passes.registry import register
from toolchain import kernels
from toolchain.ir.graph import (
    add_initializer,
    const_array,
    new_node,
    onnx_op,
    remove_unused,
    scope,
    shape_of,
    sole_reader,
    take_over,
)

LAYOUT_OPS = ("Reshape", "Transpose")


@dataclass
class _Prologue:
    attention: ir.Node
    qkv: ir.Value
    bias: np.ndarray | None  # [(Hq + 2G) D]: the q/k/v biases (Qwen2) added after the split, or None
    cos: ir.Value
    sin: ir.Value
    out: ir.Value  # what the o_proj reads: [.., N, Hq D]
    nodes: list[ir.Node]  # everything the fused op replaces


def _chain_back(value: ir.Value) -> tuple[list[ir.Node], ir.Value]:
    """The Reshape/Transpose nodes that lead to `value` (in graph order) and the value they start
    from; every value inside the chain has one use, or it could not be dropped."""
    chain: list[ir.Node] = []
    node = value.producer()
    while onnx_op(node, *LAYOUT_OPS):
        chain.insert(0, node)
        value = node.inputs[0]
        if sole_reader(value) is None:
            break
        node = value.producer()
    return chain, value


def _chain_forward(value: ir.Value) -> tuple[list[ir.Node], ir.Value]:
    chain: list[ir.Node] = []
    while onnx_op(node := sole_reader(value), *LAYOUT_OPS) and value is node.inputs[0]:
        chain.append(node)
        value = node.outputs[0]
    return chain, value


def _replay(chain: list[ir.Node], array: np.ndarray) -> np.ndarray | None:
    """`array` moved by the chain's Reshapes and Transposes, or None when one cannot be replayed."""
    for node in chain:
        if node.op_type == "Transpose":
            perm = node.attributes.get("perm")
            array = array.transpose(list(perm.as_ints()) if perm is not None else None)
            continue
        shape = const_array(node.inputs[1])
        if shape is None:
            return None
        allowzero = node.attributes.get("allowzero")
        dims = [array.shape[i] if d == 0 and not (allowzero and allowzero.as_int()) else int(d)
                for i, d in enumerate(shape.reshape(-1))]
        try:
            array = array.reshape(dims)
        except ValueError:
            return None
    return array


def _moves_like(chain: list[ir.Node], start: ir.Value, end: ir.Value, want) -> bool:
    """Whether the chain from `start` to `end` moves elements as `want` (a function of the index
    array shaped like start) does, ending in end's shape."""
    shape = shape_of(start)
    index = np.arange(int(np.prod(shape))).reshape(shape)
    got, expected = _replay(chain, index), want(index)
    return (got is not None and list(got.shape) == shape_of(end) and expected.shape == got.shape
            and bool((got == expected).all()))


def _unbiased(value: ir.Value) -> tuple[ir.Value, np.ndarray | None, list[ir.Node]]:
    """value, or the value a constant 1-D bias is added to to make it (and that Add)."""
    node = value.producer()
    if not onnx_op(node, "Add"):
        return value, None, []
    for x, b in (node.inputs, node.inputs[::-1]):
        bias = const_array(b)
        if bias is not None and x is not None and x.const_value is None and bias.ndim == 1 and sole_reader(x) is not None:
            return x, bias, [node]
    return value, None, []


def _rotary(node: ir.Node | None, n: int, d: int) -> bool:
    """fuse_rotary's form: halves layout, the whole head, rows 0..n-1 of per-call [n, d/2] tables."""
    if node is None or node.op_type != "RotaryEmbedding" or node.domain != "com.microsoft" or len(node.inputs) != 4:
        return False
    attrs = {k: (a.value if a is not None else None) for k, a in node.attributes.items()}
    if attrs.get("interleaved", 0) or attrs.get("is_packed_batching", 0) or attrs.get("rotary_embedding_dim", 0) not in (0, d) \
            or attrs.get("num_heads", 0) or attrs.get("scale", 1.0) != 1.0:
        return False
    positions = const_array(node.inputs[1])
    if positions is None or not np.array_equal(positions.reshape(-1), np.arange(n)):
        return False
    try:
        return all(int(np.prod(shape_of(t))) == n * d // 2 for t in node.inputs[2:4]) and len(shape_of(node.inputs[0])) == 4
    except ValueError:
        return False


def _match(attention: ir.Node) -> _Prologue | None:
    q, past_key, new_key, past_value, new_value, mask, scale = attention.inputs
    try:
        g, per_group, n, d = shape_of(q)
        hq = g * per_group
        if sole_reader(q) is None:
            return None
        q_chain, q_rot_out = _chain_back(q)
        k_chain, k_rot_out = _chain_back(new_key)
        q_rot, k_rot = q_rot_out.producer(), k_rot_out.producer()
        if not (_rotary(q_rot, n, d) and _rotary(k_rot, n, d) and sole_reader(q_rot_out) is not None and sole_reader(k_rot_out) is not None):
            return None
        if q_rot.inputs[2] is not k_rot.inputs[2] or q_rot.inputs[3] is not k_rot.inputs[3]:
            return None
        q_pre, q_start = _chain_back(q_rot.inputs[0])
        k_pre, k_start = _chain_back(k_rot.inputs[0])
        v_chain, v_start = _chain_back(new_value)
        (q_split, q_bias, q_add), (k_split, k_bias, k_add), (v_split, v_bias, v_add) = (
            _unbiased(v) for v in (q_start, k_start, v_start))
        # every value the fused op swallows is read only inside the pattern
        if any(sole_reader(v) is None for v in (q_start, k_start, v_start, q_rot.inputs[0], k_rot.inputs[0])):
            return None
        split = q_split.producer()
        if split is None or split.op_type != "Split" or len(split.outputs) != 3 or \
                list(split.outputs) != [q_split, k_split, v_split]:
            return None
        qkv = split.inputs[0]
        qkv_shape = shape_of(qkv)
        axis = split.attributes.get("axis")
        if (axis.as_int() if axis is not None else 0) not in (-1, len(qkv_shape) - 1):
            return None
        if qkv_shape[-1] != (hq + 2 * g) * d or int(np.prod(qkv_shape[:-1])) != n or \
                [shape_of(v)[-1] for v in split.outputs] != [hq * d, g * d, g * d] or \
                any(sole_reader(v) is None for v in split.outputs):
            return None
        out_chain, out = _chain_forward(attention.outputs[0])
    except (ValueError, TypeError):
        return None

    def heads(index, h):  # [.., N, h D] -> [1, h, N, D]
        return index.reshape(n, h, d).transpose(1, 0, 2)[None]

    moves = (
        _moves_like(q_pre, q_start, q_rot.inputs[0], lambda i: heads(i, hq))
        and _moves_like(k_pre, k_start, k_rot.inputs[0], lambda i: heads(i, g))
        and _moves_like(q_chain, q_rot_out, q, lambda i: i.reshape(g, per_group, n, d))
        and _moves_like(k_chain, k_rot_out, new_key, lambda i: i[0].transpose(0, 2, 1)[:, None])
        and _moves_like(v_chain, v_start, new_value, lambda i: heads(i, g)[0][:, None])
        and _moves_like(out_chain, attention.outputs[0], out,
                        lambda i: i.reshape(hq, n, d).transpose(1, 0, 2).reshape(qkv_shape[:-1] + [hq * d]))
    )
    if not moves or shape_of(past_key) != [g, 1, d, shape_of(past_key)[-1]]:
        return None
    biases = [(b, size) for b, size in ((q_bias, hq * d), (k_bias, g * d), (v_bias, g * d))]
    if any(b is not None and b.shape != (size,) for b, size in biases):
        return None
    bias = None
    if any(b is not None for b, _ in biases):  # one Add before the split: the same sums
        bias = np.concatenate([np.zeros(size, np.float32) if b is None else b.astype(np.float32) for b, size in biases])
    nodes = [split, *q_add, *k_add, *v_add, *q_pre, *k_pre, q_rot, k_rot, *q_chain, *k_chain, *v_chain, attention,
             *out_chain]
    return _Prologue(attention, qkv, bias, q_rot.inputs[2], q_rot.inputs[3], out, nodes)


def find_prologues(graph: ir.Graph) -> list[_Prologue]:
    return [m for node in graph if node.op_type == "CacheAttention" and node.domain == kernels.DOMAIN
            and (m := _match(node)) is not None]


@register("fuse_attention_prologue")
class FuseAttentionPrologue(GraphPass):
    runs_after = ("fuse_projections", "fuse_rotary", "cache_attention")
    runs_before = ("check_htp",)

    def rewrite(self, model: ir.Model) -> bool:
        found = find_prologues(model.graph)
        if not found:
            return False
        kernels.require("fuse_attention_prologue")
        for m in found:
            a = m.attention
            _, past_key, new_key, past_value, new_value, mask, scale = a.inputs
            qkv = m.qkv
            if m.bias is not None:
                bias = add_initializer(model.graph, f"{scope(a) or 'attention'}.qkv_bias", m.bias)
                qkv = new_node(model.graph, m.nodes[-1], "Add", [qkv, bias], f"{scope(a) or 'attention'}/qkv_bias",
                               None, shape_of(qkv), ir.DataType.FLOAT).outputs[0]
            node = new_node(model.graph, m.nodes[-1], "QKVCacheAttention",
                            [qkv, m.cos, m.sin, past_key, past_value, mask, scale],
                            f"{scope(a) or 'attention'}/QKVCacheAttention", None, shape_of(m.out),
                            ir.DataType.FLOAT, num_outputs=3)
            node.domain = kernels.DOMAIN
            for fused, old in zip(node.outputs[1:], (new_key, new_value), strict=True):
                fused.shape, fused.type = ir.Shape(shape_of(old)), ir.TensorType(ir.DataType.FLOAT)
            ir.convenience.replace_all_uses_with(m.out, node.outputs[0])
            take_over(new_key, node.outputs[1], "unfused")  # keeps the name new_key_i (a graph output)
            take_over(new_value, node.outputs[2], "unfused")
            for old in reversed(m.nodes):
                model.graph.remove(old, safe=True)
        model.opset_imports.setdefault(kernels.DOMAIN, kernels.OPSET)
        remove_unused(model)
        return True

    def ensures(self, model: ir.Model) -> None:
        left = find_prologues(model.graph)
        if left:
            raise AssertionError(f"{len(left)} layers still split, rotate and attend in separate nodes")
