"""Real LoRA adapters made with PEFT itself, on real text, for tests, recipes and benchmarks.

No PEFT adapter ships in any package, so `mobc adapter train` makes one: PEFT's LoraConfig on
the recipe's model, a few AdamW steps on a real text (a file of the standard library, or any
file), saved with PEFT's own save_pretrained. The point is a genuine PEFT folder whose adapter
changes the model's outputs measurably, not a good fine-tune.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from toolchain.errors import MobcError


@dataclass
class LoraTrainConfig:
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    steps: int = 30
    seq_len: int = 128
    batch: int = 2
    lr: float = 2e-3
    seed: int = 0


def _batches(ids: torch.Tensor, cfg: LoraTrainConfig, gen: torch.Generator):
    n = ids.numel() - cfg.seq_len - 1
    if n <= 0:
        raise MobcError(f"training text has {ids.numel()} tokens; need more than seq_len {cfg.seq_len}")
    while True:
        starts = torch.randint(0, n, (cfg.batch,), generator=gen)
        yield torch.stack([ids[s : s + cfg.seq_len] for s in starts])


def train_lora(model: Any, tokenizer: Any, text: str, out: Path, cfg: LoraTrainConfig,
               log: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Trains a LoRA on `text` with PEFT and saves it to `out`. `model` is left unmodified."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    lcfg = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, target_modules=list(cfg.targets), lora_dropout=0.0,
                      bias="none", task_type="CAUSAL_LM", init_lora_weights=True)
    peft_model = get_peft_model(model, lcfg)
    ids = torch.tensor(tokenizer(text).input_ids)
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=cfg.lr)
    peft_model.train()
    t0, losses = time.perf_counter(), []
    for step, batch in zip(range(cfg.steps), _batches(ids, cfg, gen), strict=False):
        loss = peft_model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        if step % 10 == 0 or step == cfg.steps - 1:
            log(f"step {step}: loss {losses[-1]:.3f}")
    peft_model.eval()
    out.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(out)
    peft_model.unload()  # removes the LoRA layers: the caller's base model is as before
    return {"steps": cfg.steps, "loss_first": losses[0], "loss_last": losses[-1],
            "seconds": round(time.perf_counter() - t0, 1), "rank": cfg.rank, "targets": list(cfg.targets)}
