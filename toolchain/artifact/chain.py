"""Stage chains: a family (one recipe graph) is an ordered chain of stages joined by tensor name.

Before any pass a family is one step graph. Splitting passes cut it into stages (parts, an
lm_head): the stages run in `stage` order; every stage input is fed from the family's external
inputs or from an earlier stage's output of the same name; the family's outputs are the stage
outputs that no later stage consumes. The compiler (toolchain/ir/graphset.py, stages holding
onnx_ir models) and the runtime (manifest GraphRecords, stages holding file names) run chains
with the same function, so both compute exactly what the uncut graph computed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import numpy as np

# Inputs that passes add for the runtime to bind per request (LoRA adapters, forecast
# embeddings). All zeros is their neutral value (the base model), so a caller that does not
# know them, e.g. verification, may leave them out.
OPTIONAL_INPUT_PREFIXES = ("lora_", "forecast_", "features")
# family outputs kept even when a later stage consumes them: the residual entering the lm_head is the
# feature a draft head reads (toolchain/runtime/head_draft.py)
KEPT_OUTPUTS = ("hidden",)


class Stage(Protocol):
    """What a chain needs of a stage: its name, order, I/O names and input shapes."""

    name: str
    family: str
    stage: int

    @property
    def input_names(self) -> list[str]: ...

    @property
    def output_names(self) -> list[str]: ...

    def input_shape(self, name: str) -> tuple[list[int], str]: ...


S = TypeVar("S", bound=Stage)


def optional_zeros(stage: Stage, name: str) -> np.ndarray | None:
    """Zeros for an optional input of a stage (its neutral value), else None."""
    if not name.startswith(OPTIONAL_INPUT_PREFIXES):
        return None
    shape, dtype = stage.input_shape(name)
    return np.zeros(shape, np.dtype(dtype))


def order(stages: Sequence[S], family: str) -> list[S]:
    """The family's stages in chain order."""
    return sorted((s for s in stages if s.family == family), key=lambda s: s.stage)


def families(stages: Sequence[Stage]) -> list[str]:
    """Family names in first-seen order."""
    return list(dict.fromkeys(s.family for s in stages))


RunFn = Callable[[S, dict[str, np.ndarray]], dict[str, np.ndarray]]


def run_chain(stages: Sequence[S], feeds: dict[str, np.ndarray], run: RunFn) -> dict[str, np.ndarray]:
    """Runs a family's stages in order; returns every output no later stage consumed (and KEPT_OUTPUTS)."""
    env = dict(feeds)
    produced: dict[str, np.ndarray] = {}
    for stage in stages:
        for n in stage.input_names:
            if n not in env and (zeros := optional_zeros(stage, n)) is not None:
                env[n] = zeros
        missing = [n for n in stage.input_names if n not in env]
        if missing:
            raise KeyError(f"graph {stage.name} needs inputs {missing} that nothing provides")
        outs = run(stage, {n: env[n] for n in stage.input_names})
        for name in stage.input_names:
            if name not in KEPT_OUTPUTS:
                produced.pop(name, None)  # consumed by this stage
        env.update(outs)
        produced.update(outs)
    return produced
