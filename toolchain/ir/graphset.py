"""The compiler's view of an artifact: a set of onnx_ir graphs, grouped into families.

A *family* is one recipe graph (decode, prefill, tree, ...). Before any pass it is one step
graph; splitting passes cut it into stages that chain by tensor name, with the rules of
toolchain/artifact/chain.py (the runtime runs the emitted files with the same rules).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx_ir as ir

from toolchain.artifact import chain


@dataclass
class GraphEntry:
    name: str  # file stem, unique in the artifact: decode, decode_part1, decode_lm_head, ...
    model: ir.Model
    family: str  # the recipe graph this belongs to
    role: str  # decode / prefill / tree / diffusion / custom / lm_head / part
    width: int
    context: int
    stage: int = 0  # order within the family's chain
    meta: dict = field(default_factory=dict)  # e.g. {"layers": [0, 15]} for a part

    @property
    def input_names(self) -> list[str]:
        return [v.name for v in self.model.graph.inputs]

    @property
    def output_names(self) -> list[str]:
        return [v.name for v in self.model.graph.outputs]

    def input_shape(self, name: str) -> tuple[list[int], str]:
        value = next(v for v in self.model.graph.inputs if v.name == name)
        return [int(d) for d in value.shape], str(value.dtype.numpy())


@dataclass
class GraphSet:
    entries: dict[str, GraphEntry] = field(default_factory=dict)

    def add(self, entry: GraphEntry) -> None:
        if entry.name in self.entries:
            raise ValueError(f"graph {entry.name!r} already exists")
        self.entries[entry.name] = entry

    def families(self) -> list[str]:
        return chain.families(list(self.entries.values()))

    def chain(self, family: str) -> list[GraphEntry]:
        return chain.order(list(self.entries.values()), family)

    def replace_family(self, family: str, stages: list[GraphEntry]) -> None:
        for e in self.chain(family):
            del self.entries[e.name]
        for s in stages:
            self.add(s)
