"""check_htp: assert the graph is in the subset the QNN HTP backend accepts (no rewrite).

What the exported step graphs were found to contain (tiny Llama/Qwen2/Qwen3/Gemma3 and
SmolLM2): int32 input_ids into a Gather, float additive masks (so no GatherND/Where/And mask
building), ranks <= 4 everywhere, int64 only in constant shape/axes operands. So no rewrite pass
is needed today; this pass guards those facts at the end of a recipe, so a capture change (an
integer mask, a rank-5 reshape, an int64 input) fails the compile here with the node named rather
than deep inside QNN finalize. (RMSNorm's Pow(x, 2), which fails HTP finalize, is rewritten by
scale_rmsnorm.)

Rewrite rules: none.
Requires: nothing.
Ensures: graph inputs/outputs are float32/float16/int32; every value has rank <= `max_rank`;
  no op from `banned_ops`; every int64 value is a constant (shape, axes, slice bounds).
"""

from __future__ import annotations

import onnx_ir as ir

from passes.base import GraphPass, PassConfig
from passes.registry import register
from toolchain.errors import PassError
from toolchain.ir.graph import onnx_op

# onnxruntime contrib ops that live in the ONNX domain (the CPU passes write them)
ORT_CONTRIB_OPS = {"SimplifiedLayerNormalization"}
_IO_TYPES = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.INT32}


@register("check_htp")
class CheckHtp(GraphPass):
    class Config(PassConfig):
        max_rank: int = 4
        banned_ops: list[str] = ["GatherND", "ScatterND", "NonZero", "Loop", "If", "Scan"]

    def problems(self, model: ir.Model) -> list[str]:
        found = []
        g = model.graph
        for v in [*g.inputs, *g.outputs]:
            if v.dtype not in _IO_TYPES:
                found.append(f"graph I/O {v.name} is {v.dtype}; HTP graphs take float or int32 tensors")
        for node in g:
            if node.op_type in self.config.banned_ops:
                found.append(f"{node.op_type} node {node.name} is not supported by QNN HTP")
            elif not onnx_op(node) or node.op_type in ORT_CONTRIB_OPS:
                found.append(f"{node.op_type} node {node.name} is an onnxruntime CPU op (from a CPU pass "
                             "such as matmul_nbits or fuse_rmsnorm); drop that pass from an NPU recipe")
            for v in node.outputs:
                if v.shape is not None and len(v.shape) > self.config.max_rank:
                    found.append(f"{node.name} makes a rank-{len(v.shape)} tensor {v.name} (HTP: <= 4)")
                if v.dtype == ir.DataType.INT64 and v.const_value is None:
                    found.append(f"{node.name} computes int64 {v.name} at run time (HTP: int32 indices)")
        return found

    def rewrite(self, model: ir.Model) -> bool:
        found = self.problems(model)
        if found:
            more = f" (and {len(found) - 5} more)" if len(found) > 5 else ""
            raise PassError(f"graph {model.graph.name!r} is not HTP-ready: " + "; ".join(found[:5]) + more)
        return False

    def ensures(self, model: ir.Model) -> None:
        assert not self.problems(model)
