"""lora_inputs: LoRA adapters as graph inputs of one frozen graph (no recompile per adapter).

NPU graphs are frozen at compile time, so instead of merging an adapter into the weights, the
low-rank branch `(x @ A) @ B` is added to every target projection with A and B as *inputs*
at a fixed rank budget. A smaller adapter is zero-padded by the packer (toolchain/lora/pack.py),
which also folds PEFT's alpha/r scaling into B, so the graph has no scaling node.

Rewrite rules, for every projection site `layers.<i>.(self_attn|mlp).<target>[.head<h>]` whose
node is a MatMul with a constant 2-D weight W [in, out] (export.py / mha_to_sha naming):
  - one new input `lora_A.<projection>` [in, R] per projection and layer, and one
    `x_A = (x @ lora_A) * lora_rows` per distinct projection input x (after mha_to_sha all head
    copies of a projection read the same x, so x @ A runs once, not once per head);
  - one new input `lora_B.<site>` [R, out] per site: after mha_to_sha the sites are the heads and
    each head gets its own slice B[:, h*D:(h+1)*D] as an input (no Slice/Split node: the
    runtime binds per-head arrays, the same way mha_to_sha stores per-head weights);
  - the site's output y is replaced by `y + x_A @ lora_B`.
  - one input `lora_rows` [1, N, R] per graph: row n of the call uses rank columns where it is 1.
    R = max_rank * slots: a call can mix `slots` adapters, each in its own block of max_rank
    columns, and each row (token) selects its adapter's block. That is what lets one width-K
    call decode K styles (CTG) with K different adapters over one shared prompt cache.
Zero inputs add exact zeros, so an all-zero binding reproduces the base graph bit for bit.

Order: run it after mha_to_sha (per-head B inputs) and before split_layers / split_lm_head
(those cut graphs and carry the inputs into the parts that use them). linear_to_conv leaves the
LoRA MatMuls alone because their weights are inputs, not constants.
Requires: every target projection exists in every layer as such a MatMul.
Ensures: every site's output passes through the LoRA Add; every lora_* input is used; the
  original inputs and outputs are unchanged (new inputs are appended after them).
"""

from __future__ import annotations

import re
from collections import defaultdict

import onnx_ir as ir
from pydantic import Field, field_validator

from passes.base import GraphPass, PassConfig
from passes.registry import register
from toolchain.errors import PassError
from toolchain.ir.graph import const_array, new_node, scope, shape_of

LINEAR_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ROWS_INPUT = "lora_rows"
_SITE = re.compile(r"^(layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj))(?:\.head(\d+))?$")


def site_of(node: ir.Node) -> tuple[str, int, str, int | None] | None:
    """(projection path, layer, target, head or None) of a projection node, else None."""
    m = _SITE.match(scope(node))
    if m is None or node.op_type != "MatMul":
        return None
    w = const_array(node.inputs[1]) if len(node.inputs) > 1 else None
    if w is None or w.ndim != 2:
        return None
    return m.group(1), int(m.group(2)), m.group(3), int(m.group(4)) if m.group(4) is not None else None


def _input(graph: ir.Graph, name: str, shape: list[int]) -> ir.Value:
    value = ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(ir.DataType.FLOAT))
    graph.inputs.append(value)
    return value


@register("lora_inputs")
class LoraInputs(GraphPass):
    runs_after = ("mha_to_sha",)
    runs_before = ("split_layers", "split_parts", "split_lm_head")

    class Config(PassConfig):
        targets: list[str] = Field(default_factory=lambda: ["q_proj", "v_proj"],
                                   description="projection names, or [all-linear]")
        max_rank: int = Field(16, ge=1, le=256, description="largest adapter rank one slot takes")
        slots: int = Field(1, ge=1, le=64, description="adapters one call can mix (one per row)")

        @field_validator("targets")
        @classmethod
        def _targets(cls, targets: list[str]) -> list[str]:
            if targets == ["all-linear"]:
                return list(LINEAR_TARGETS)
            bad = [t for t in targets if t not in LINEAR_TARGETS]
            if bad or not targets:
                raise ValueError(f"unknown targets {bad}; use some of {', '.join(LINEAR_TARGETS)} or [all-linear]")
            return sorted(set(targets), key=LINEAR_TARGETS.index)

    @property
    def rank_total(self) -> int:
        return self.config.max_rank * self.config.slots

    def _sites(self, model: ir.Model) -> list[tuple[ir.Node, tuple[str, int, str, int | None]]]:
        out = []
        for node in model.graph:
            s = site_of(node)
            if s is not None and s[2] in self.config.targets:
                out.append((node, s))
        return out

    def _check(self, model: ir.Model) -> None:
        # raised from call(), not requires(): onnx_ir wraps requires() errors and drops the message
        if any(v.name == ROWS_INPUT for v in model.graph.inputs):
            raise PassError("lora_inputs: the graph already has LoRA inputs; list the pass once in the recipe")
        found = defaultdict(set)
        layers = set()
        for _node, (_, layer, target, _) in self._sites(model):
            found[target].add(layer)
        for node in model.graph:
            m = re.match(r"^layers\.(\d+)\.", node.name or "")
            if m:
                layers.add(int(m.group(1)))
        missing = [f"{t} (layers {sorted(layers - found[t])[:5]})" for t in self.config.targets
                   if layers - found[t]]
        if missing:
            raise PassError(
                f"lora_inputs: no constant-weight MatMul projection found for {', '.join(missing)}; "
                "run lora_inputs after mha_to_sha but before passes that rename projections, and "
                "target only projections the model has"
            )

    def rewrite(self, model: ir.Model) -> bool:
        self._check(model)
        graph = model.graph
        sites = self._sites(model)
        if not sites:
            return False
        r = self.rank_total
        n = shape_of(sites[0][0].outputs[0])[-2]
        rows = _input(graph, ROWS_INPUT, [1, n, r])
        a_inputs: dict[str, ir.Value] = {}
        x_a: dict[tuple[str, int], ir.Value] = {}  # (projection, id of x) -> (x @ A) * rows
        for node, (proj, _layer, _target, head) in sites:
            x = node.inputs[0]
            w_shape = shape_of(node.inputs[1])
            if proj not in a_inputs:
                a_inputs[proj] = _input(graph, f"lora_A.{proj}", [w_shape[0], r])
            key = (proj, id(x))
            if key not in x_a:
                lead = shape_of(x)[:-1]
                xa = new_node(graph, node, "MatMul", [x, a_inputs[proj]], f"{proj}.lora/MatMul_A",
                              shape=[*lead, r], dtype=ir.DataType.FLOAT).outputs[0]
                x_a[key] = new_node(graph, node, "Mul", [xa, rows], f"{proj}.lora/Mul_rows",
                                    shape=[*lead, r], dtype=ir.DataType.FLOAT).outputs[0]
            site = proj if head is None else f"{proj}.head{head}"
            b = _input(graph, f"lora_B.{site}", [r, w_shape[1]])
            y = node.outputs[0]
            y_shape = shape_of(y)
            delta = new_node(graph, None, "MatMul", [x_a[key], b], f"{site}.lora/MatMul_B",
                             shape=y_shape, dtype=y.dtype, after=node).outputs[0]
            add = new_node(graph, None, "Add", [y, delta], f"{site}.lora/Add", shape=y_shape,
                           dtype=y.dtype, after=delta.producer())
            out = add.outputs[0]
            # every former reader of y (bias Add, Reshape, graph output) now reads y + delta
            for use in list(y.uses()):
                if use.node is not add and use.node is not delta.producer():
                    use.node.replace_input_with(use.idx, out)
            if y in graph.outputs:
                graph.outputs[list(graph.outputs).index(y)] = out
        return True

    def ensures(self, model: ir.Model) -> None:
        graph = model.graph
        for node, (proj, _, _, head) in self._sites(model):
            site = proj if head is None else f"{proj}.head{head}"
            readers = [u.node for u in node.outputs[0].uses()]
            assert any(n.name.startswith(f"{site}.lora/Add") for n in readers), f"{site}: no LoRA branch"
        for v in graph.inputs:
            if v.name.startswith("lora_"):
                assert v.uses(), f"LoRA input {v.name} is unused"
                assert v.shape is not None and int(v.shape[-1 if v.name.startswith(("lora_A", "lora_rows")) else 0]) \
                    == self.rank_total, f"{v.name} does not have rank {self.rank_total}"
