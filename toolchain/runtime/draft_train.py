"""`mobc train draft`: derive a small draft model from a target and distill it, in minutes on a CPU.

The draft keeps the target's first k decoder layers and its embeddings, and reads them out
through a learned linear "lens" M folded into an untied lm_head (lm_head = E @ M, E the
target's embedding/lm_head matrix): logits = E M norm(h_k). Training data is real text (the
Python standard library's own source, shipped with every Python):

1. teacher pass: the target's final normalized hidden states n_L for every training token
   (one forward pass, cached, so the teacher costs one pass however long we train);
2. lens fit: M by ridge regression of n_L on norm(h_k), closed form (this alone lifts top-1
   agreement with the target from ~2% to ~50% on code; without it a truncated model is noise);
3. distillation: the kept layers, the final norm and M are trained with forward KL to the
   target's next-token distribution (teacher logits E n_L from the cache) on sampled
   positions, for the rest of the wall-clock budget; the held-out agreement decides whether
   the fine-tuned or the lens-only weights are kept.

The result is a plain Hugging Face folder (save_pretrained + tokenizer, built with
from_config + load_state_dict because a GGUF-loaded target refuses save_pretrained) that a
recipe compiles with `source: {path: ...}`.
"""

from __future__ import annotations

import copy
import json
import random
import sysconfig
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from toolchain.errors import MobcError


class DraftTrainError(MobcError):
    """The draft cannot be derived or trained as asked."""


@dataclass
class DistillConfig:
    layers: list[int] = field(default_factory=list)  # target layer indices the draft keeps
    seconds: float = 300.0  # wall-clock budget of teacher pass + distillation
    teacher_share: float = 0.5  # at most this share of the budget goes to the teacher pass
    seq_len: int = 256
    batch: int = 4
    positions: int = 64  # sampled loss positions per sequence (the lm_head is the costly part)
    lr: float = 1e-4
    ridge: float = 1e-3  # lens regularisation, relative to the mean feature energy
    seed: int = 0
    corpus_tokens: int = 65_536  # most training tokens the teacher pass may cover
    eval_tokens: int = 2048


def parse_layers(spec: str, n_layers: int) -> list[int]:
    """'6' -> the first 6 layers; '0-4,29' -> explicit; indices must exist and be increasing."""
    spec = spec.strip()
    if spec.isdigit():
        k = int(spec)
        if not 1 <= k <= n_layers:
            raise DraftTrainError(f"--layers {k}: the target has {n_layers} layers; choose 1..{n_layers}")
        return list(range(k))
    out: list[int] = []
    try:
        for part in spec.split(","):
            lo, _, hi = part.partition("-")
            out.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise DraftTrainError(f"--layers {spec!r}: give a count (6) or indices like 0-4,29") from None
    if not out or any(i < 0 or i >= n_layers for i in out) or out != sorted(set(out)):
        raise DraftTrainError(f"--layers {spec!r}: indices must be increasing and within 0..{n_layers - 1}")
    return out


def derive_draft(teacher: Any, layers: list[int]) -> Any:
    """A model of the target's architecture with only `layers`, weights copied from the target.

    Built with from_config + load_state_dict (a GGUF-loaded target refuses save_pretrained,
    and this also gives a plain checkpoint).
    """
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(teacher.config)
    cfg.num_hidden_layers = len(layers)
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [cfg.layer_types[i] for i in layers]
    student = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    src = teacher.state_dict()
    dst: dict[str, torch.Tensor] = {}
    for key in student.state_dict():
        parts = key.split(".")
        if "layers" in parts:
            j = parts.index("layers") + 1
            parts[j] = str(layers[int(parts[j])])
        dst[key] = src[".".join(parts)].detach().clone()
    student.load_state_dict(dst, strict=True)
    if getattr(cfg, "tie_word_embeddings", False):
        student.tie_weights()
    return student.float().eval()


def stdlib_files(seed: int = 0) -> list[Path]:
    """Python source of the standard library (not its tests), in a seeded random order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if "test" not in p.parts and "site-packages" not in p.parts and "idlelib" not in p.parts)
    random.Random(seed).shuffle(files)
    return files


def corpus(tokenizer: Any, n_tokens: int, eval_tokens: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) token streams; held-out comes from files never trained on."""
    ids: list[int] = []
    held: list[int] = []
    eos = tokenizer.eos_token_id
    for path in stdlib_files(seed):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        toks = tokenizer(text).input_ids + ([eos] if eos is not None else [])
        if len(held) < eval_tokens:
            held.extend(toks)
        else:
            ids.extend(toks)
        if len(ids) >= n_tokens:
            break
    return np.asarray(ids, dtype=np.int64), np.asarray(held[:eval_tokens], dtype=np.int64)




def _windows(tokens: np.ndarray, seq_len: int) -> torch.Tensor:
    n = len(tokens) // seq_len
    return torch.from_numpy(tokens[: n * seq_len].reshape(n, seq_len))


@torch.no_grad()
def teacher_states(teacher: Any, windows: torch.Tensor, seconds: float, batch: int,
                   log: Callable[[str], None] = print) -> torch.Tensor:
    """Final normalized hidden states [n, seq, C] for as many windows as fit the time budget."""
    t0 = time.perf_counter()
    out = []
    for i in range(0, len(windows), batch):
        out.append(teacher.model(windows[i : i + batch]).last_hidden_state.float())
        if time.perf_counter() - t0 > seconds:
            break
    done = sum(len(o) for o in out)
    log(f"teacher pass: {done} windows ({done * windows.shape[1]:,} tokens) in {time.perf_counter() - t0:.0f} s")
    return torch.cat(out)


def _unit_norm_hidden(student: Any, x: torch.Tensor) -> torch.Tensor:
    """The draft's last hidden state normalized without its final norm's weight: h_k / rms(h_k)."""
    seen: list[torch.Tensor] = []
    hook = student.model.norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        student.model(x)
    finally:
        hook.remove()
    h = seen[-1]
    eps = getattr(student.config, "rms_norm_eps", 1e-6)
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


@torch.no_grad()
def fit_lens(student: Any, windows: torch.Tensor, states: torch.Tensor, ridge: float, batch: int) -> torch.Tensor:
    """M [C_out, C_in] minimizing ||n_L - M norm(h_k)||^2 + ridge-term (closed form, float64)."""
    c = states.shape[-1]
    xtx = torch.zeros(c, c, dtype=torch.float64)
    xty = torch.zeros(c, c, dtype=torch.float64)
    for i in range(0, len(states), batch):
        xs = _unit_norm_hidden(student, windows[i : i + batch]).reshape(-1, c).double()
        ys = states[i : i + batch].reshape(-1, c).double()
        xtx += xs.T @ xs
        xty += xs.T @ ys
    lam = ridge * xtx.diagonal().mean()
    m = torch.linalg.solve(xtx + lam * torch.eye(c, dtype=torch.float64), xty)  # [C_in, C_out]
    return m.T.float().contiguous()


class _Readout(torch.nn.Module):
    """logits = E (M (g * norm(h_k))): the draft's final norm weight g, lens M, frozen E."""

    def __init__(self, student: Any, lens: torch.Tensor):
        super().__init__()
        self.student = student
        self.lens = torch.nn.Parameter(lens.clone())
        self.embed = student.get_input_embeddings().weight.detach()

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        return self.student.model(x).last_hidden_state  # includes the trainable final norm

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(h, self.lens), self.embed)


@torch.no_grad()
def agreement(readout: _Readout, windows: torch.Tensor, states: torch.Tensor, batch: int = 4) -> float:
    """Held-out share of positions where the draft's argmax equals the target's (≈ greedy acceptance)."""
    hits = total = 0
    for i in range(0, len(states), batch):
        a = readout.logits(readout.hidden(windows[i : i + batch])).argmax(-1)
        b = F.linear(states[i : i + batch], readout.embed).argmax(-1)
        hits += int((a == b).sum())
        total += a.numel()
    return hits / max(total, 1)


def distill(readout: _Readout, windows: torch.Tensor, states: torch.Tensor, cfg: DistillConfig,
            seconds: float, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Forward KL on sampled positions; layers, final norm and lens train, embeddings stay the target's."""
    gen = torch.Generator().manual_seed(cfg.seed)
    for name, p in readout.student.named_parameters():
        p.requires_grad = "embed_tokens" not in name and "lm_head" not in name
    params = [p for p in readout.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    readout.student.train()
    t0 = time.perf_counter()
    step, losses = 0, []
    while time.perf_counter() - t0 < seconds:
        rows = torch.randint(len(states), (cfg.batch,), generator=gen)
        pos = torch.randint(windows.shape[1], (cfg.batch, cfg.positions), generator=gen)
        h = readout.hidden(windows[rows])
        h = torch.gather(h, 1, pos[..., None].expand(-1, -1, h.shape[-1]))
        t = torch.gather(states[rows], 1, pos[..., None].expand(-1, -1, h.shape[-1]))
        s_logp = F.log_softmax(readout.logits(h), dim=-1).flatten(0, 1)
        with torch.no_grad():
            t_logp = F.log_softmax(F.linear(t, readout.embed), dim=-1).flatten(0, 1)
        loss = F.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        losses.append(loss.item())
        if step % 25 == 0:
            log(f"step {step}: KL {np.mean(losses[-25:]):.3f} ({time.perf_counter() - t0:.0f} s)")
    readout.student.eval()
    return {"steps": step, "distill_seconds": time.perf_counter() - t0,
            "kl_first": float(np.mean(losses[:10])) if losses else None,
            "kl_last": float(np.mean(losses[-10:])) if losses else None}


def fold(readout: _Readout) -> Any:
    """A plain HF model: untied lm_head = E @ M, everything else the student's."""
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(readout.student.config)
    cfg.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    sd = {k: v.detach().clone() for k, v in readout.student.state_dict().items()}
    sd["lm_head.weight"] = (readout.embed @ readout.lens.detach()).contiguous()
    model.load_state_dict(sd, strict=True)
    return model.float().eval()


def train_draft(recipe_path: Path, out_dir: Path, layers: str, cfg: DistillConfig,
                log: Callable[[str], None] = print) -> dict[str, Any]:
    """Load the recipe's model, derive + distill a draft, save it (HF folder + tokenizer + report)."""
    from toolchain.recipe import load_recipe
    from toolchain.source import load

    t_start = time.perf_counter()
    recipe = load_recipe(recipe_path)
    loaded = load(recipe.source, base=recipe_path.parent)
    teacher = loaded.model
    for p in teacher.parameters():
        p.requires_grad = False
    n_layers = teacher.config.num_hidden_layers
    cfg.layers = parse_layers(layers, n_layers)
    log(f"target {recipe.name}: {n_layers} layers; draft keeps {cfg.layers}")
    student = derive_draft(teacher, cfg.layers)
    train, held = corpus(loaded.tokenizer, cfg.corpus_tokens, cfg.eval_tokens, cfg.seed)
    w_train, w_held = _windows(train, cfg.seq_len), _windows(held, cfg.seq_len)
    t_loop = time.perf_counter()
    s_held = teacher_states(teacher, w_held, float("inf"), cfg.batch, log)
    s_train = teacher_states(teacher, w_train, cfg.seconds * cfg.teacher_share, cfg.batch, log)
    w_train = w_train[: len(s_train)]
    student.model.norm.weight.data.fill_(1.0)  # the lens takes over the final norm's scale
    readout = _Readout(student, fit_lens(student, w_train, s_train, cfg.ridge, cfg.batch))
    lens_only = agreement(readout, w_held, s_held)
    log(f"held-out top-1 agreement with the target after the lens fit: {lens_only:.3f}")
    snapshot = copy.deepcopy(readout.state_dict())
    stats = distill(readout, w_train, s_train, cfg, cfg.seconds - (time.perf_counter() - t_loop), log)
    after = agreement(readout, w_held, s_held)
    log(f"held-out top-1 agreement after {stats['steps']} distillation steps: {after:.3f}")
    kept = "distilled"
    if after < lens_only:  # too few steps to help (or overfit): keep the closed-form lens
        readout.load_state_dict(snapshot)
        kept = "lens-only"
    out_dir.mkdir(parents=True, exist_ok=True)
    model = fold(readout)
    model.save_pretrained(out_dir)
    loaded.tokenizer.save_pretrained(out_dir)
    report = {"target": recipe.name, "target_source": loaded.description, "config": asdict(cfg),
              "params": sum(p.numel() for p in model.parameters()), "train_tokens": int(s_train.shape[0] * cfg.seq_len),
              "agreement_lens": lens_only, "agreement_distilled": after, "kept": kept,
              "loop_seconds": time.perf_counter() - t_loop, "total_seconds": time.perf_counter() - t_start, **stats}
    (out_dir / "draft_report.json").write_text(json.dumps(report, indent=2))
    return report
