"""The feature-level draft head (EAGLE-style) as a torch module: what `mobc train draft --kind head`
trains and what the head's step graphs are exported and verified from.

    n_in = final_norm(features)                    the target's own final RMSNorm (frozen)
    x    = fc([n_in ; embed(token)])               2C -> C, trained
    g    = decoder_layers(x)                       one layer (or a few) of the target's own class, trained
    logits = final_norm(g) @ E[draft_vocab]^T      the target's lm_head rows (frozen)

`features` is the target's residual stream entering its final norm at the previous position
(the `hidden` a split-lm_head artifact hands its lm_head), or, for a drafted token, the head's own
`g` of the previous row: the final norm is scale-invariant, so both live in one space. The
draft vocabulary is the target's most frequent next tokens (a 49k-row lm_head would cost as
much as 25% of the target; 8k rows cost 3.5%): a target token outside it is simply never drafted.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def head_config(target_config: Any, layers: int = 1, dropout: float = 0.0) -> Any:
    """The target's config with `layers` layers of full attention (the head's own) and `dropout` on their
    attention weights while training."""
    cfg = copy.deepcopy(target_config)
    cfg.num_hidden_layers = layers
    cfg.attention_dropout = dropout
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = ["full_attention"] * layers
    return cfg


class DraftHead(nn.Module):
    def __init__(self, target: Any, vocab_ids: torch.Tensor, init_layer: int | None = -1, layers: int = 1,
                 dropout: float = 0.0):
        """target: the HF causal LM (weights read, never trained); vocab_ids [V'] the draft vocabulary;
        init_layer: the target layer the head's layers start from (None: fresh init); layers: how many;
        dropout: while training, on the layers' input rows and attention weights (a regularizer; none in eval)."""
        super().__init__()
        if layers < 1:
            raise ValueError(f"a draft head needs at least one layer, not {layers}")
        cfg = head_config(target.config, layers, dropout)
        self.config = cfg
        c = cfg.hidden_size
        layer_cls = type(target.model.layers[0])
        self.layers = nn.ModuleList(layer_cls(cfg, layer_idx=i) for i in range(layers))
        if init_layer is not None:
            for layer in self.layers:
                layer.load_state_dict(target.model.layers[init_layer].state_dict())
        self.fc = nn.Linear(2 * c, c, bias=True)
        self.dropout = nn.Dropout(dropout)
        with torch.no_grad():  # start as "the feature, plus a little of the token"
            self.fc.weight.zero_()
            self.fc.weight[:, :c] = torch.eye(c)
            self.fc.weight[:, c:] = torch.eye(c) * 0.1
            self.fc.bias.zero_()
        self.norm = copy.deepcopy(target.model.norm)
        self.rotary = target.model.rotary_emb
        embed = target.get_input_embeddings().weight.detach().float()
        head_w = target.get_output_embeddings().weight.detach().float()
        self.register_buffer("embed", embed.clone(), persistent=False)
        self.register_buffer("vocab_ids", vocab_ids.long().clone())
        self.register_buffer("lm_rows", head_w[vocab_ids.long()].clone(), persistent=False)
        for p in self.norm.parameters():
            p.requires_grad = False

    def trainable(self) -> list[nn.Parameter]:
        return [*self.fc.parameters(), *self.layers.parameters()]

    def mix(self, features: torch.Tensor, tokens: torch.Tensor, normalized: bool = False) -> torch.Tensor:
        n_in = features if normalized else self.norm(features)
        return self.fc(torch.cat([n_in, F.embedding(tokens, self.embed)], dim=-1))

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(g), self.lm_rows)

    def forward_train(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                      normalized: bool = True, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Causal pass over whole windows: features [B,T,C] (row t's previous position), tokens [B,T]; or,
        with `mask` (additive, [1,1,T,T]), a pass in which each row sees the rows that mask allows."""
        x = self.dropout(self.mix(features, tokens, normalized))
        cos, sin = self.rotary(x, positions)
        if mask is None:
            t = tokens.shape[1]
            mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        for layer in self.layers:
            out = layer(x, attention_mask=mask, position_embeddings=(cos, sin))
            x = out[0] if isinstance(out, tuple) else out
        return x


def grow(head: DraftHead, layers: int) -> int:
    """Append layers to `head` until it has `layers`, each starting as the identity: a copy of the head's last
    layer with its attention and MLP output projections zeroed, so the grown head drafts exactly as before and
    training moves it from there (a fresh layer would throw away what the saved ones learned). Returns how
    many were added."""
    added = layers - len(head.layers)
    if added <= 0:
        return 0
    head.config = head_config(head.config, layers, head.config.attention_dropout)
    layer_cls, last = type(head.layers[-1]), head.layers[-1].state_dict()
    for i in range(len(head.layers), layers):
        layer = layer_cls(head.config, layer_idx=i).to(next(head.layers[-1].parameters()).dtype)
        layer.load_state_dict(last)
        with torch.no_grad():
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head.layers.append(layer.train(head.training))
    return added


def chain_mask(t: int, steps: int) -> torch.Tensor:
    """The additive attention mask of `steps` blocks of t rows drafting a chain from every start at once.

    Block 1 is the window itself (true features and tokens, causal). Row s of block a > 1 is the (a-1)-th
    draft of the chain that starts after position s: it sees the window's rows up to s and the rows of
    its own chain (row s of blocks 2..a), exactly what it would see if that one chain were drafted alone."""
    s = torch.arange(t)
    prefix = s[None, :] <= s[:, None]  # [query s, key s']
    own = torch.eye(t, dtype=torch.bool)
    allowed = torch.zeros(steps * t, steps * t, dtype=torch.bool)
    for a in range(steps):
        rows = slice(a * t, (a + 1) * t)
        allowed[rows, :t] = prefix
        for b in range(1, a + 1):
            allowed[rows, b * t : (b + 1) * t] = own
    return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, None]


def layer_prefixes(n: int) -> list[str]:
    """The saved names of n head layers: a one-layer head keeps `layer.*` (the files written before heads
    could have more layers), a deeper one `layers.{i}.*`."""
    return ["layer."] if n == 1 else [f"layers.{i}." for i in range(n)]


def saved_layers(names: Any) -> int:
    """How many layers a saved head's tensor names hold (0: none)."""
    if any(k.startswith("layer.") for k in names):
        return 1
    return len({k.split(".")[1] for k in names if k.startswith("layers.")})


def layers_in(path: Any) -> int:
    """How many layers the head saved at `path` (a head.safetensors) holds, read from its tensor names only."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return saved_layers(f.keys())


def save_head(head: DraftHead, path: Any) -> None:
    """fp16 safetensors: the trained tensors (fc.*, the layers') and the draft vocabulary; everything else
    (embeddings, final norm, lm_head rows) is the target's and is read from it at load."""
    from safetensors.torch import save_file

    tensors = {f"fc.{k}": v for k, v in head.fc.state_dict().items()}
    for prefix, layer in zip(layer_prefixes(len(head.layers)), head.layers, strict=True):
        tensors.update({f"{prefix}{k}": v for k, v in layer.state_dict().items()})
    out = {k: v.detach().half().contiguous() for k, v in tensors.items()}
    out["vocab_ids"] = head.vocab_ids.int()
    save_file(out, str(path))


def load_head_tensors(head: DraftHead, tensors: dict[str, torch.Tensor]) -> None:
    """Strict: a tensor the head has no place for (another layer count, say) is an error, not dropped."""
    state = {k: v.float() for k, v in tensors.items()}
    prefixes = ("fc.", *layer_prefixes(len(head.layers)))
    if stray := sorted(k for k in state if not k.startswith(prefixes)):
        raise RuntimeError(f"tensors {', '.join(stray[:3])} have no place in a {len(head.layers)}-layer head")
    head.fc.load_state_dict({k[3:]: v for k, v in state.items() if k.startswith("fc.")})
    for prefix, layer in zip(layer_prefixes(len(head.layers)), head.layers, strict=True):
        layer.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
