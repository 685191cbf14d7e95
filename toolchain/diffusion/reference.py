"""A plain-torch reference of block diffusion decoding (no KV cache, full recompute each step).

Used for the sample generations of `mobc train diffusion` (before anything is compiled) and as
an independent reading of the runtime policies' semantics: block-causal attention (prompt cut
into blocks from position 0, then one block of masks at a time), shifted head (the row before a
masked token predicts it), LLaDA low-confidence remasking with a fixed number of steps.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from toolchain.artifact.layout import MASK_MIN
from toolchain.runtime.diffusion_schedule import transfer_counts

PROMPTS = (
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import os\n\n\ndef list_python_files(folder):\n",
    "class Stack:\n    \"\"\"A last-in first-out stack.\"\"\"\n\n    def __init__(self):\n",
)


def block_causal(starts: list[int], length: int) -> torch.Tensor:
    """[L, L] bool: query i sees key j iff j's block starts at or before i's block start."""
    bid = np.zeros(length, dtype=np.int64)
    for k, s in enumerate(sorted(starts)):
        bid[s:] = k
    return torch.from_numpy(bid[None, :] <= bid[:, None])



def block_mask(starts: list[int], length: int) -> torch.Tensor:
    """[1, 1, L, L] additive mask of block-causal attention (what the diffusion graphs are fed)."""
    return torch.where(block_causal(starts, length), 0.0, MASK_MIN)[None, None]


@torch.no_grad()
def generate(model: Any, ids: list[int], mask_id: int, block: int = 32, steps: int = 16,
             n_blocks: int = 2, eos: int | None = None) -> list[int]:
    seq = list(ids)
    starts = list(range(0, len(ids), block))
    for _ in range(n_blocks):
        lo = len(seq)
        starts.append(lo)
        seq.extend([mask_id] * block)
        for k in transfer_counts(block, steps):
            x = torch.tensor([seq])
            logits = model(x, attention_mask=block_mask(starts, len(seq))).logits[0].float()
            logits[:, mask_id] = -torch.inf  # never decode the mask token itself
            probs = torch.softmax(logits, -1)
            masked = [j for j in range(lo, lo + block) if seq[j] == mask_id]
            if not masked:
                break
            conf = np.array([float(probs[j - 1].max()) for j in masked])
            for idx in np.argsort(-conf, kind="stable")[:k]:
                j = masked[idx]
                seq[j] = int(probs[j - 1].argmax())
        if eos is not None and eos in seq[lo:]:
            return seq[len(ids): seq.index(eos, lo) + 1]
    return seq[len(ids):]


def sample_generations(model: Any, tok: Any, mask_id: int, block: int, n: int = 3) -> list[dict[str, Any]]:
    """Two blocks per prompt at S = block (one token per step: the model's quality) and S = block/4
    (four tokens per step: what parallel decoding costs a small model)."""
    out = []
    for prompt in PROMPTS[:n]:
        ids = tok(prompt).input_ids
        for steps in (block, block // 4):
            gen = generate(model, ids, mask_id, block=block, steps=steps, n_blocks=2, eos=tok.eos_token_id)
            out.append({"prompt": prompt, "steps": steps, "completion": tok.decode(gen)})
    return out
