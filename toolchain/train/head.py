"""`mobc train draft --kind head`: train the feature-level draft head (head_model.py) in minutes on a CPU.

Data (real text, nothing downloaded): the Python standard library's own sources (train split),
plus windows of the target's own greedy continuations of stdlib prompts (on-policy: speculation is
judged on what the target generates). One teacher pass of the target over every window records
its final normalized hidden states n_L; everything the loss needs follows from them:

- row t of a window feeds the head (n_L(t-1), token x_t) (row 0: a zero feature) and must give
  g_t with final_norm(g_t) = n_L(t) (feature regression, smooth L1, as in EAGLE) and the target's
  next-token distribution softmax(n_L(t) E_v^T) (forward KL over the draft vocabulary);
- `unroll` > 1 repeats the pass with the head's own previous predictions as the features
  (test-time-training style), so the head learns to continue from its own drafts.

Held-out acceptance is measured on the target's continuations of held-out prompts: greedy chain
drafting from every start position, as the runtime's chain policy does it (accepted drafts per
round at gamma = 4, and per-depth acceptance).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from toolchain.artifact.integrity import sha256_path
from toolchain.atomic import atomic_file
from toolchain.bench.prompts import ChatPrompt, encode
from toolchain.train import corpus, onpolicy
from toolchain.train.checkpoint import Checkpoint
from toolchain.train.draft import DraftTrainError, target_continuations, teacher_states, token_windows
from toolchain.train.head_model import DraftHead, chain_mask, grow, save_head
from toolchain.train.loop import cosine_by_steps, cosine_by_time, timed_adamw_loop

HEAD_FILE = "head.safetensors"
REPORT_FILE = "head_report.json"
# the report's held-out acceptance keys and what each measures (the target's own greedy text)
HELD_OUT_SETS = {"held_out": "stdlib continuations", "held_out_app": "answers to app prompts",
                 "held_out_chat": "answers to self-written chat requests",
                 "held_out_extra": "answers to the extra rounds' chat requests"}


def held_out_table(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The report's held-out chain acceptance as a table: a row per measured set, and for the answer sets the
    figure counted only up to where the target ends each answer ("-" where not measured)."""
    rows = [[what, f"{a['tokens_per_call']:.2f}",
             f"{a['to_end_of_turn']['tokens_per_call']:.2f}" if "to_end_of_turn" in a else "-",
             " ".join(f"{x:.3f}" for x in a["accept_at_depth"])]
            for key, what in HELD_OUT_SETS.items() if (a := report.get(key))]
    return ["held-out set", "tokens per target call", "up to its end-of-turn", "acceptance by depth"], rows


@dataclass
class HeadConfig:
    minutes: float = 20.0  # wall-clock budget of the whole command
    steps: int | None = None  # instead of the budget: exactly this many training steps, every generation and the
    # teacher pass run to completion (the same work on any machine, however fast or loaded)
    draft_vocab: int = 8192
    head_layers: int = 1  # decoder layers of the target's class in the head (each costs what one of the target's does)
    seq_len: int = 256
    batch: int = 4
    lr: float = 1e-3
    weight_decay: float = 0.0  # AdamW's decoupled decay on the head's matrices (loop.timed_adamw_loop)
    dropout: float = 0.0  # on the head's layer inputs and attention weights while training (DraftHead)
    lr_floor: float = 0.1  # cosine decay over the training's time share down to lr_floor * lr (1.0: constant)
    feature_weight: float = 1.0  # smooth-L1 feature loss beside the KL
    argmax_weight: float = 0.0  # cross-entropy on the target's greedy token beside the KL: a greedy draft must hit
    # the argmax, and where the target decides narrowly the KL barely tells its top two apart
    unroll: int = 2
    unroll_mode: str = "shift"  # "chain": each unrolled row sees the true prefix and its own chain (chain_losses)
    corpus_tokens: int = 262_144  # most stdlib tokens; the teacher pass stops at its time share first
    generated_windows: int = 16  # target continuations of stdlib windows
    app_share: float = 0.2  # of the budget: the target's answers to HumanEval / chat prompts (onpolicy.py)
    app_chat_prompts: int = 160
    self_chat: int = 192  # general-topic requests the target writes itself (Magpie), answered on-policy
    self_chat_share: float = 0.08  # of the budget: writing those requests
    self_chat_openers: bool = False  # start the requests with common instruction verbs (onpolicy.REQUEST_OPENERS)
    answer_batch: int = 32  # rows per batched greedy generation of answers
    teacher_share: float = 0.12  # of the budget: the teacher pass (~100k tokens; the training sees each ~10x)
    teacher_share_cached: float = 0.2  # the same when --onpolicy-cache skipped the generation (its ~40% of a
    # run is free): at 100 minutes the pass then covers all ~2000 windows instead of the first ~1400
    held_out_windows: int = 4
    prompt_len: int = 64
    gamma: int = 4
    seed: int = 0
    onpolicy_cache: str | None = None  # file keeping the generated windows for reruns (cached_onpolicy)
    onpolicy_round: int = 0  # a generate-only run's round: 0 all the data; K >= 1 only more self-written requests
    onpolicy_extra: tuple[str, ...] = ()  # round K >= 1 caches whose answers the training adds (extra_onpolicy)
    extra_held_out: int = 64  # of those answers, held out (evenly spaced; at most a quarter): round 0's held-out
    # chat set is 4 windows, too few to tell two heads apart
    precision: str = "fp32"  # training steps' matmuls: fp32, or bf16 autocast (master weights and the teacher stay fp32)
    teacher_precision: str = "fp32"  # the teacher pass over the training windows (held-out sets stay fp32)
    teacher_cache: str | None = None  # local file keeping the teacher pass's states for reruns (cached_teacher)
    until_end_of_turn: bool = False  # train each window only up to where the target would end its answer (its
    # greedy next token is end-of-turn): the answers were generated past it (min_new_tokens), text no run decodes
    checkpoint: str | None = None  # file keeping the training's state every checkpoint_seconds; a rerun resumes it
    init: str | None = None  # a head this command saved: training goes on from its weights and draft vocabulary
    # (its layer count, or head_layers if more: grown; a fresh optimizer and this run's lr schedule), so a head
    # can improve over several stops
    checkpoint_seconds: float = 600.0


def draft_vocabulary(streams: list[np.ndarray], size: int, vocab: int, always: list[int]) -> torch.Tensor:
    """The `size` most frequent tokens of the training streams (ties by id), plus `always` (eos)."""
    counts = np.zeros(vocab, np.int64)
    for s in streams:
        np.add.at(counts, s.reshape(-1), 1)
    counts[always] = counts.max() + 1
    order = np.lexsort((np.arange(vocab), -counts))[:size]
    return torch.from_numpy(np.sort(order))


class EndOfTurn(NamedTuple):
    """Where a window stops counting: `row` is end-of-turn's row in the head's draft vocabulary, `first` the
    first position whose next token may end the answer (the prompt's last)."""

    row: int
    first: int


@torch.no_grad()
def greedy_tokens(states: torch.Tensor, lm_head: torch.Tensor, rows: int = 4) -> torch.Tensor:
    """The target's greedy next token after each position [B,T], from its final states [B,T,C], `rows` windows
    at a time: the logits of 64 256-token windows over a 49k vocabulary at once are 3.2 GB."""
    out = torch.empty(states.shape[:2], dtype=torch.long)
    for i in range(0, len(states), rows):
        out[i : i + rows] = F.linear(states[i : i + rows], lm_head).argmax(-1)
    return out


def vocab_coverage(greedy: torch.Tensor, vocab_ids: torch.Tensor, prompt_len: int) -> float:
    """The share of the answer tokens (positions prompt_len.. of each window) in the draft vocabulary; greedy
    [B,T] is the target's next token after each position, so the answer's are columns prompt_len-1 .. T-2."""
    return float(torch.isin(greedy[:, prompt_len - 1 : -1], vocab_ids).float().mean())


def rows_until_end(is_end: torch.Tensor, first: int) -> torch.Tensor:
    """[B,T] bool: the rows up to and including the first one from `first` on where `is_end` [B,T] holds (the
    target's greedy next token is end-of-turn: a run would have stopped there); every row if none does."""
    ends = is_end.clone()
    ends[:, :first] = False
    ends[:, -1] |= ~ends.any(1)
    return torch.arange(ends.shape[1])[None] <= ends.long().argmax(1, keepdim=True)


def _row_mean(per_row: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """Mean over the [B,T] rows, or over the kept ones."""
    if keep is None:
        return per_row.mean()
    return (per_row * keep).sum() / keep.sum().clamp(min=1)


def _kl_and_feature(logits: torch.Tensor, n_g: torch.Tensor, t_logp: torch.Tensor, states: torch.Tensor,
                    keep: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The KL to the teacher and the smooth-L1 feature loss, each a mean over the kept rows (all rows: the
    batchmean KL over B*T rows and the elementwise mean)."""
    if keep is None:
        return (F.kl_div(F.log_softmax(logits, -1).flatten(0, 1), t_logp.flatten(0, 1), log_target=True,
                         reduction="batchmean"), F.smooth_l1_loss(n_g, states))
    kl = F.kl_div(F.log_softmax(logits, -1), t_logp, log_target=True, reduction="none").sum(-1)
    return _row_mean(kl, keep), _row_mean(F.smooth_l1_loss(n_g, states, reduction="none").mean(-1), keep)


def _teacher_rows(head: DraftHead, states: torch.Tensor,
                  end: EndOfTurn | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The teacher's log-probabilities over the draft vocabulary [B,T,V], its greedy row after each position
    [B,T] and the rows kept up to its end-of-turn (None: all), once for every unrolled pass."""
    with torch.no_grad():
        t_logp = F.log_softmax(F.linear(states, head.lm_rows), dim=-1)
        greedy = t_logp.argmax(-1)
        return t_logp, greedy, None if end is None else rows_until_end(greedy == end.row, end.first)


def _pass_loss(logits: torch.Tensor, n_g: torch.Tensor, t_logp: torch.Tensor, greedy: torch.Tensor,
               states: torch.Tensor, keep: torch.Tensor | None, weights: tuple[float, float, int],
               parts: dict[str, float], step: int) -> torch.Tensor:
    """One unrolled pass's share of the loss, its parts recorded under `step`: (KL + feature_weight * feature
    [+ argmax_weight * the cross-entropy on the teacher's greedy rows]) / unroll, each a mean over the kept
    rows; `weights` is (feature_weight, argmax_weight, unroll)."""
    feature_weight, argmax_weight, unroll = weights
    kl, feat = _kl_and_feature(logits, n_g, t_logp, states, keep)
    loss = (kl + feature_weight * feat) / unroll
    parts[f"kl{step}"], parts[f"feat{step}"] = kl.item(), feat.item()
    if argmax_weight:
        ce = F.cross_entropy(logits.flatten(0, 1).float(), greedy.flatten(), reduction="none")
        ce = _row_mean(ce.view(greedy.shape), keep)
        loss = loss + argmax_weight * ce / unroll
        parts[f"ce{step}"] = ce.item()
    return loss


def _shift_features(states: torch.Tensor) -> torch.Tensor:
    """Row t's input feature: n_L(t-1); row 0 gets zeros."""
    return torch.cat([torch.zeros_like(states[:, :1]), states[:, :-1]], dim=1)


def head_losses(head: DraftHead, windows: torch.Tensor, states: torch.Tensor, unroll: int,
                feature_weight: float, mode: str = "shift", end: EndOfTurn | None = None,
                argmax_weight: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    if mode == "chain":
        return chain_losses(head, windows, states, unroll, feature_weight, end, argmax_weight)
    positions = torch.arange(windows.shape[1])[None].expand(len(windows), -1)
    t_logp, greedy, keep = _teacher_rows(head, states, end)
    feats = _shift_features(states)
    total, parts = 0.0, {}
    for step in range(unroll):
        g = head.forward_train(feats, windows, positions, normalized=True)
        n_g = head.norm(g)
        total = total + _pass_loss(F.linear(n_g, head.lm_rows), n_g, t_logp, greedy, states, keep,
                                   (feature_weight, argmax_weight, unroll), parts, step)
        feats = _shift_features(n_g)  # the next pass continues from the head's own features
    return total, parts


def chain_block(head: DraftHead, feats: list[torch.Tensor], toks: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """The head's output rows [B,T,C] of the newest of the chain_mask blocks given so far (`feats` [B,T,C] and
    `toks` [B,T], one per block; row s of block k sits at position s + k)."""
    k, (b, t) = len(toks), toks[0].shape
    positions = torch.cat([torch.arange(t) + a for a in range(k)])[None].expand(b, -1)
    return head.forward_train(torch.cat(feats, 1), torch.cat(toks, 1), positions, normalized=True,
                              mask=mask[..., : k * t, : k * t])[:, -t:]


def chain_losses(head: DraftHead, windows: torch.Tensor, states: torch.Tensor, unroll: int,
                 feature_weight: float, end: EndOfTurn | None = None,
                 argmax_weight: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The unroll as the chain policy drafts (EAGLE-3's training-time test): pass a runs the blocks of
    chain_mask, in which row s of block a continues the chain from position s on the head's own features
    of its block a-1 row and the window's true token at s+a, seeing only the true rows up to s and its
    own chain; it is trained on the target at s+a. The "shift" unroll instead feeds every row of pass a
    the head's features from pass a-1, its prefix included, which the runtime never does."""
    t = windows.shape[1]
    t_logp, greedy, keep = _teacher_rows(head, states, end)
    mask = chain_mask(t, unroll)
    feats, toks = [_shift_features(states)], [windows]
    total, parts = 0.0, {}
    for a in range(unroll):
        n_g = head.norm(chain_block(head, feats, toks, mask))
        rows = t - a  # row s of block a is trained on position s + a: the last a rows have no target
        total = total + _pass_loss(F.linear(n_g[:, :rows], head.lm_rows), n_g[:, :rows], t_logp[:, a:],
                                   greedy[:, a:], states[:, a:], None if keep is None else keep[:, a:],
                                   (feature_weight, argmax_weight, unroll), parts, a)
        feats.append(n_g)
        toks.append(torch.cat([windows[:, a + 1 :], windows[:, -1:].expand(-1, a + 1)], 1))  # true token at s+a+1
    return total, parts


def training_loss(head: DraftHead, windows: torch.Tensor, states: torch.Tensor, cfg: HeadConfig,
                  end: EndOfTurn | None = None) -> torch.Tensor:
    """One step's loss at the training's precision: bf16 autocast runs the matmuls in bf16 (~1.6x the steps
    per minute on a CPU with AVX512-BF16) while the weights, AdamW's state and the teacher stay fp32.
    `end`: count each window's rows only up to the target's end-of-turn (cfg.until_end_of_turn)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.precision == "bf16"):
        return head_losses(head, windows, states, cfg.unroll, cfg.feature_weight, cfg.unroll_mode, end,
                           cfg.argmax_weight)[0]


@torch.no_grad()
def draft_chains(head: DraftHead, windows: torch.Tensor, states: torch.Tensor, gamma: int,
                 rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, gamma, T] token ids: [b, a, s] is the (a+1)-th greedy draft of the chain that starts after position
    s of window b (the head sees true features for rows <= s, then its own), and [B, gamma, T, C] the head's
    output rows that drafted them, for every s at once: `gamma` passes over the blocks of chain_mask instead
    of one pass per start and draft (`rows` windows at a time: the mask's attention is (gamma T)^2 per
    window and head)."""
    b, t = windows.shape
    mask = chain_mask(t, gamma)
    out, hidden = [], []
    for i in range(0, b, rows):
        feats, toks = [_shift_features(states[i : i + rows])], [windows[i : i + rows]]
        drafts, gs = [], []
        for _ in range(gamma):
            g = chain_block(head, feats, toks, mask)
            d = head.vocab_ids[head.logits(g).argmax(-1)]
            drafts.append(d)
            gs.append(g)
            feats.append(head.norm(g))
            toks.append(d)
        out.append(torch.stack(drafts, 1))
        hidden.append(torch.stack(gs, 1))
    return torch.cat(out), torch.cat(hidden)


@torch.no_grad()
def chain_acceptance(head: DraftHead, windows: torch.Tensor, states: torch.Tensor, targets: torch.Tensor,
                     start: int, gamma: int, keep: torch.Tensor | None = None) -> dict[str, Any]:
    """Greedy chain drafting from every position s >= start of each window (as the chain policy):
    the head sees true features for rows <= s, then its own; accepted = the leading drafts matching the
    target's greedy tokens (`targets` [B,T]: the token after each position). `keep` [B,T] (rows_until_end):
    only the rows a run decodes count, as starts and as drafts (a run stops at the target's end-of-turn)."""
    return drafts_accepted(draft_chains(head, windows, states, gamma)[0], targets, start, gamma, keep)


def drafts_accepted(drafts: torch.Tensor, targets: torch.Tensor, start: int, gamma: int,
                    keep: torch.Tensor | None = None) -> dict[str, Any]:
    """chain_acceptance's count on drafts already made by draft_chains ([B, gamma, T])."""
    starts = torch.arange(start, drafts.shape[-1] - gamma - 1)
    want = torch.stack([targets[:, starts + a] for a in range(gamma)], 1)  # the a-th draft is the token after s+a
    ok = drafts[:, :, starts] == want
    if keep is not None:
        ok &= torch.stack([keep[:, starts + a] for a in range(gamma)], 1)
    acc = ok.long().cumprod(1).sum(1)
    acc = (acc if keep is None else acc[keep[:, starts]]).flatten().float()
    depth = [(acc >= k).float().mean().item() for k in range(1, gamma + 1)]
    return {"tokens_per_call": 1 + acc.mean().item(), "accept_at_depth": depth, "rounds": int(acc.numel())}


def onpolicy_data(target: Any, tok: Any, train: np.ndarray, held: np.ndarray, cfg: HeadConfig,
                  budget: float, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The target's own greedy text: continuations of stdlib windows and answers to app prompts (the
    training's on-policy windows), and the held-out sets' windows, each generation within its budget share.
    Round K >= 1 (`onpolicy_round`): only answers to new self-written requests (more_self_chat)."""
    if cfg.onpolicy_round > 0:
        return more_self_chat(target, tok, cfg, budget, log)
    gen = target_continuations(target, train, cfg.generated_windows, cfg.seq_len, cfg.prompt_len, 16, cfg.seed,
                               seconds=budget * 0.25)
    gen_held = target_continuations(target, held, cfg.held_out_windows, cfg.seq_len, cfg.prompt_len, 16, cfg.seed + 1)
    requests = _self_chat(target, tok, cfg, cfg.self_chat + cfg.held_out_windows, budget, log)
    prompts = onpolicy.app_prompts(tok, cfg.app_chat_prompts, cfg.seed, requests[cfg.held_out_windows:])
    pad = tok.eos_token_id or 0
    app = onpolicy.prompt_continuations(target, prompts[cfg.held_out_windows:], cfg.seq_len, cfg.prompt_len,
                                        cfg.answer_batch, budget * cfg.app_share, pad_id=pad, log=log)
    held_prompts = {"app": prompts[: cfg.held_out_windows],
                    "chat": [encode(tok, ChatPrompt(r)) for r in requests[: cfg.held_out_windows]]}
    held_sets = {k: onpolicy.prompt_continuations(target, v, cfg.seq_len, cfg.prompt_len, cfg.answer_batch,
                                                  float("inf"), pad_id=pad) for k, v in held_prompts.items() if v}
    return {"gen": gen, "gen_held": gen_held, "app": app, "requests": requests, "held_sets": held_sets}


def _self_chat(target: Any, tok: Any, cfg: HeadConfig, n: int, budget: float,
               log: Callable[[str], None] | None) -> list[str]:
    """`n` requests the target writes itself for this round (its seed, openers and budget share)."""
    openers = onpolicy.REQUEST_OPENERS if cfg.self_chat_openers else ("",)
    return onpolicy.self_chat_requests(target, tok, n, round_seed(cfg), seconds=budget * cfg.self_chat_share,
                                       openers=openers, log=log)


def round_seed(cfg: HeadConfig) -> int:
    """The seed a round samples its self-written requests from (round 0: the run's seed)."""
    return cfg.seed + 1000 * cfg.onpolicy_round


def more_self_chat(target: Any, tok: Any, cfg: HeadConfig, budget: float,
                   log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Round K >= 1 of on-policy data: `cfg.self_chat` more requests the target writes itself (sampled from
    round_seed, so other requests than round 0's) and its greedy answers to them, all for training. The
    HumanEval and stdlib prompts and the held-out sets are round 0's alone: answering them again would
    give the same greedy windows."""
    requests = _self_chat(target, tok, cfg, cfg.self_chat, budget, log)
    prompts = [encode(tok, ChatPrompt(r)) for r in requests]
    app = onpolicy.prompt_continuations(target, prompts, cfg.seq_len, cfg.prompt_len, cfg.answer_batch,
                                        budget * cfg.app_share, pad_id=tok.eos_token_id or 0, log=log)
    none = torch.zeros(0, cfg.seq_len, dtype=torch.long)
    return {"gen": none, "gen_held": none, "app": app, "requests": requests, "held_sets": {}}


# the settings that decide which text the generation writes (the time shares only decide how much)
CACHE_KEYS = ("seq_len", "prompt_len", "seed", "held_out_windows", "generated_windows", "app_chat_prompts",
              "self_chat", "self_chat_openers", "onpolicy_round")


# the cache keys `mobc train draft --kind head` takes as options
CACHE_OPTIONS = ("seed", "self_chat", "self_chat_openers", "onpolicy_round")


def _setting(key: str) -> str:
    """A cache key as the user names it: the option's spelling (--self-chat) when it is one of the command's
    options, else the setting's own name (the target, or a HeadConfig field a library caller set)."""
    return "--" + key.replace("_", "-") if key in CACHE_OPTIONS else key


def cached_onpolicy(cfg: HeadConfig, target: str, log: Callable[[str], None],
                    generate: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], bool]:
    """`generate()`'s windows, and whether they were read from `cfg.onpolicy_cache`: read when that file holds
    this target's windows for these settings (generation is most of a run's budget: a rerun then spends it on
    the teacher pass and training), else generated and written there. A file for another target or other
    settings is refused, not overwritten."""
    if not cfg.onpolicy_cache:
        return generate(), False
    path = Path(cfg.onpolicy_cache)
    key = {"target": target, **{k: getattr(cfg, k) for k in CACHE_KEYS}}
    if path.is_file():
        saved = _read_cache(path, "--onpolicy-cache")
        old = saved["key"]
        if old != key:
            diff = ", ".join(f"{_setting(k)} {old.get(k)!r} (this run: {key[k]!r})" for k in key if old.get(k) != key[k])
            raise DraftTrainError(f"--onpolicy-cache {path} holds windows generated with other settings: {diff}; "
                                  "delete it or give another path")
        log(f"on-policy windows read from {path} ({len(saved['app'])} answer windows; generation skipped)")
        return {k: _token_ids(v, torch.long) for k, v in saved.items() if k != "key"}, True
    data = generate()
    with atomic_file(path) as tmp:  # a run stopped mid-write leaves no cache that looks complete
        torch.save({"key": key, **{k: _token_ids(v, torch.int32) for k, v in data.items()}}, tmp)
    return data, False


def _load_keyed(path: Path, option: str, kind: str = "a cache", needs: tuple[str, ...] = ()) -> dict[str, Any]:
    """A file this command wrote (a dict with a `key` dict and the entries `needs`), else refused by name."""
    try:
        saved = torch.load(path, weights_only=True)
    except Exception as exc:
        saved = exc
    key = saved.get("key") if isinstance(saved, dict) else None
    if not isinstance(key, dict) or any(k not in saved for k in needs):
        raise DraftTrainError(f"{option} {path}: not {kind} this command wrote ({type(saved).__name__}); "
                              "delete it or give another path")
    return saved


def _read_cache(path: Path, option: str) -> dict[str, Any]:
    """An on-policy cache file this command wrote, its key completed: a setting added after the file was written
    had its default then (the text it decides did not vary)."""
    saved = _load_keyed(path, option)
    saved["key"] = {**{k: HeadConfig.__dataclass_fields__[k].default for k in CACHE_KEYS}, **saved["key"]}
    return saved


def cached_teacher(cfg: HeadConfig, target: str, windows: torch.Tensor, log: Callable[[str], None],
                   compute: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The windows that have teacher states and those states, in `windows`' order. `compute(w)` runs the
    pass over windows `w` and may stop after a prefix of them when its time runs out. With `cfg.teacher_cache`
    the file's states are read for every window it holds (this target, this precision) and the pass runs only
    over the others; the file then keeps both (fp16, ~0.3 MB per 256-token window at 576 features), so a run
    that adds a round of answers pays the pass for that round alone. With a cache the states come back as the
    file keeps them (fp16; new rows rounded as written, and `compute` may already give fp16): the training
    widens each batch, so a run over 8k windows holds 2.4 GB of states, not a 4.9 GB fp32 copy beside the
    file's, and the run that writes the file trains on exactly what every later run reading it does. Without
    a cache they are `compute`'s own. A file for another target or precision, or not written by this
    command, is refused, not overwritten."""
    if not cfg.teacher_cache:
        states = compute(windows)
        return windows[: len(states)], states
    path = Path(cfg.teacher_cache)
    key = {"target": target, "teacher_precision": cfg.teacher_precision}
    saved = {"windows": windows[:0].to(torch.int32), "states": torch.empty(0, windows.shape[1], 0, dtype=torch.half)}
    if path.is_file():
        saved = _load_keyed(path, "--teacher-cache", kind="a teacher cache", needs=("states", "windows"))
        old = saved["key"]
        if old != key:
            what = {"target": "the target", "teacher_precision": "--teacher-precision"}
            diff = " and ".join(what[k] for k in key if old.get(k) != key[k])
            raise DraftTrainError(f"--teacher-cache {path} holds the teacher states of another run ({diff}); "
                                  "delete it or give another path")
        if saved["windows"].shape[1] != windows.shape[1]:
            raise DraftTrainError(f"--teacher-cache {path} holds {saved['windows'].shape[1]}-token windows "
                                  f"(this run: --seq-len {windows.shape[1]}); delete it or give another path")
    row_of = {bytes(w.numpy()): i for i, w in enumerate(saved["windows"])}
    ids = windows.to(torch.int32)
    found = [row_of.get(bytes(w.numpy())) for w in ids]
    missing = [i for i, j in enumerate(found) if j is None]
    if not missing:
        log(f"teacher states read from {path} ({len(windows)} windows; teacher pass skipped)")
        return windows, gather_rows_in_place(saved["states"], found)  # the file's tensor, in the run's order
    if len(missing) < len(windows):
        log(f"teacher states read from {path} for {len(windows) - len(missing)} of {len(windows)} windows; "
            f"the pass runs over the other {len(missing)}")
    new = compute(windows[missing])
    done = missing[: len(new)]  # the pass may have stopped early
    keep = [i for i, j in enumerate(found) if j is not None] + done
    keep.sort()  # the run's own order: with the same data, the same rows at the same steps as without a cache
    width = new.shape[-1]
    saved_states, new_half = saved["states"].reshape(-1, windows.shape[1], width), new.half()
    del new  # an fp32 pass's states: the rows kept are their fp16 rounding, as written
    states = torch.cat([saved_states, new_half]) if len(saved_states) else new_half  # the file's rows
    with atomic_file(path) as tmp:  # a run stopped mid-write leaves no cache that looks complete
        torch.save({"key": key, "windows": torch.cat([saved["windows"], ids[done]]), "states": states}, tmp)
    log(f"teacher states written to {path} ({len(saved['windows']) + len(done)} windows, {len(done)} new)")
    at = {i: len(saved_states) + n for n, i in enumerate(done)}  # where each new row sits in the file
    # the file's tensor put in the run's order (nothing read: the pass's own rows, in order, no copy)
    return windows[keep], gather_rows_in_place(states, [at[i] if found[i] is None else found[i] for i in keep])


def gather_rows_in_place(t: torch.Tensor, order: list[int]) -> torch.Tensor:
    """t[order] made in t's own memory, one row of scratch: a teacher cache's states are GBs, and t[order] would
    hold them twice. The rows of t outside `order` end up past the returned view. A row asked for twice (a run
    holding the same window twice) needs a second copy of it: then this is t[order]."""
    n = len(t)
    if order == list(range(n)):
        return t
    used = set(order)
    if len(used) < len(order):
        return t[order]
    perm = [*order, *(i for i in range(n) if i not in used)]  # new row r = old row perm[r], a permutation
    done = [False] * n
    for start in range(n):  # each cycle of perm: a row is read before it is written, but for the first, kept aside
        if done[start]:
            continue
        first, r = t[start].clone(), start
        while True:
            done[r] = True
            src = perm[r]
            if src == start:
                t[r] = first
                break
            t[r] = t[src]
            r = src
    return t[: len(order)]


def round0_windows(data: dict[str, Any]) -> list[torch.Tensor]:
    """Every window of a round-0 cache, held-out ones included: what an extra round must not repeat."""
    return [data["app"], data["gen"], data["gen_held"], *data["held_sets"].values()]


def extra_onpolicy(cfg: HeadConfig, target: str, known: list[torch.Tensor], log: Callable[[str], None]) -> torch.Tensor:
    """The answer windows of `cfg.onpolicy_extra`: caches of rounds K >= 1 (`--generate-only --onpolicy-round K`)
    for this target and window shape. A window equal to one in `known` (round 0's training and held-out
    windows) or to an earlier extra one is dropped: the same request gives the same greedy answer, and a
    held-out answer must stay out of training."""
    seen = {tuple(w.tolist()) for t in known for w in t}
    out: list[torch.Tensor] = []
    rounds: dict[tuple[int, int], str] = {}
    for name in cfg.onpolicy_extra:
        path = Path(name)
        if not path.is_file():
            raise DraftTrainError(f"--onpolicy-extra {path}: no such file; write it with --generate-only "
                                  "--onpolicy-round K --onpolicy-cache FILE")
        saved = _read_cache(path, "--onpolicy-extra")
        key = saved["key"]
        if key.get("target") != target:
            raise DraftTrainError(f"--onpolicy-extra {path}: holds answers of {key.get('target')!r}, not of {target!r}")
        if key["onpolicy_round"] < 1:
            raise DraftTrainError(f"--onpolicy-extra {path}: a round-0 cache (a whole run's data with its held-out "
                                  "sets); give it to --onpolicy-cache, and write extra rounds with --generate-only "
                                  "--onpolicy-round K")
        shape = [k for k in ("seq_len", "prompt_len") if key[k] != getattr(cfg, k)]
        if shape:
            raise DraftTrainError(f"--onpolicy-extra {path}: windows of other shape: "
                                  + ", ".join(f"{k} {key[k]} (this run: {getattr(cfg, k)})" for k in shape))
        ident = (key["seed"], key["onpolicy_round"])
        if ident in rounds:
            raise DraftTrainError(f"--onpolicy-extra {path}: the same round (--seed {ident[0]} --onpolicy-round "
                                  f"{ident[1]}) as {rounds[ident]}; give each round once")
        rounds[ident] = str(path)
        kept = 0
        for w in _token_ids(saved["app"], torch.long):
            if (t := tuple(w.tolist())) not in seen:
                seen.add(t)
                out.append(w)
                kept += 1
        log(f"extra on-policy windows: {kept} from {path} (round {ident[1]}; {len(saved['app']) - kept} already known)")
    return torch.stack(out) if out else torch.zeros(0, cfg.seq_len, dtype=torch.long)


def held_out_sample(windows: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rest, n evenly spaced windows), n at most a quarter of them: spread over the whole generation, so
    over every opener and prompt length (the generation sorts runs of prompts by length)."""
    n = min(n, len(windows) // 4)
    if n <= 0:
        return windows, windows[:0]
    held = torch.zeros(len(windows), dtype=torch.bool)
    held[torch.arange(n) * (len(windows) // n)] = True
    return windows[~held], windows[held]


def _token_ids(value: Any, dtype: torch.dtype) -> Any:
    """Token-id tensors (alone or in a dict) as `dtype`: the cache stores int32, half the bytes of int64 (a
    shipped cache is a repository file); training indexes with int64."""
    if isinstance(value, torch.Tensor) and not value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, dict):
        return {k: _token_ids(v, dtype) for k, v in value.items()}
    return value


def _target_and_text(recipe_path: Path, cfg: HeadConfig) -> tuple[Any, Any, str, str, np.ndarray, np.ndarray]:
    """The frozen float target, its tokenizer, the recipe's name, where the target came from, and the
    stdlib train / held-out token streams."""
    target, tok, name, source = load_target(recipe_path, cfg.seed)
    train, held = corpus.train_and_held_out(tok, cfg.corpus_tokens, cfg.seq_len * 8, cfg.seed)
    return target, tok, name, source, train, held


def load_target(recipe_path: Path, seed: int = 0) -> tuple[Any, Any, str, str]:
    """The frozen float target of a recipe (sdpa attention), its tokenizer, the recipe's name and where the
    target came from."""
    from toolchain.compile.recipe import load_recipe
    from toolchain.compile.source import load

    torch.manual_seed(seed)
    recipe = load_recipe(recipe_path)
    loaded = load(recipe.source, base=recipe_path.parent)
    target = loaded.model.float().eval()
    # sdpa, not the exporter's eager attention: generation and the teacher pass ran 1.2x faster (eager's
    # GQA key/value copies were a third of generate's time), the same greedy tokens on a 16 x 48 probe
    target.set_attn_implementation("sdpa")
    for p in target.parameters():
        p.requires_grad = False
    return target, loaded.tokenizer, recipe.name, loaded.description


def new_head(target: Any, tok: Any, windows: torch.Tensor, draft_vocab: int, layers: int = 1,
             dropout: float = 0.0) -> DraftHead:
    """A fresh `layers`-layer head over the `draft_vocab` most frequent tokens of `windows` (and eos), sdpa
    attention, `dropout` while training."""
    eos = [i for i in [getattr(tok, "eos_token_id", None)] if i is not None]
    head = DraftHead(target, draft_vocabulary([windows.numpy()], draft_vocab, target.config.vocab_size, eos),
                     init_layer=None, layers=layers, dropout=dropout)  # measured: a fresh layer generalises better than the target's last one
    # (held-out top-1 0.30 vs 0.23 after a minute)
    head.config._attn_implementation = "sdpa"
    return head


def head_weights(path: Path) -> Path:
    """A head's safetensors: the path itself, or the file inside a folder this command wrote."""
    return path / HEAD_FILE if path.is_dir() else path


def continued_head(target: Any, weights: Path, dropout: float = 0.0) -> DraftHead:
    """The saved head at `weights` (a head.safetensors or the folder holding one) to train further: its
    trained tensors and draft vocabulary, sdpa attention, `dropout` while training."""
    from toolchain.compile.head import load_head

    head = load_head(target, head_weights(weights), dropout)
    head.config._attn_implementation = "sdpa"
    return head


def end_of_turn(head: DraftHead, tok: Any, cfg: HeadConfig) -> EndOfTurn:
    """The tokenizer's end-of-turn (its eos) as a draft-vocabulary row; new_head always keeps it."""
    eos = getattr(tok, "eos_token_id", None)
    if eos is None or not bool((head.vocab_ids == eos).any()):
        raise DraftTrainError("--until-end-of-turn: the target's tokenizer names no end-of-turn (eos) token")
    return EndOfTurn(int((head.vocab_ids == eos).nonzero()[0, 0]), cfg.prompt_len - 1)


def answer_windows(path: Path, option: str) -> torch.Tensor:
    """The training answer windows of an on-policy cache file this command wrote (int64 token ids)."""
    return cached_answers(path, option)[0]


def cached_answers(path: Path, option: str) -> tuple[torch.Tensor, int]:
    """answer_windows and the length of the prompt that opens each window (the answer follows it)."""
    if not path.is_file():
        raise DraftTrainError(f"{option} {path}: no such file; give an on-policy cache `mobc train draft --kind "
                              "head` wrote (assets/heads/ ships some)")
    saved = _read_cache(path, option)
    return saved["app"].long(), int(saved["key"]["prompt_len"])


def generate_onpolicy(recipe_path: Path, cfg: HeadConfig, log: Callable[[str], None] = print) -> dict[str, int]:
    """Only write `cfg.onpolicy_cache` (generation with no time limit: every prompt and requested chat request
    answered), so a later `train_head` with the same settings spends its whole budget on the teacher pass
    and training. Generation is the slow part of a run; doing it once lets the training runs that read it
    be repeated or lengthened. A cache already holding these settings is kept."""
    if not cfg.onpolicy_cache:
        raise DraftTrainError("--generate-only writes the on-policy windows to --onpolicy-cache FILE; give that file")
    if cfg.onpolicy_extra:
        raise DraftTrainError("--onpolicy-extra: extra rounds are read by a training run, not by --generate-only")
    target, tok, name, source, train, held = _target_and_text(recipe_path, cfg)
    data, _ = cached_onpolicy(cfg, f"{name} ({source})", log,
                              lambda: onpolicy_data(target, tok, train, held, cfg, float("inf"), log))
    return {"app_windows": len(data["app"]), "stdlib_continuations": len(data["gen"]),
            "self_chat_requests": len(data["requests"]),
            "held_out_windows": len(data["gen_held"]) + sum(len(v) for v in data["held_sets"].values())}


def train_head(recipe_path: Path, out_dir: Path, cfg: HeadConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    if cfg.onpolicy_round:
        raise DraftTrainError(f"--onpolicy-round {cfg.onpolicy_round}: a later round only writes more answers (with "
                              "--generate-only); train with round 0's --onpolicy-cache and that file as --onpolicy-extra")
    t0 = time.perf_counter()
    budget = cfg.minutes * 60 if cfg.steps is None else float("inf")
    target, tok, name, source, train, held = _target_and_text(recipe_path, cfg)
    w_train = token_windows(train, cfg.seq_len)
    target_id = f"{name} ({source})"  # what every cache's key names the target by
    data, read = cached_onpolicy(cfg, target_id, log,
                                 lambda: onpolicy_data(target, tok, train, held, cfg, budget, log))
    gen, gen_held, app, requests, held_sets = (data[k] for k in ("gen", "gen_held", "app", "requests", "held_sets"))
    log(f"target continuations: {len(gen)} stdlib + {len(app)} app-prompt training windows "
        f"({len(requests)} self-written chat requests), {len(gen_held)} + "
        f"{sum(len(v) for v in held_sets.values())} held-out ({time.perf_counter() - t0:.0f} s)")
    extra = extra_onpolicy(cfg, target_id, round0_windows(data), log)
    extra, held_extra = held_out_sample(extra, cfg.extra_held_out)
    if len(held_extra):
        held_sets = {**held_sets, "extra": held_extra}
    windows = torch.cat([app, extra, gen, w_train])
    # the teacher pass's share covers round 0's windows at ~100 minutes; extra rounds' windows need it to grow
    share = (cfg.teacher_share_cached if read else cfg.teacher_share) * len(windows) / (len(windows) - len(extra))
    share = min(share, 0.4)
    keep_as = torch.half if cfg.teacher_cache else torch.float32  # what cached_teacher hands back either way
    windows, states = cached_teacher(cfg, target_id, windows, log, lambda w: teacher_states(
        target, w, budget * share, cfg.batch, log, precision=cfg.teacher_precision, dtype=keep_as)[0])
    s_held, _ = teacher_states(target, gen_held, float("inf"), cfg.batch, log)
    held_states = {k: teacher_states(target, v, float("inf"), cfg.batch, log)[0]
                   for k, v in held_sets.items() if len(v)}
    init_sha256, saved = None, 0
    if cfg.init:  # hashed as read: with --out the same folder, the file is the new head by the report's time
        init_sha256 = sha256_path(head_weights(Path(cfg.init)))
        head = continued_head(target, Path(cfg.init), cfg.dropout)
        saved = len(head.layers)
        grown = grow(head, cfg.head_layers)  # the CLI refuses fewer layers than saved; the default (1) keeps them
        cfg = replace(cfg, head_layers=len(head.layers), draft_vocab=len(head.vocab_ids))  # as the report says
        log(f"continuing {cfg.init}: {cfg.head_layers} layers"
            + (f" ({saved} saved, {grown} appended as the identity)" if grown else "")
            + f", its draft vocabulary of {cfg.draft_vocab} tokens")
    else:
        head = new_head(target, tok, windows, cfg.draft_vocab, cfg.head_layers, cfg.dropout)
    vocab_ids = head.vocab_ids
    e_all = target.get_output_embeddings().weight.detach()
    t_held = greedy_tokens(s_held, e_all)  # the target's greedy next token after each position
    coverage = vocab_coverage(t_held, vocab_ids, cfg.prompt_len)
    log(f"draft vocabulary: {len(vocab_ids)} tokens cover {coverage:.3f} of the target's held-out greedy tokens")

    gen_rng = torch.Generator().manual_seed(cfg.seed)
    end = end_of_turn(head, tok, cfg) if cfg.until_end_of_turn else None

    def step_loss() -> torch.Tensor:
        rows = torch.randint(len(windows), (cfg.batch,), generator=gen_rng)
        return training_loss(head, windows[rows], states[rows].float(), cfg, end)  # fp16 when read from a cache

    if cfg.steps is not None:
        left, lr_at = float("inf"), cosine_by_steps(cfg.lr, cfg.steps, floor=cfg.lr_floor)
    else:
        left = budget - (time.perf_counter() - t0) - min(60.0, 0.1 * budget)  # a minute kept for the evaluation
        if left < 0.1 * budget:
            raise DraftTrainError(f"--minutes {cfg.minutes}: the target's continuations and teacher pass used "
                                  f"{time.perf_counter() - t0:.0f} s; give the training at least a few minutes more")
        lr_at = cosine_by_time(cfg.lr, left, floor=cfg.lr_floor)
    ckpt = None
    if cfg.checkpoint:
        if cfg.steps is None:
            raise DraftTrainError("--checkpoint: a run resumes step for step, so it needs --steps N, not a time budget")
        ckpt = Checkpoint(Path(cfg.checkpoint), checkpoint_key(cfg, target_id, windows, states), gen_rng,
                          cfg.checkpoint_seconds)
    res = timed_adamw_loop(head, head.trainable(), step_loss, lr=cfg.lr, seconds=left, log=log, label="loss",
                           every=20, lr_at=lr_at, max_steps=cfg.steps, weight_decay=cfg.weight_decay,
                           checkpoint=ckpt)
    head.eval()
    accepts = {"held_out": chain_acceptance(head, gen_held, s_held, t_held, cfg.prompt_len, cfg.gamma)}
    eos = getattr(tok, "eos_token_id", None)
    for key, st in held_states.items():  # a set is absent when none of its prompts fits the window
        greedy = greedy_tokens(st, e_all)
        drafts = draft_chains(head, held_sets[key], st, cfg.gamma)[0]  # drafted once, counted both ways
        accepts[f"held_out_{key}"] = drafts_accepted(drafts, greedy, cfg.prompt_len, cfg.gamma)
        if eos is not None:  # the answers run past the target's end-of-turn; a run decodes only up to it
            keep = rows_until_end(greedy == eos, cfg.prompt_len - 1)
            accepts[f"held_out_{key}"]["to_end_of_turn"] = drafts_accepted(drafts, greedy, cfg.prompt_len,
                                                                           cfg.gamma, keep)
    for key, a in accepts.items():
        to_end = f" ({a['to_end_of_turn']['tokens_per_call']:.2f} up to its end-of-turn)" if "to_end_of_turn" in a else ""
        log(f"held-out chain gamma={cfg.gamma} on the target's {HELD_OUT_SETS[key]}: {a['tokens_per_call']:.2f} "
            f"tokens per target call{to_end}; acceptance by depth {[round(x, 3) for x in a['accept_at_depth']]}")
    out_dir.mkdir(parents=True, exist_ok=True)
    save_head(head, out_dir / HEAD_FILE)
    # the cache by file name: its full path is this machine's (the cache's key checked what it holds)
    config = {**asdict(cfg), "minutes": cfg.minutes if cfg.steps is None else None,  # --steps replaces the budget
              **onpolicy_file_names(cfg),
              "teacher_cache": Path(cfg.teacher_cache).name if cfg.teacher_cache else None,
              "checkpoint": Path(cfg.checkpoint).name if cfg.checkpoint else None,
              "init": Path(cfg.init).name if cfg.init else None}
    report = {"target": name, "target_source": source, "config": config,
              "params_trained": sum(p.numel() for p in head.trainable()), "draft_vocab": len(vocab_ids),
              "vocab_coverage_held_out": coverage, "train_windows": len(windows), "generated_windows": len(gen),
              "steps": res.steps, "loss_first": res.first(10), "loss_last": res.last(10),
              **{key: accepts.get(key) for key in HELD_OUT_SETS}, "app_windows": len(app), "extra_windows": len(extra),
              "self_chat_requests": len(requests), "seconds": round(time.perf_counter() - t0, 1),
              **({"init_sha256": init_sha256, "init_layers": saved} if cfg.init else {})}
    (out_dir / REPORT_FILE).write_text(json.dumps(report, indent=2))
    if ckpt:
        ckpt.remove()
    return report


def onpolicy_file_names(cfg: HeadConfig) -> dict[str, Any]:
    """The on-policy caches a run read, by file name: their full paths are this machine's."""
    return {"onpolicy_cache": Path(cfg.onpolicy_cache).name if cfg.onpolicy_cache else None,
            "onpolicy_extra": [Path(p).name for p in cfg.onpolicy_extra]}


def checkpoint_key(cfg: HeadConfig, target: str, windows: torch.Tensor, states: torch.Tensor) -> dict[str, Any]:
    """What a resumed run must share with the one that wrote the checkpoint: every setting but where files
    live and how often to save, and a fingerprint of the training windows and their teacher states."""
    settings = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()
                if k not in ("checkpoint", "checkpoint_seconds")}
    settings.update(onpolicy_file_names(cfg), teacher_cache=bool(cfg.teacher_cache))
    sample = states[:: max(1, len(states) // 64)].contiguous()  # a fingerprint, not a 2.4 GB hash
    return {**settings, "target": target, "windows": hashlib.sha256(windows.numpy().tobytes()).hexdigest(),
            "states": [*states.shape, str(states.dtype), hashlib.sha256(sample.view(torch.uint8).numpy()).hexdigest()]}
