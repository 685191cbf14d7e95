"""rescale_residual: carry the whole residual stream multiplied by a constant c (a power of two).

The residual stream of a pre-norm decoder is only read by RMSNorms (scale-invariant up to eps)
and by the residual Adds, so scaling it by c everywhere is exact in real arithmetic:
  - the stream's first value (the embedding, after any embedding scale) is multiplied by c;
  - every branch written into the stream (attention o_proj, MLP down_proj, or Gemma's post-norms)
    is multiplied by c;
  - every RMSNorm that reads the stream gets eps·c², since norm(c·x; eps·c²) = norm(x; eps).
Why: Gemma 3's residual reaches ~104k on the BOS token, above fp16's 65504, so an fp16 NPU (QNN
HTP) overflows it; c = 1/4 brings it to ~26k. With c a power of two every rescaled weight is
bit-exact. Measured (Gemma 3 270M decode, N=1, CL=512, HTP emulation, with scale_rmsnorm after):
BOS step vs CPU without this pass: max |K - CPU| 4.9, |logit| 3.8; with it: 0.04 / 0.04, and 5
greedy tokens identical to CPU (max logit diff 0.15-0.21 per step).

Rewrite rules (c enters where it costs nothing at run time):
  - branch / embedding produced by MatMul, Mul or Conv with a constant operand: that operand is
    scaled (a single-use initializer is replaced by '<name>.rescaled'; any other constant operand
    gets a Mul(operand, c) that fold_constants folds);
  - produced by Gather (a tied embedding table: scaling it would scale lm_head too) or anything
    else: a Mul(value, c) node '<scope>/Mul_rescale' after it.
Requires: RMSNorms in exported form (run before scale_rmsnorm; it raises otherwise), the stream
  not yet cut into graphs (run before split_lm_head / split_layers), each stream value used only
  by norms and by exactly one residual Add (true for Llama, Qwen2/3, Gemma 3 exports).
Ensures: the model carries metadata `mobc.residual_scale` = c; every norm reading the stream has
  an eps input named 'rmsnorm.eps_residual*'; no stream value is a graph output.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
from pydantic import field_validator

from passes.base import GraphPass, PassConfig
from passes.registry import register
from passes.scale_rmsnorm import match_rmsnorm
from toolchain.errors import PassError
from toolchain.ir.graph import add_initializer, new_node, remove_unused, scope

META_KEY = "mobc.residual_scale"


def residual_stream(graph: ir.Graph) -> tuple[list[ir.Value], list[ir.Node], list[dict]]:
    """(stream values in order, residual Adds, norm matches reading the stream)."""
    matches = [m for n in graph if n.op_type == "Pow" and (m := match_rmsnorm(n))]
    if not matches:
        if any("/Mul_square" in (n.name or "") for n in graph):
            raise PassError("rescale_residual must run before scale_rmsnorm (it needs the exported norms)")
        raise PassError("rescale_residual found no RMSNorm in the graph; nothing reads a residual stream")
    by_input: dict[ir.Value, list[dict]] = {}
    for m in matches:
        by_input.setdefault(m["x"], []).append(m)
    value = matches[0]["x"]
    stream, adds, norms = [value], [], []
    outputs = set(graph.outputs)
    while True:
        if value in outputs:
            raise PassError(
                f"residual value {value.name!r} is a graph output; run rescale_residual before "
                "split_lm_head / split_layers"
            )
        mine = by_input.get(value, [])
        norms.extend(mine)
        norm_nodes = {id(m["pow"]) for m in mine} | {id(mul) for m in mine for mul in m["muls"]}
        others = [u.node for u in value.uses() if id(u.node) not in norm_nodes]
        if not others:
            break
        if len(others) != 1 or others[0].op_type != "Add":
            names = ", ".join(f"{n.op_type} {n.name}" for n in others)
            raise PassError(f"residual value {value.name!r} feeds {names}; expected one residual Add")
        adds.append(others[0])
        value = others[0].outputs[0]
        stream.append(value)
    return stream, adds, norms


def _constant_derived(value: ir.Value | None, depth: int = 0) -> bool:
    if value is None or value.is_graph_input() or depth > 8:
        return False
    if value.const_value is not None:
        return True
    node = value.producer()
    return node is not None and all(_constant_derived(v, depth + 1) for v in node.inputs if v is not None)


@register("rescale_residual")
class RescaleResidual(GraphPass):
    runs_before = ("scale_rmsnorm", "split_layers", "split_parts", "split_lm_head")

    class Config(PassConfig):
        factor: float = 0.25  # c; a power of two keeps every rescaled weight bit-exact

        @field_validator("factor")
        @classmethod
        def _power_of_two(cls, v: float) -> float:
            if not (v > 0 and math.frexp(v)[0] == 0.5):
                raise ValueError(f"factor must be a positive power of two such as 0.25 (got {v})")
            return v

    def rewrite(self, model: ir.Model) -> bool:
        c = self.config.factor
        if c == 1.0 or META_KEY in model.metadata_props:
            return False
        graph = model.graph
        stream, adds, norms = residual_stream(graph)
        on_stream = set(stream)
        branches = [(next(v for v in add.inputs if v not in on_stream), add) for add in adds]
        self._scale(graph, stream[0], None, c)
        for branch, add in branches:
            self._scale(graph, branch, add, c)
        for m in norms:
            add = m["add"]
            eps = add.inputs[m["eps_index"]].const_value.numpy()
            scaled = (eps.astype(np.float64) * c * c).astype(eps.dtype)
            add.replace_input_with(m["eps_index"], add_initializer(graph, "rmsnorm.eps_residual", scaled))
        model.metadata_props[META_KEY] = repr(c)
        remove_unused(model)
        return True

    def _scale(self, graph: ir.Graph, value: ir.Value, consumer: ir.Node | None, c: float) -> None:
        """Makes `value` (as seen by `consumer`, or by everyone when None) c times larger."""
        prod = value.producer()
        dtype = value.dtype or ir.DataType.FLOAT
        c_value = add_initializer(graph, f"residual.scale_{c:g}", np.array(c, dtype=dtype.numpy()))
        if prod is not None and prod.op_type in ("MatMul", "Mul", "Conv") and (consumer is None or len(value.uses()) == 1):
            for idx, operand in enumerate(prod.inputs[:2]):
                if not _constant_derived(operand):
                    continue
                if operand.is_initializer() and len(operand.uses()) == 1:
                    arr = operand.const_value.numpy()
                    scaled = add_initializer(graph, f"{operand.name}.rescaled", (arr * c).astype(arr.dtype))
                else:
                    scaled = new_node(graph, prod, "Mul", [operand, c_value], f"{scope(prod)}/Mul_rescale_w",
                                      shape=list(operand.shape) if operand.shape else None,
                                      dtype=operand.dtype).outputs[0]
                prod.replace_input_with(idx, scaled)
                return
        # no constant operand to absorb c (e.g. the Gather of a tied embedding): one Mul after it
        where = scope(prod) if prod is not None else "residual"
        mul = new_node(graph, None, "Mul", [value, c_value], f"{where}/Mul_rescale",
                       shape=list(value.shape) if value.shape else None, dtype=dtype)
        graph.remove(mul, safe=False)
        if prod is not None:
            graph.insert_after(prod, mul)
        else:
            graph.insert_before(next(iter(graph)), mul)
        targets = [consumer] if consumer is not None else [u.node for u in value.uses() if u.node is not mul]
        for node in targets:
            for i, v in enumerate(node.inputs):
                if v is value:
                    node.replace_input_with(i, mul.outputs[0])

    def ensures(self, model: ir.Model) -> None:
        assert META_KEY in model.metadata_props, "model carries no residual scale"
        _, _, norms = residual_stream(model.graph)
        for m in norms:
            eps = m["add"].inputs[m["eps_index"]]
            assert (eps.name or "").startswith("rmsnorm.eps_residual"), (
                f"norm {m['pow'].name} reads the stream with an unscaled eps"
            )
