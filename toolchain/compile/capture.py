"""Capture: wrap a Hugging Face causal LM as the static-shape step graph of DESIGN.md.

The step graph takes N new tokens plus a fixed-length KV cache and returns logits for the N
tokens and the N new K/V rows per layer (Qualcomm AI Hub Models layout: keys pre-transposed,
KV heads first). Masks and RoPE angles are graph inputs, so one graph family serves AR decode,
prefill, tree verification and diffusion blocks.

The hook is transformers' attention-interface registry: mobc registers its own attention
function under `mobc_step` and calls the model's own decoder layers with it, so q/k norms,
qkv biases, embedding scaling and MLPs are the model's code, not a re-implementation, and no
transformers global is patched.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv

from toolchain.artifact.layout import StepLayout
from toolchain.compile.source import check_architecture

ATTENTION_NAME = "mobc_step"


def _eager_reference(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Plain eager attention (HF semantics) for calls that do not come from the step graph."""
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    softcap = getattr(module, "attn_logit_softcapping", None) or kwargs.get("softcap")
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def step_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Attention over [past cache ++ new rows] in the step-graph layout; stays rank <= 4.

    query [1,H,N,D]; key/value [1,Hkv,N,D] (after the model's norms and RoPE);
    kwargs["mobc_kv"] = (past_key [Hkv,1,D,CL-N], past_value [Hkv,1,CL-N,D], sink list).
    """
    if "mobc_kv" not in kwargs:
        return _eager_reference(module, query, key, value, attention_mask, scaling, **kwargs)
    past_key, past_value, sink = kwargs["mobc_kv"]
    _, n_heads, n_new, head_dim = query.shape
    n_kv = key.shape[1]
    new_key = key.permute(1, 0, 3, 2)  # [Hkv,1,D,N]
    new_value = value.permute(1, 0, 2, 3)  # [Hkv,1,N,D]
    sink.append((new_key, new_value))
    keys = torch.cat([past_key, new_key], dim=3)  # [Hkv,1,D,CL]
    values = torch.cat([past_value, new_value], dim=2)  # [Hkv,1,CL,D]
    # GQA without expand: the query heads sharing a KV head ride in dim 1 and broadcast.
    q = query.reshape(n_kv, n_heads // n_kv, n_new, head_dim)
    scores = torch.matmul(q, keys) * scaling  # [Hkv,g,N,CL]
    softcap = getattr(module, "attn_logit_softcapping", None)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + attention_mask  # [1,1,N,CL] broadcasts
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, values)  # [Hkv,g,N,D]
    return out.reshape(1, n_heads, n_new, head_dim).transpose(1, 2), None


AttentionInterface.register(ATTENTION_NAME, step_attention)


def _layer_kind(config: Any, i: int) -> str:
    types = getattr(config, "layer_types", None)
    if types and types[i] == "sliding_attention" and getattr(config, "sliding_window", None):
        return "sliding"
    return "full"


def layout_for(config: Any, width: int, context: int) -> StepLayout:
    check_architecture(config)
    n_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    kinds = tuple(_layer_kind(config, i) for i in range(config.num_hidden_layers))
    rope = getattr(config, "rope_parameters", None) or {}
    rope_per_kind = "sliding" in kinds and "sliding_attention" in rope
    return StepLayout(
        width=width,
        context=context,
        n_layers=config.num_hidden_layers,
        n_heads=n_heads,
        n_kv=config.num_key_value_heads,
        head_dim=head_dim,
        hidden=config.hidden_size,
        vocab=config.vocab_size,
        layer_kinds=kinds,
        rope_per_kind=rope_per_kind,
        sliding_window=getattr(config, "sliding_window", None) if "sliding" in kinds else None,
    )


_HF_LAYER_TYPE = {"full": "full_attention", "sliding": "sliding_attention"}


@torch.no_grad()
def rope_tables(model: Any, layout: StepLayout, length: int) -> dict[str, np.ndarray]:
    """cos/sin half-tables [length, D/2] per RoPE kind, from the model's own rotary module.

    Using the model's module keeps every RoPE variant (scaling, per-layer-type bases) exact;
    the runtime indexes these tables by position to build the graph's cos/sin inputs.
    """
    rotary = model.model.rotary_emb
    positions = torch.arange(length)[None]
    probe = torch.zeros(1, dtype=torch.float32)
    tables = {}
    for kind in layout.rope_kinds:
        if layout.rope_per_kind:
            cos, sin = rotary(probe, positions, _HF_LAYER_TYPE[kind])
        else:
            cos, sin = rotary(probe, positions)
        half = layout.head_dim // 2
        tables[f"cos{layout.suffix(kind)}"] = cos[0, :, :half].float().numpy()
        tables[f"sin{layout.suffix(kind)}"] = sin[0, :, :half].float().numpy()
    return tables


class StepGraph(nn.Module):
    """forward(input_ids, masks..., cos/sin..., past_key_0, past_value_0, ...) -> (logits, new K/V...)."""

    def __init__(self, model: Any, layout: StepLayout):
        super().__init__()
        self.model = model
        self.layout = layout
        model.config._attn_implementation = ATTENTION_NAME  # the registry hook, on this model only

    def forward(self, input_ids: torch.Tensor, *rest: torch.Tensor):
        lay = self.layout
        rest = list(rest)
        masks = {kind: rest.pop(0) for kind in lay.kinds}
        rope = {}
        for kind in lay.rope_kinds:
            cos, sin = rest.pop(0), rest.pop(0)
            # [1,1,N,D/2] half tables -> HF's [1,N,D] (cos = cat(freqs, freqs))
            rope[kind] = (
                torch.cat([cos, cos], dim=-1).reshape(1, lay.width, lay.head_dim),
                torch.cat([sin, sin], dim=-1).reshape(1, lay.width, lay.head_dim),
            )
        base = self.model.model
        hidden = base.embed_tokens(input_ids)
        sink: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, layer in enumerate(base.layers[: lay.n_layers]):
            kind = lay.layer_kinds[i]
            out = layer(
                hidden,
                attention_mask=masks[kind],
                position_embeddings=rope[kind if lay.rope_per_kind else "full"],
                mobc_kv=(rest[2 * i], rest[2 * i + 1], sink),
            )
            hidden = out[0] if isinstance(out, tuple) else out
        hidden = base.norm(hidden)
        logits = self.model.lm_head(hidden)
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        flat = [t for pair in sink for t in pair]
        return (logits, *flat)


def example_inputs(layout: StepLayout, seed: int = 0) -> list[torch.Tensor]:
    """Shape-correct example inputs for tracing (values do not matter for export)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, shape, dtype in layout.inputs():
        if dtype == "int32":
            out.append(torch.randint(0, layout.vocab, shape, dtype=torch.int32, generator=g))
        elif name.startswith("attention_mask"):
            out.append(torch.zeros(shape, dtype=torch.float32))
        else:
            out.append(torch.randn(shape, dtype=torch.float32, generator=g) * 0.1)
    return out
