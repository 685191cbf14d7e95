"""A Hugging Face model that holds one module's weights at a time: the compile's torch reference.

The model is built without weights (parameters on the meta device; buffers such as RoPE
frequencies are computed for real). Each streaming unit -- the embedding, every decoder layer,
the final norm, the lm_head -- reads its weights from the WeightStore in a forward pre-hook and
drops them in a forward hook. Any forward of the model (a reference case, greedy decoding) is
then exactly transformers' own code over the checkpoint's weights, while memory holds the
largest unit instead of the model: a 1.2B Llama runs in ~0.5 GB instead of 4.7 GB.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from toolchain.compile.weight_store import WeightStore


def skeleton(config: Any) -> Any:
    """The model class of `config` with parameters on meta (buffers real), eval, eager attention."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    return model.eval()


def meta_model(config: Any) -> Any:
    """Parameters and buffers on meta: what the exporter traces (it needs shapes, not values)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    return model.eval()


def units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(checkpoint prefix, module) of every streaming unit: each decoder layer is one unit, every
    other direct child of the base model or the wrapper that owns parameters is one."""
    base_name = model.base_model_prefix
    base = getattr(model, base_name)
    found: list[tuple[str, nn.Module]] = []
    for name, child in base.named_children():
        if isinstance(child, nn.ModuleList):
            found += [(f"{base_name}.{name}.{i}", m) for i, m in enumerate(child)]
        elif any(True for _ in child.parameters()):
            found.append((f"{base_name}.{name}", child))
    for name, child in model.named_children():
        if child is not base and any(True for _ in child.parameters()):
            found.append((name, child))
    return found


def _set(module: nn.Module, path: str, tensor: torch.Tensor) -> None:
    owner_path, _, attr = path.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    owner._parameters[attr] = nn.Parameter(tensor, requires_grad=False)


class Streamer:
    """Installs the load/drop hooks on every unit; `close()` removes them."""

    def __init__(self, model: nn.Module, store: WeightStore):
        self.store = store
        self.loads = 0
        if getattr(model.config, "tie_word_embeddings", False):
            store.tie("lm_head.weight", f"{model.base_model_prefix}.embed_tokens.weight")
        found = units(model)
        covered = {f"{p}.{n}" for p, m in found for n, _ in m.named_parameters()}
        missing = sorted({n for n, _ in model.named_parameters(remove_duplicate=False)} - covered)
        absent = sorted(n for n in covered if n not in store)
        if missing or absent:
            raise ValueError(f"streaming cannot place weights: uncovered {missing[:4]}, not in the checkpoint {absent[:4]}")
        self._handles = []
        for prefix, module in found:
            self._handles.append(module.register_forward_pre_hook(self._loader(prefix)))
            self._handles.append(module.register_forward_hook(self._dropper()))

    def _loader(self, prefix: str):
        def load(module: nn.Module, args: Any) -> None:
            for name, _ in list(module.named_parameters()):
                _set(module, name, torch.from_numpy(self.store.float32(f"{prefix}.{name}")))
            self.loads += 1

        return load

    def _dropper(self):
        def drop(module: nn.Module, args: Any, output: Any) -> None:
            for name, p in list(module.named_parameters()):
                _set(module, name, torch.empty(p.shape, dtype=p.dtype, device="meta"))

        return drop

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def streamed_model(config: Any, store: WeightStore) -> Any:
    model = skeleton(config)
    model._mobc_streamer = Streamer(model, store)  # keeps the hooks' owner alive with the model
    return model
