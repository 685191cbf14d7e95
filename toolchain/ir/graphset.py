"""A compiled model is a set of graphs; graphs of one family chain by tensor name.

A *family* is one recipe graph (decode, prefill, tree, ...). Before any pass it is one step
graph. Passes may cut it into stages (split_layers -> parts, split_lm_head -> lm_head): the
stages run in `stage` order; every stage input is fed from the family's external inputs or
from an earlier stage's output of the same name; the family's outputs are its stages' outputs
that no later stage consumes. So a chain computes exactly what the uncut graph computed, and
verification and the runtime compare and consume outputs by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir


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


@dataclass
class GraphSet:
    entries: dict[str, GraphEntry] = field(default_factory=dict)

    def add(self, entry: GraphEntry) -> None:
        if entry.name in self.entries:
            raise ValueError(f"graph {entry.name!r} already exists")
        self.entries[entry.name] = entry

    def families(self) -> list[str]:
        return list(dict.fromkeys(e.family for e in self.entries.values()))

    def chain(self, family: str) -> list[GraphEntry]:
        return sorted((e for e in self.entries.values() if e.family == family), key=lambda e: e.stage)

    def replace_family(self, family: str, stages: list[GraphEntry]) -> None:
        for e in self.chain(family):
            del self.entries[e.name]
        for s in stages:
            self.add(s)


RunFn = Callable[[GraphEntry, dict[str, np.ndarray]], dict[str, np.ndarray]]

# Inputs that passes add for the runtime to bind per request (LoRA adapters, forecast
# embeddings). All zeros is their neutral value (the base model), so a caller that does not
# know them, e.g. verification, may leave them out.
OPTIONAL_INPUT_PREFIXES = ("lora_", "forecast_")


def optional_zeros(entry, name: str) -> np.ndarray | None:
    """Zeros for an optional input of a GraphEntry (or a runtime stage record), else None."""
    if not name.startswith(OPTIONAL_INPUT_PREFIXES):
        return None
    model = getattr(entry, "model", None)
    if model is not None:
        value = next(v for v in model.graph.inputs if v.name == name)
        return np.zeros([int(d) for d in value.shape], value.dtype.numpy())
    spec = next(i for i in entry.record["inputs"] if i["name"] == name)
    return np.zeros(spec["shape"], np.float32)


def run_chain(stages: list[GraphEntry], feeds: dict[str, np.ndarray], run: RunFn) -> dict[str, np.ndarray]:
    """Runs a family's stages in order; returns every output no later stage consumed."""
    env = dict(feeds)
    produced: dict[str, np.ndarray] = {}
    for entry in stages:
        for n in entry.input_names:
            if n not in env and (zeros := optional_zeros(entry, n)) is not None:
                env[n] = zeros
        missing = [n for n in entry.input_names if n not in env]
        if missing:
            raise KeyError(f"graph {entry.name} needs inputs {missing} that nothing provides")
        outs = run(entry, {n: env[n] for n in entry.input_names})
        for name in entry.input_names:
            produced.pop(name, None)  # consumed by this stage
        env.update(outs)
        produced.update(outs)
    return produced
