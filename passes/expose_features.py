"""expose_features: every step graph also outputs `hidden`, the residual stream entering the final
norm [1, N, C], the features a draft head reads (toolchain/runtime/head_draft.py).

NPU recipes get `hidden` from split_lm_head, whose body stage outputs it in place of the logits. A
CPU-form recipe keeps one graph per family (certified_lm_head fuses the head into it), so this pass
exposes the same value as an extra output instead: a renamed graph output, no node added, so the
logits path runs exactly as before and the runtime binds one more [N, C] buffer per call.

Rewrite rule: the one non-constant value flowing into the final norm's nodes (scope `norm`, as the
exporter names them; before or after fuse_rmsnorm) is renamed `hidden` and added to the outputs.
Requires: the exporter's `norm/...` scope and no earlier split_lm_head (which exposes it already).
Ensures: the graph outputs `hidden` with the shape of the norm's input.
"""

from __future__ import annotations

import onnx_ir as ir

from passes.base import GraphPass
from passes.registry import register
from passes.split_lm_head import HIDDEN, cut_value
from toolchain.errors import PassError


@register("expose_features")
class ExposeFeatures(GraphPass):
    runs_before = ("split_lm_head", "split_layers")  # they move the norm into another stage

    def rewrite(self, model: ir.Model) -> bool:
        graph = model.graph
        if any(v.name == HIDDEN for v in graph.outputs):
            return False
        name = cut_value(model, "norm", "expose_features")
        value = next(v for n in graph for v in n.inputs if v is not None and v.name == name)
        if any(v.name == HIDDEN for n in graph for v in n.outputs):
            raise PassError(f"expose_features: the graph already has a value named {HIDDEN!r} that is no output")
        value.name = HIDDEN
        graph.outputs.append(value)
        return True

    def ensures(self, model: ir.Model) -> None:
        outs = [v for v in model.graph.outputs if v.name == HIDDEN]
        assert len(outs) == 1, f"graph {model.graph.name}: {len(outs)} outputs named {HIDDEN!r}"
        users = [u.node for u in outs[0].uses()]
        assert any(n.name.startswith("norm/") for n in users), f"{HIDDEN!r} does not feed the final norm"
