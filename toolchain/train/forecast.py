"""`mobc train forecast`: prefix-tune DS2D's m forecast embeddings on real text, base model frozen.

Training runs mobc's own capture (StepGraph, the module torch.onnx exports) with an empty KV
cache, so the embeddings learn exactly the computation the compiled graph does. A training
sequence is T real tokens followed by A sets of m forecast rows: set s hangs after anchor
token j_s (sees tokens 0..j_s and its own earlier forecast rows, at positions j_s+1..j_s+m) and
row i learns the token i+2 steps after j_s (the token after the one row j_s itself predicts).
Only the m vectors get gradients. Text: the corpus's train split (toolchain/train/corpus.py);
accuracy is measured on its held-out split.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from toolchain.artifact.layout import MASK_MIN
from toolchain.atomic import atomic_file
from toolchain.compile.capture import ATTENTION_NAME, StepGraph, layout_for, rope_tables
from toolchain.train import corpus


@dataclass
class ForecastConfig:
    seconds: float = 180.0
    seq_len: int = 128
    anchors: int = 32
    lr: float = 1e-2
    seed: int = 0
    max_steps: int = 10_000
    train_tokens: int = 262_144  # stdlib train-split tokens the windows are drawn from
    eval_tokens: int = 32_768  # held-out tokens the accuracy is measured on


class _Forecaster:
    """Builds one training/eval example and runs it through the StepGraph with forecast rows."""

    def __init__(self, model: Any, m: int, cfg: ForecastConfig, init: np.ndarray | None = None):
        self.model, self.m, self.cfg = model, m, cfg
        self.total = cfg.seq_len + cfg.anchors * m
        self.layout = layout_for(model.config, self.total, self.total)
        self.rope = {k: torch.from_numpy(v) for k, v in rope_tables(model, self.layout, cfg.seq_len + m + 1).items()}
        embed = model.model.embed_tokens
        with torch.no_grad():  # default start: the mean token embedding, the same for every slot
            mean = embed(torch.arange(min(4096, model.config.vocab_size))[None])[0].mean(0)
        start = mean.repeat(m, 1).clone() if init is None else torch.tensor(np.array(init, np.float32))
        self.vectors = torch.nn.Parameter(start)
        self._rows: torch.Tensor | None = None
        self._slots: torch.Tensor | None = None
        self._hook = embed.register_forward_hook(self._mix)

    def _mix(self, module, args, out):
        if self._rows is None:
            return out
        out = out.clone()
        out[0, self._rows] = self.vectors[self._slots].to(out.dtype)  # the graph's e*0 + F
        return out

    def close(self) -> None:
        self._hook.remove()
        self.model.config._attn_implementation = "eager"

    def example(self, ids: torch.Tensor, gen: torch.Generator) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """(StepGraph inputs, forecast row indices, their target tokens) for ids [seq_len]."""
        t, m, a = self.cfg.seq_len, self.m, self.cfg.anchors
        anchors = torch.randperm(t - m - 1, generator=gen)[:a].sort().values
        n = self.total
        allowed = torch.zeros(n, n, dtype=torch.bool)
        allowed[:t, :t] = torch.tril(torch.ones(t, t, dtype=torch.bool))
        positions = torch.cat([torch.arange(t), torch.zeros(a * m, dtype=torch.long)])
        rows, slots, targets = [], [], []
        for s, j in enumerate(anchors.tolist()):
            base = t + s * m
            for i in range(m):
                r = base + i
                allowed[r, : j + 1] = True
                allowed[r, base : r + 1] = True
                positions[r] = j + 1 + i
                rows.append(r)
                slots.append(i)
                targets.append(int(ids[j + 2 + i]))
        self._rows, self._slots = torch.tensor(rows), torch.tensor(slots)
        lay = self.layout
        inputs = [torch.cat([ids, torch.zeros(a * m, dtype=ids.dtype)])[None].to(torch.int32)]
        for kind in lay.kinds:
            ok = allowed
            if kind == "sliding" and lay.sliding_window:
                ok = ok & ((positions[:, None] - positions[None, :]) < lay.sliding_window)
            inputs.append(torch.where(ok, 0.0, MASK_MIN).reshape(1, 1, n, n))
        for kind in lay.rope_kinds:
            sfx = lay.suffix(kind)
            inputs.append(self.rope[f"cos{sfx}"][positions].reshape(1, 1, n, -1))
            inputs.append(self.rope[f"sin{sfx}"][positions].reshape(1, 1, n, -1))
        d = lay.head_dim
        for _ in range(lay.n_layers):
            inputs.append(torch.zeros(lay.n_kv, 1, d, 0))
            inputs.append(torch.zeros(lay.n_kv, 1, 0, d))
        return inputs, torch.tensor(rows), torch.tensor(targets)


def train_forecast(model: Any, tokenizer: Any, m: int, cfg: ForecastConfig,
                   log: Callable[[str], None] = lambda s: None,
                   init: np.ndarray | None = None) -> tuple[np.ndarray, dict[str, Any]]:
    """Returns (forecast embeddings [m, C], report with per-slot top-1 accuracy before/after).

    `init` resumes from earlier embeddings (a second budget on top of the first)."""
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    for p in model.parameters():
        p.requires_grad_(False)
    ids = torch.from_numpy(corpus.tokens(tokenizer, "train", cfg.train_tokens, seed=cfg.seed))
    held = torch.from_numpy(corpus.tokens(tokenizer, "held_out", cfg.eval_tokens))
    fc = _Forecaster(model, m, cfg, init)
    step_graph = StepGraph(model, fc.layout)
    assert model.config._attn_implementation == ATTENTION_NAME
    opt = torch.optim.Adam([fc.vectors], lr=cfg.lr)

    def evaluate(n_examples: int = 4) -> tuple[list[float], float]:
        """(top-1 accuracy per slot, mean cross-entropy) on the same held-out examples every time."""
        g = torch.Generator().manual_seed(1234)
        hits = np.zeros(m)
        count, nll = 0, 0.0
        with torch.no_grad():
            for _ in range(n_examples):
                s = int(torch.randint(0, held.numel() - cfg.seq_len, (1,), generator=g))
                inputs, rows, targets = fc.example(held[s : s + cfg.seq_len], g)
                logits = step_graph(*inputs)[0][0, rows]
                pred = logits.argmax(-1)
                hits += (pred == targets).float().reshape(-1, m).sum(0).numpy()
                nll += float(torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum"))
                count += len(rows) // m
        return [round(float(h / count), 4) for h in hits], nll / (count * m)

    try:
        before, nll_before = evaluate()
        log(f"top-1 accuracy per forecast slot before: {before}")
        t0, step, losses = time.perf_counter(), 0, []
        while time.perf_counter() - t0 < cfg.seconds and step < cfg.max_steps:
            s = int(torch.randint(0, ids.numel() - cfg.seq_len, (1,), generator=gen))
            inputs, rows, targets = fc.example(ids[s : s + cfg.seq_len], gen)
            logits = step_graph(*inputs)[0][0, rows]
            loss = torch.nn.functional.cross_entropy(logits, targets)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
            step += 1
            if step % 10 == 0:
                log(f"step {step}: loss {np.mean(losses[-10:]):.3f} ({time.perf_counter() - t0:.0f} s)")
        seconds = time.perf_counter() - t0
        after, nll_after = evaluate()
        log(f"top-1 accuracy per forecast slot after: {after}")
    finally:
        fc.close()
    report = {"m": m, "steps": step, "seconds": round(seconds, 1), "loss_first": losses[0] if losses else None,
              "loss_last": float(np.mean(losses[-10:])) if losses else None, "accuracy_before": before,
              "accuracy_after": after, "held_out_nll_before": round(nll_before, 5),
              "held_out_nll_after": round(nll_after, 5), "config": cfg.__dict__}
    return fc.vectors.detach().float().numpy().copy(), report


def save_forecast(path: Path, embeds: np.ndarray, report: dict[str, Any]) -> None:
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, forecast_embeds=embeds, report=np.array(json.dumps(report)))
