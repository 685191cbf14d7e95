"""split_lm_head: move the final norm and the output projection into their own graph.

Rewrite rule (graph-level, per family): the stage that outputs `logits` is cut at the residual
stream entering the final norm (`include_norm: true`, the default) or at the norm's output
(`include_norm: false`). The cut value is renamed `hidden` [1,N,C]: the body stage outputs it in
place of `logits`, and a new stage `<family>_lm_head` (role "lm_head", input `hidden`, output
`logits`, plus any final logit soft-capping) consumes it.

Why the norm goes with the head by default: the lm_head graph then maps any residual stream to
logits, so the runtime can apply it to an intermediate layer's residual (Lever's predictor
pruning) as well as to the last one. Tied embeddings: the body keeps the embedding table for
its Gather and the head gets the same tensor object (shared in memory, deduplicated by content
on disk), so the two stay bit-identical.

Requires: a stage with output `logits` whose final norm nodes are named `norm/...` (export.py)
  and whose projection nodes are named `lm_head/...`.
Ensures (`ensures`): the family has exactly one lm_head stage, which is the last stage,
  has the single input `hidden` and outputs `logits`; no other stage outputs `logits`.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from passes.base import GraphSetPass, PassConfig
from passes.registry import register
from toolchain.errors import PassError
from toolchain.ir.graph import extract, scope
from toolchain.ir.graphset import GraphEntry, GraphSet

HIDDEN = "hidden"


def cut_value(model: ir.Model, prefix: str, who: str = "split_lm_head") -> str:
    """The single non-constant value that flows into the `prefix` scope from outside it."""
    inside = [n for n in model.graph if scope(n) == prefix or scope(n).startswith(prefix + ".")]
    members = set(inside)
    crossing = []
    for node in inside:
        for v in node.inputs:
            if v is None or v.const_value is not None or v.is_initializer():
                continue
            if v.producer() not in members and v not in crossing:
                crossing.append(v)
    if len(crossing) != 1:
        names = [v.name for v in crossing]
        raise PassError(
            f"{who}: expected one tensor flowing into the {prefix!r} nodes, found {names}; "
            "is this a mobc step graph?"
        )
    return crossing[0].name


@register("split_lm_head")
class SplitLmHead(GraphSetPass):
    class Config(PassConfig):
        include_norm: bool = True  # the final norm runs in the lm_head graph

    def apply(self, gs: GraphSet, family: str) -> GraphSet:
        chain = gs.chain(family)
        if any(e.role == "lm_head" for e in chain):
            return gs  # already split
        body = next((e for e in chain if "logits" in e.output_names), None)
        if body is None:
            raise PassError(f"split_lm_head: no stage of graph {family!r} outputs logits")
        model = body.model
        cut = cut_value(model, "norm" if self.config.include_norm else "lm_head")
        head_name = f"{family}_lm_head"
        head = extract(model, [cut], ["logits"], head_name)
        _rename(head.graph.inputs, cut, HIDDEN)
        outs = [cut if n == "logits" else n for n in body.output_names]
        trunk = extract(model, [], outs, body.name)
        _rename(trunk.graph.outputs, cut, HIDDEN)
        stages = []
        for e in chain:
            if e is body:
                stages.append(dataclasses.replace(e, model=trunk))
                stages.append(
                    GraphEntry(
                        name=head_name,
                        model=head,
                        family=family,
                        role="lm_head",
                        width=e.width,
                        context=e.context,
                        stage=e.stage + 1,
                        meta={"input": HIDDEN, "include_norm": self.config.include_norm},
                    )
                )
            else:
                shift = 1 if e.stage > body.stage else 0
                stages.append(dataclasses.replace(e, stage=e.stage + shift))
        gs.replace_family(family, stages)
        return gs

    def ensures(self, gs: GraphSet, family: str) -> None:
        chain = gs.chain(family)
        heads = [e for e in chain if e.role == "lm_head"]
        assert len(heads) == 1 and heads[0] is chain[-1], f"{family}: lm_head must be the last stage"
        assert heads[0].input_names == [HIDDEN], heads[0].input_names
        assert heads[0].output_names == ["logits"], heads[0].output_names
        assert all("logits" not in e.output_names for e in chain[:-1])


def _rename(values, old: str, new: str) -> None:
    for v in values:
        if v.name == old:
            v.name = new
            return
    raise PassError(f"split_lm_head: value {old!r} not found at the graph boundary")
