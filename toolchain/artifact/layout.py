"""The step graph's interface: input/output names and shapes, and the additive-mask constant.

Every decoder artifact is one "step graph" per width (DESIGN.md): N new tokens against a
fixed-length KV cache in, logits (or hidden states) and the N new K/V rows out. The compiler
exports graphs with exactly these inputs and outputs; the runtime builds feeds from the same
description. numpy-free and torch-free on purpose: both sides import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Additive mask value for "not attended": finite so fp16 NPUs never see -inf or finfo.min.
MASK_MIN = -1.0e4


@dataclass(frozen=True)
class StepLayout:
    """Names and shapes of one step graph's inputs and outputs."""

    width: int
    context: int
    n_layers: int
    n_heads: int
    n_kv: int
    head_dim: int
    hidden: int
    vocab: int
    layer_kinds: tuple[str, ...]  # per layer: "full" or "sliding"
    rope_per_kind: bool  # separate RoPE tables per layer kind (Gemma 3)
    sliding_window: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def kinds(self) -> list[str]:
        return sorted(set(self.layer_kinds))  # "full" sorts before "sliding"

    @staticmethod
    def suffix(kind: str) -> str:
        return "" if kind == "full" else f"_{kind}"

    @property
    def rope_kinds(self) -> list[str]:
        return self.kinds if self.rope_per_kind else ["full"]

    def inputs(self) -> list[tuple[str, list[int], str]]:
        n, cl, d = self.width, self.context, self.head_dim
        specs: list[tuple[str, list[int], str]] = [("input_ids", [1, n], "int32")]
        for kind in self.kinds:
            specs.append((f"attention_mask{self.suffix(kind)}", [1, 1, n, cl], "float32"))
        for kind in self.rope_kinds:
            specs.append((f"position_cos{self.suffix(kind)}", [1, 1, n, d // 2], "float32"))
            specs.append((f"position_sin{self.suffix(kind)}", [1, 1, n, d // 2], "float32"))
        for i in range(self.n_layers):
            specs.append((f"past_key_{i}", [self.n_kv, 1, d, cl - n], "float32"))
            specs.append((f"past_value_{i}", [self.n_kv, 1, cl - n, d], "float32"))
        return specs

    def outputs(self) -> list[tuple[str, list[int], str]]:
        n, d = self.width, self.head_dim
        specs: list[tuple[str, list[int], str]] = [("logits", [1, n, self.vocab], "float32")]
        for i in range(self.n_layers):
            specs.append((f"new_key_{i}", [self.n_kv, 1, d, n], "float32"))
            specs.append((f"new_value_{i}", [self.n_kv, 1, n, d], "float32"))
        return specs
