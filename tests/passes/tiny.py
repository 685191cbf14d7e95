"""Tiny exported step graphs of every supported architecture, shared by the pass tests.

Exports are cached per (arch, width) for the whole session: each costs ~3 s. Tests must
`model.clone()` before changing a graph. Weights are perturbed away from HF's init (norm
weights of exactly 1, zero biases) so a pass that mixes up two norms or drops a bias shows.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx_ir as ir
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

from toolchain.artifact.layout import MASK_MIN, StepLayout
from toolchain.compile.capture import layout_for
from toolchain.compile.export import export_step_graph
from toolchain.ir.graphset import GraphEntry, GraphSet

ARCHS = ["llama", "qwen2", "qwen3", "gemma3"]
CONTEXT = 32
_COMMON = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
)


def _config(arch: str):
    if arch == "llama":
        return LlamaConfig(**_COMMON, num_key_value_heads=2)
    if arch == "qwen2":
        return Qwen2Config(**_COMMON, num_key_value_heads=2)
    if arch == "qwen3":
        return Qwen3Config(**_COMMON, num_key_value_heads=2, head_dim=16)
    if arch == "gemma3":
        return Gemma3TextConfig(
            **{**_COMMON, "num_hidden_layers": 3},
            num_key_value_heads=1,
            head_dim=32,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        )
    raise KeyError(arch)


@functools.cache
def hf_model(arch: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(arch), attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@functools.cache
def _exported(arch: str, width: int) -> tuple[StepLayout, ir.Model]:
    model = hf_model(arch)
    layout = layout_for(model.config, width, CONTEXT)
    return layout, export_step_graph(model, layout)


def tiny(arch: str, width: int = 4) -> tuple[StepLayout, ir.Model]:
    """(layout, a fresh clone of the exported step graph)."""
    layout, model = _exported(arch, width)
    return layout, model.clone()


def feeds_for(layout: StepLayout, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    n, cl = layout.width, layout.context
    feeds: dict[str, np.ndarray] = {}
    for name, shape, dtype in layout.inputs():
        if dtype == "int32":
            feeds[name] = rng.integers(0, layout.vocab, shape).astype(np.int32)
        elif name.startswith("attention_mask"):
            mask = np.zeros(shape, np.float32)
            past = cl - n
            for i in range(n):  # causal among the new rows, a few past slots masked
                mask[0, 0, i, past + i + 1 :] = MASK_MIN
                mask[0, 0, i, : rng.integers(0, 3)] = MASK_MIN
            feeds[name] = mask
        elif name.startswith("position_"):
            feeds[name] = rng.uniform(-1, 1, shape).astype(np.float32)
        else:
            feeds[name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def graphset_for(arch: str, widths: tuple[int, ...] = (4,)) -> tuple[GraphSet, dict]:
    gs = GraphSet()
    feeds = {}
    for w in widths:
        fam = "decode" if w == 1 else f"w{w}"
        layout, model = tiny(arch, w)
        gs.add(GraphEntry(name=fam, model=model, family=fam, role=fam, width=w, context=CONTEXT))
        feeds[fam] = feeds_for(layout)
    return gs, feeds
