"""Compile-time check of diffusion decoding: the emitted block graph + runtime vs plain torch.

The diffusion analogue of the AR greedy check: LLaDA low-confidence remasking (policy dllm,
prefix KV cache, refresh calls) through the written graphs against toolchain/diffusion/reference.py
(full recompute in torch every step), token for token. Both pick by confidence ranking, so two
nearly tied confidences can order differently under float noise; the record then says where the
first difference is and how close the tie was, instead of failing the compile.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from toolchain.diffusion.reference import generate
from toolchain.runtime.model import StepModel
from toolchain.runtime.policies.diffusion import DiffusionPolicy
from toolchain.runtime.policies.sampling import Sampler


@torch.no_grad()
def decode_check(folder: str | Path, model: Any, ids: list[int], blocks: int = 2, steps: int = 8) -> dict[str, Any]:
    sm = StepModel(folder)
    pol = DiffusionPolicy(sm, steps=steps)
    width = pol.B
    ours = [t for c in pol.generate(ids, blocks * width, Sampler()) for t in c]
    ref = generate(model, ids, pol.mask_id, block=width, steps=steps, n_blocks=blocks)
    first = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), None)
    return {"policy": "dllm", "blocks": blocks, "block": width, "steps": steps, "prompt_tokens": len(ids),
            "identical": ours == ref, "first_mismatch": first,
            "agreement": sum(a == b for a, b in zip(ours, ref, strict=False)) / max(len(ref), 1),
            "calls": sum(pol.stats.target_calls.values()), "reference": ref, "ours": ours}
