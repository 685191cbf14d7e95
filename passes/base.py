"""The two kinds of pass, and what every pass declares.

- `GraphPass` rewrites one step graph in place (an onnx_ir InPlacePass). A subclass implements
  `rewrite(model) -> bool` (whether it changed anything) and `ensures(model)` (raises
  AssertionError when the invariant it promises does not hold); the base class keeps the graph's
  name cache honest after a rewrite, so no pass has to remember it.
- `GraphSetPass` turns one family's graph into several stages (split_layers -> parts,
  split_lm_head -> lm_head; see toolchain/ir/graphset.py). A subclass implements
  `apply(graphset, family) -> GraphSet` and `ensures(graphset, family)`.

Both take a pydantic `Config` (extra="forbid") of their options and may declare order
constraints: `runs_after` / `runs_before` name passes that, when a recipe lists both, must come
earlier / later. The registry checks a recipe's list against them before any work, so a wrong
order is one clear error naming both passes instead of a failure deep inside a rewrite.
"""

from __future__ import annotations

from typing import Any, ClassVar

import onnx_ir as ir
from pydantic import BaseModel, ConfigDict

from toolchain.ir.graph import mark_names_stale
from toolchain.ir.graphset import GraphSet


class PassConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PassSpec:
    """What a registered pass declares besides its rewrite: name, options, order constraints."""

    pass_name: ClassVar[str]
    Config: ClassVar[type[PassConfig]] = PassConfig
    runs_after: ClassVar[tuple[str, ...]] = ()
    runs_before: ClassVar[tuple[str, ...]] = ()
    # outputs this pass relaxes to argmax-exact (toolchain/compile/contracts.py), from it on
    argmax_exact_outputs: ClassVar[tuple[str, ...]] = ()
    config: Any

    def _init_config(self, config: PassConfig | None) -> None:
        self.config = config or self.Config()


class GraphPass(ir.passes.InPlacePass, PassSpec):
    def __init__(self, config: PassConfig | None = None):
        super().__init__()
        self._init_config(config)

    def rewrite(self, model: ir.Model) -> bool:
        raise NotImplementedError

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = bool(self.rewrite(model))
        if modified:
            mark_names_stale(model.graph)  # nodes and values were added or renamed
        return ir.passes.PassResult(model, modified=modified)


class GraphSetPass(PassSpec):
    def __init__(self, config: PassConfig | None = None):
        self._init_config(config)

    def apply(self, graphs: GraphSet, family: str) -> GraphSet:
        raise NotImplementedError

    def ensures(self, graphs: GraphSet, family: str) -> None:
        """Raises AssertionError when the family's stages break the pass's promise."""
