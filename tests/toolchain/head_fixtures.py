"""A tiny target with split_lm_head (it exposes `hidden`) and a compiled draft head for it."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny import save_tiny, write_recipe

TARGET_GRAPHS = "  decode: {width: 1, context: 64}\n  prefill: {width: 8, context: 64}\n"
HEAD_GRAPHS = "  decode: {width: 1, context: 64}\n  prefill: {width: 8, context: 64}\n"


def target_hidden(target_dir: Path, tokens: list[int]):
    """The target's `hidden` (the features a head reads) at each position of `tokens`, one decode call
    at a time: the reference for what a policy's commits must have told the head."""
    import numpy as np

    from toolchain.runtime.model import StepModel

    ref = StepModel(target_dir)
    ref.reset()
    rows = []
    for t in tokens:
        ref.forward([t], family=ref.decode_family)
        rows.append(ref._last[1]["hidden"][0, 0].copy())
        ref.commit([0])
    return np.stack(rows)


def head_weights(hf_dir: Path, out: Path, seed: int = 0, layers: int = 1) -> Path:
    """An untrained head (the target's last layer, random fc) over half the vocabulary; with more layers,
    each after the first is that layer perturbed (so a graph that drops or reorders one is caught)."""
    from transformers import AutoModelForCausalLM

    from toolchain.train.head_model import DraftHead, save_head

    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
    head = DraftHead(target, torch.arange(0, target.config.vocab_size, 2), init_layer=-1, layers=layers)
    with torch.no_grad():
        head.fc.weight.normal_(0, 0.05)
        for layer in head.layers[1:]:
            for p in layer.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_head(head, out)
    return out


def compile_target(root: Path, hf_dir: Path, passes: str = "passes: [split_lm_head]\n") -> Path:
    from toolchain.compile.pipeline import compile_recipe

    recipe = write_recipe(root / "target.yaml", hf_dir, name="target", graphs=TARGET_GRAPHS, extra=passes)
    recipe.write_text(recipe.read_text().replace("greedy_tokens: 12", "greedy_tokens: 0"))
    return compile_recipe(recipe).out_dir


def head_recipe(root: Path, hf_dir: Path, weights: Path, name: str = "head") -> Path:
    path = root / f"{name}.yaml"
    path.write_text(f"name: {name}\nsource: {{path: {hf_dir}}}\nhead: {{weights: {weights}}}\n"
                    f"graphs:\n{HEAD_GRAPHS}tolerance: {{max_abs: 1.0e-4}}\noutput: {root / 'out' / name}\n")
    return path


def tiny_head_world(root: Path) -> tuple[Path, Path, Path]:
    """(target HF folder, target artifact, head artifact)."""
    from toolchain.compile.pipeline import compile_recipe

    hf = save_tiny(root / "hf", "llama")
    target = compile_target(root, hf)
    head = compile_recipe(head_recipe(root, hf, head_weights(hf, root / "w" / "head.safetensors"))).out_dir
    return hf, target, head
