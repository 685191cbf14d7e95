"""Verify: emitted graphs against the Hugging Face model in torch, on real tokens.

Two checks per compile:
- a reference case per graph family: real prompt tokens, a real (HF-computed) past cache that
  is only partly filled (padding slots masked), and a tree-shaped mask for the N new tokens (not
  plain causal), with positions from tree depths; logits and new K/V rows are compared with the
  HF model's eager forward over the same past and a 4-D mask;
- greedy decoding through the decode graph with the runtime's own cache handling, token for
  token against transformers' `generate`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from toolchain.artifact.layout import MASK_MIN, StepLayout
from toolchain.compile.contracts import argmax_exact_diff
from toolchain.errors import VerificationError
from toolchain.runtime.cache import KVCache


def real_text() -> str:
    """Real text that ships with every Python: the standard library's own source."""
    return Path(os.__file__).read_text()


@dataclass
class Case:
    feeds: dict[str, np.ndarray]
    expected: dict[str, np.ndarray]
    past_len: int
    tree_depths: list[int]


def random_tree(n: int, rng: np.random.Generator) -> tuple[np.ndarray, list[int]]:
    """Ancestor-or-self matrix [n,n] and depths of a random tree in topological order."""
    parent = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
    allowed = np.eye(n, dtype=bool)
    depth = [0] * n
    for i in range(n):
        p = parent[i]
        if p >= 0:
            allowed[i] |= allowed[p]
            depth[i] = depth[p] + 1
    return allowed, depth


def _hf_masks(layout: StepLayout, past_len: int, allowed: np.ndarray, positions: np.ndarray) -> Any:
    n = layout.width
    ok = np.zeros((n, past_len + n), dtype=bool)
    ok[:, :past_len] = True
    ok[:, past_len:] = allowed
    key_pos = np.concatenate([np.arange(past_len), positions])
    masks = {}
    for kind in layout.kinds:
        m = ok
        if kind == "sliding" and layout.sliding_window:
            m = ok & ((positions[:, None] - key_pos[None, :]) < layout.sliding_window)
        masks[kind] = torch.from_numpy(np.where(m, 0.0, MASK_MIN).astype(np.float32)).reshape(1, 1, n, -1)
    if layout.kinds == ["full"]:
        return masks["full"]
    return {"full_attention": masks["full"], "sliding_attention": masks.get("sliding", masks["full"])}


@torch.no_grad()
def reference_case(model: Any, tokens: list[int], layout: StepLayout, rope: dict[str, np.ndarray],
                   seed: int = 0, mask_token_id: int | None = None) -> Case:
    """With mask_token_id (a diffusion model's block graph): a bidirectional block in which about
    half the new tokens are the mask token, instead of a random tree."""
    n, cl = layout.width, layout.context
    past_len = max(1, min((cl - n) * 3 // 4, len(tokens) - n))
    if past_len + n > len(tokens):
        raise VerificationError(f"verification text too short for width {n}")
    prefix = torch.tensor([tokens[:past_len]])
    new = tokens[past_len : past_len + n]
    allowed, depths = random_tree(n, np.random.default_rng(seed))
    if mask_token_id is not None:
        rng = np.random.default_rng(seed)
        new = [mask_token_id if rng.random() < 0.5 else t for t in new]
        allowed, depths = np.ones((n, n), dtype=bool), list(range(n))
    positions = past_len + np.asarray(depths)

    hf_cache = DynamicCache()
    model(prefix, cache=hf_cache, use_cache=True)
    past = [(layer.keys.clone(), layer.values.clone()) for layer in hf_cache.layers]

    out = model(
        torch.tensor([new]),
        position_ids=torch.from_numpy(positions)[None],
        cache=hf_cache,
        attention_mask=_hf_masks(layout, past_len, allowed, positions),
        use_cache=True,
    )
    expected = {"logits": out.logits.float().numpy()}
    for i, layer in enumerate(hf_cache.layers):
        expected[f"new_key_{i}"] = layer.keys[:, :, past_len:].permute(1, 0, 3, 2).numpy()
        expected[f"new_value_{i}"] = layer.values[:, :, past_len:].permute(1, 0, 2, 3).numpy()

    cache = KVCache(layout, rope)
    for i, (k, v) in enumerate(past):
        cache.keys[i][..., :past_len] = k.permute(1, 0, 3, 2).numpy()
        cache.values[i][:, :, :past_len] = v.permute(1, 0, 2, 3).numpy()
    cache.length = past_len
    feeds = cache.step_inputs(new, n, allowed_new=allowed, depths=depths)
    return Case(feeds=feeds, expected=expected, past_len=past_len, tree_depths=list(depths))


def compare(outputs: dict[str, np.ndarray], expected: dict[str, np.ndarray],
            argmax_exact: frozenset[str] = frozenset(), tie: float = 0.0) -> dict[str, Any]:
    """max |diff| for logits and (worst over layers) the new K/V rows; for outputs in
    `argmax_exact` (a recipe with certified_lm_head) the diff at each row's argmax, and a moved
    argmax counts as infinite (toolchain/compile/contracts.py), the full diff reported beside it.

    A non-finite output or difference (NaN, inf) counts as an infinite difference: `max` over
    NaN is NaN, and NaN > tolerance is False, so without this a graph emitting NaN would pass."""
    missing = sorted(set(expected) - set(outputs))
    if missing:
        raise VerificationError(f"emitted graphs do not produce {missing[:4]}; they cannot be verified")
    diffs: dict[str, float] = {}
    non_finite: list[str] = []
    for name, ref in expected.items():
        out = np.asarray(outputs[name], dtype=np.float64)
        d = np.abs(out - np.asarray(ref, dtype=np.float64))
        if d.size and not np.isfinite(d).all():
            non_finite.append(name)
            diffs[name] = float("inf")
        else:
            diffs[name] = float(d.max()) if d.size else 0.0
    figures: dict[str, Any] = {}
    if "logits" in argmax_exact and "logits" not in non_finite:
        figures = {"logits_contract": "argmax-exact", "logits_max_abs_all": diffs["logits"]}
        diffs["logits"] = argmax_exact_diff(np.asarray(expected["logits"]), np.asarray(outputs["logits"]), tie)
    kv = [v for k, v in diffs.items() if k.startswith("new_")]
    worst = max(diffs, key=diffs.get)
    return {"logits_max_abs": diffs["logits"], "kv_max_abs": max(kv) if kv else 0.0,
            "worst_output": worst, "worst_max_abs": diffs[worst], "non_finite": non_finite,
            "argmax_agree": float((outputs["logits"].argmax(-1) == expected["logits"].argmax(-1)).mean()),
            **figures}


def check_tolerance(family: str, figures: dict[str, Any], tol: float) -> None:
    worst = figures["worst_max_abs"]
    if figures.get("non_finite") or not np.isfinite(worst):
        bad = figures.get("non_finite") or [figures["worst_output"]]
        raise VerificationError(
            f"graph {family!r}: output {bad[0]} has non-finite values (NaN or inf, in the graph's output "
            f"or in transformers'; {len(bad)} output(s): {', '.join(bad[:4])}); the model cannot be verified, "
            "whatever the tolerance"
        )
    if not worst <= tol:
        raise VerificationError(
            f"graph {family!r}: output {figures['worst_output']} differs from transformers by "
            f"{worst:.3g} > tolerance.max_abs {tol:g}; the export is not faithful "
            "(raise tolerance only if you accept this error)"
        )


@torch.no_grad()
def hf_greedy_of(model: Any, ids: list[int], ours: list[int]) -> list[int]:
    """transformers' greedy continuation of `ids`, up to and including the first token where it
    differs from `ours` (else all of `ours`), from ONE forward over ids + ours.

    Greedy is argmax after each prefix: while ours agrees, the teacher-forced forward sees exactly
    the prefixes generate would, so its argmaxes are generate's tokens. One forward instead of one
    per token matters when the reference streams every weight from disk per forward (a 3B model).
    """
    if not ours:
        return []
    logits = model(torch.tensor([ids + ours[:-1]])).logits[0, len(ids) - 1 :]
    picked = logits.argmax(-1).tolist()
    first = next((i for i, (a, b) in enumerate(zip(picked, ours, strict=True)) if a != b), None)
    return ours if first is None else ours[:first] + [picked[first]]


def eos_ids(config: Any) -> list[int]:
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list | tuple) else [int(eos)]
