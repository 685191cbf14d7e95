"""`mobc train diffusion`: adapt an AR causal LM into a masked diffusion LM (Dream-style), on a CPU.

Dream-7B was made from Qwen2.5 by continued training with random masking, bidirectional
attention and a mask token, keeping the AR model's *shifted* head (the logits at position i
predict token i+1), so the AR weights start close to a useful denoiser. This does the same
for a small model, in minutes, shaped to how mobc runs it:

- attention is block-causal: text is cut into blocks of `block` tokens; a token attends to
  every earlier block and to its whole own block (bidirectional). That is exactly what the
  runtime's diffusion-block graph computes with a prefix KV cache (Fast-dLLM style), so the
  model is trained on the attention pattern it will be run with;
- a sample is `prefix` clean tokens (block-causal chunks from position 0) followed by a noisy
  region of one or two blocks (two = the window of multi-block speculation) in which each token
  is replaced by the mask token with probability t ~ U(0, 1);
- the loss is cross-entropy on masked tokens only, read from the row before each (shifted head).
  We use the plain mean over masked tokens, not the ELBO's 1/t weighting: with a few hundred
  steps the 1/t weights' variance costs more than their bias (noted in the report);
- embeddings and lm_head (tied) stay frozen — the mask token gets its own trainable embedding
  vector, written into the (otherwise unused) special token's row at save time — which keeps the
  largest matmul's weight gradient out of every step.

Real text: the Python standard library's source (held-out files never trained on).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from toolchain.diffusion.form import DiffusionForm, write_form
from toolchain.diffusion.reference import block_mask, sample_generations
from toolchain.errors import MobcError
from toolchain.train import corpus
from toolchain.train.loop import timed_adamw_loop

# An existing special token that never occurs in source code: reused as [MASK] so the
# vocabulary (and every graph's logits shape) stays the base model's.
DEFAULT_MASK_TOKEN = "<empty_output>"


class DiffusionTrainError(MobcError):
    """The diffusion adaptation cannot run as asked."""


@dataclass
class DiffusionTrainConfig:
    seconds: float = 900.0  # wall-clock budget of the optimisation loop
    max_steps: int | None = None  # stop after this many steps even within the budget (reproducible runs)
    seq_len: int = 96
    block: int = 32
    batch: int = 4
    lr: float = 2.0e-4
    warmup: int = 5
    seed: int = 0
    corpus_tokens: int = 600_000
    eval_tokens: int = 8192
    mask_token: str = DEFAULT_MASK_TOKEN


def sample_layout(rng: np.random.Generator, seq_len: int, block: int) -> tuple[list[int], int, int]:
    """(block starts, region start, region end) for one training sample."""
    n_region = 2 if rng.random() < 0.3 else 1
    region = block * n_region
    prefix = int(rng.integers(4, seq_len - region + 1))
    starts = list(range(0, prefix, block)) + [prefix + block * k for k in range(n_region)]
    return sorted(set(starts)), prefix, min(seq_len, prefix + region)


def make_batch(tokens: np.ndarray, rng: np.random.Generator, cfg: DiffusionTrainConfig,
               rate: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [b,L], masked [b,L] bool, additive attention mask [b,1,L,L]."""
    L = cfg.seq_len
    ids = np.zeros((cfg.batch, L), dtype=np.int64)
    masked = np.zeros((cfg.batch, L), dtype=bool)
    attn = torch.zeros(cfg.batch, 1, L, L)
    for b in range(cfg.batch):
        s = int(rng.integers(0, len(tokens) - L))
        ids[b] = tokens[s : s + L]
        starts, lo, hi = sample_layout(rng, L, cfg.block)
        t = rate if rate is not None else float(rng.uniform(0.02, 1.0))
        m = rng.random(hi - lo) < t
        if not m.any():
            m[int(rng.integers(0, hi - lo))] = True
        masked[b, lo:hi] = m
        attn[b, 0] = block_mask(starts, L)[0, 0]
    return torch.from_numpy(ids), torch.from_numpy(masked), attn


def masked_logits(model: Any, ids: torch.Tensor, masked: torch.Tensor, attn: torch.Tensor,
                  mask_emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the rows predicting each masked token (shifted head) and those tokens."""
    emb = model.model.embed_tokens(ids)
    emb = torch.where(masked[..., None], mask_emb.to(emb.dtype), emb)
    hidden = model.model(inputs_embeds=emb, attention_mask=attn).last_hidden_state
    b_idx, p_idx = masked.nonzero(as_tuple=True)  # position 0 is never masked (prefix >= 4)
    rows = hidden[b_idx, p_idx - 1]
    # lm_head weight detached: frozen, so its (vocab x hidden) weight gradient is never formed
    logits = F.linear(rows, model.lm_head.weight.detach())
    return logits, ids[b_idx, p_idx]


@torch.no_grad()
def masked_accuracy(model: Any, held: np.ndarray, cfg: DiffusionTrainConfig, mask_emb: torch.Tensor,
                    rates: tuple[float, ...] = (0.15, 0.5, 0.9), batches: int = 3) -> dict[str, float]:
    """Held-out top-1 accuracy on masked tokens at fixed mask rates (same seed every time)."""
    out = {}
    for rate in rates:
        rng = np.random.default_rng(1234)
        hits = total = 0
        nll = 0.0
        for _ in range(batches):
            ids, masked, attn = make_batch(held, rng, cfg, rate)
            logits, target = masked_logits(model, ids, masked, attn, mask_emb)
            hits += int((logits.argmax(-1) == target).sum())
            nll += float(F.cross_entropy(logits, target, reduction="sum"))
            total += len(target)
        out[f"acc@{rate:g}"] = hits / max(total, 1)
        out[f"nll@{rate:g}"] = nll / max(total, 1)
    return out


def _train_loop(model: Any, mask_emb: torch.Tensor, train: np.ndarray, cfg: DiffusionTrainConfig,
                log: Callable[[str], None]) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    for name, p in model.named_parameters():
        p.requires_grad = "embed_tokens" not in name and "lm_head" not in name
    params = [p for p in model.parameters() if p.requires_grad] + [mask_emb]

    def step_loss() -> torch.Tensor:
        ids, masked, attn = make_batch(train, rng, cfg)
        logits, target = masked_logits(model, ids, masked, attn, mask_emb)
        return F.cross_entropy(logits, target)

    # linear warm-up: the first steps see a new attention pattern
    res = timed_adamw_loop(
        model,
        params,
        step_loss,
        lr=cfg.lr,
        seconds=cfg.seconds,
        max_steps=cfg.max_steps,
        log=log,
        label="masked CE",
        every=5,
        lr_at=lambda step: cfg.lr * min(1.0, (step + 1) / cfg.warmup),
    )
    return {
        "steps": res.steps,
        "seconds": res.seconds,
        "tokens_seen": res.steps * cfg.batch * cfg.seq_len,
        "loss_first10": res.first(10),
        "loss_last10": res.last(10),
    }


def save_diffusion(model: Any, tokenizer: Any, mask_id: int, mask_emb: torch.Tensor, out_dir: Path,
                   base: str) -> None:
    """save_pretrained + tokenizer + diffusion.json; the mask embedding goes into its token's row."""
    with torch.no_grad():
        model.model.embed_tokens.weight[mask_id] = mask_emb.detach()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    write_form(out_dir, DiffusionForm(mask_token_id=mask_id, mask_token=tokenizer.convert_ids_to_tokens(mask_id),
                                      base_model=base))


def _load_init(init: Path, recipe_name: str, cfg: DiffusionTrainConfig) -> tuple[Any, str]:
    """A saved diffusion LM to continue training from; it must be this recipe's model with the same mask token."""
    from toolchain.compile.recipe import SourceSpec
    from toolchain.compile.source import load
    from toolchain.diffusion.form import read_form

    if not (init / "config.json").is_file():
        raise DiffusionTrainError(f"--init {init}: no config.json there; give a folder written by "
                                  "`mobc train diffusion --out`")
    form = read_form(init)
    if form is None:
        raise DiffusionTrainError(f"--init {init} is not a diffusion LM (no diffusion.json); continue from a folder "
                                  "written by `mobc train diffusion --out`, or drop --init to adapt the recipe's model")
    loaded = load(SourceSpec(path=str(init.resolve())))
    if form.mask_token not in (None, cfg.mask_token):
        raise DiffusionTrainError(f"--init {init} was trained with mask token {form.mask_token!r}, not "
                                  f"{cfg.mask_token!r}; pass --mask-token {form.mask_token!r}")
    base = form.base_model or recipe_name
    return loaded, base


def train_diffusion(recipe_path: Path, out_dir: Path, cfg: DiffusionTrainConfig,
                    log: Callable[[str], None] = print, samples: int = 3, init: Path | None = None) -> dict[str, Any]:
    """Load the recipe's AR model (or continue `init`), adapt it, save it with its marker and a report."""
    from toolchain.compile.recipe import load_recipe
    from toolchain.compile.source import load

    t_start = time.perf_counter()
    recipe = load_recipe(recipe_path)
    if init is not None:
        loaded, base = _load_init(Path(init), recipe.name, cfg)
        log(f"continuing the diffusion LM in {init}")
    else:
        loaded = load(recipe.source, base=recipe_path.parent)
        base = loaded.description
    model, tok = loaded.model, loaded.tokenizer
    mask_id = tok.convert_tokens_to_ids(cfg.mask_token)
    if mask_id is None or mask_id == tok.unk_token_id and cfg.mask_token != tok.unk_token:
        raise DiffusionTrainError(f"--mask-token {cfg.mask_token!r} is not a token of {recipe.name}'s vocabulary")
    # sdpa is much faster than eager for training and honours the same additive 4-D mask
    model.config._attn_implementation = "sdpa"
    # the train/held-out split is the corpus's own (never a seed), so a continued run (--init, another
    # --seed) never trains on the files an earlier run held out; cfg.seed only draws windows and masks
    train, held = corpus.train_and_held_out(tok, cfg.corpus_tokens, cfg.eval_tokens)
    log(f"corpus: {len(train):,} training / {len(held):,} held-out tokens of stdlib source; mask token "
        f"{cfg.mask_token!r} (id {mask_id})")
    mask_emb = torch.nn.Parameter(model.model.embed_tokens.weight[mask_id].detach().clone())
    before = masked_accuracy(model, held, cfg, mask_emb)
    log(f"held-out masked-token accuracy before: {before}")
    stats = _train_loop(model, mask_emb, train, cfg, log)
    after = masked_accuracy(model, held, cfg, mask_emb)
    log(f"held-out masked-token accuracy after {stats['steps']} steps ({stats['seconds']:.0f} s): {after}")
    model.config._attn_implementation = "eager"
    save_diffusion(model, tok, mask_id, mask_emb, out_dir, base)
    gens = sample_generations(model, tok, mask_id, cfg.block, samples)
    for g in gens:
        log(f"sample (S={g['steps']}): {g['prompt']!r} -> {g['completion']!r}")
    report = {"base": recipe.name, "base_source": base, "init": str(init) if init else None, "config": asdict(cfg), "mask_token_id": mask_id,
              "accuracy_before": before, "accuracy_after": after, "samples": gens,
              "loss": "mean CE over masked tokens (no 1/t ELBO weight)",
              "total_seconds": time.perf_counter() - t_start, **stats}
    (out_dir / "diffusion_report.json").write_text(json.dumps(report, indent=2))
    return report
