"""`mobc run`: generate text from an artifact with a decoding policy, streamed to stdout."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import typer

from toolchain.cli.common import EP_OPTION, PROVIDER, THREADS, console, err, load_models
from toolchain.errors import MobcError

DEFAULT_NEW_TOKENS = 128


def run(
    artifact: Path = typer.Argument(..., help="artifact folder written by mobc compile"),
    prompt: str = typer.Option(..., "--prompt", help="text to continue"),
    policy: str = typer.Option("ar", "--policy", help="ar, chain, lever, ahasd (these three take --draft; add "
                               "+lookup to also draft the context's own continuation), ctg, ds2d, llada, ...; "
                               "chain:extend=P drafts past gamma while the draft's probability >= P (0.8), "
                               "chain:rows=N up to N rows per verify call (8), chain+lookup:runs=M drafts what "
                               "followed a context match of M+ tokens with no draft call (3; 0 = off)"),
    draft: Path | None = typer.Option(None, "--draft", help="draft artifact folder (chain, lever, ahasd)"),
    max_new_tokens: int | None = typer.Option(
        None, "--max-new-tokens", min=1, help=f"default: {DEFAULT_NEW_TOKENS}, or what the context has room for"
    ),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy"),
    gamma: int = typer.Option(4, "--gamma", min=1, help="draft tokens per verify call (chain)"),
    chat: bool = typer.Option(False, "--chat", help="wrap the prompt in the model's chat template"),
    seed: int = typer.Option(0, "--seed", min=0),
    adapter: list[str] = typer.Option([], "--adapter", help="packed LoRA adapter name or .npz (repeatable: "
                                      "one per style with --policy ctg)"),
    forecast: Path | None = typer.Option(None, "--forecast", help="ds2d forecast embeddings (default: ARTIFACT/forecast.npz)"),
    provider: str = PROVIDER,
    threads: int | None = THREADS,
    ep_option: list[str] = EP_OPTION,
) -> None:
    """Generate text with a decoding policy and stream it to stdout."""
    from toolchain.runtime.policies import Sampler, make_policy

    if not (math.isfinite(temperature) and temperature >= 0):
        raise MobcError(f"--temperature {temperature}: give 0 for greedy decoding or a positive number to sample")
    target, drafter = load_models(artifact, draft, provider, threads, ep_option)
    target.open_ahead()  # overlaps the tokenizer's load below
    options = {}
    if adapter or policy in ("ctg", "ds2d"):  # adapters bound per request, ctg styles, ds2d forecasts
        options = policy_options(target, policy, adapter, forecast)
    pol = make_policy(policy, target, drafter, gamma=gamma, **options)
    tok = target.tokenizer
    if chat:
        if not target.manifest.model.has_chat_template:
            raise MobcError(f"{target.name} has no chat template; drop --chat")
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    else:
        ids = tok(prompt).input_ids
    max_new_tokens = fit_new_tokens(ids, max_new_tokens, target.context, prompt)
    if not chat:
        if policy == "ctg":  # K styles: printed one after another, not streamed
            return print_styles(pol, ids, prompt, max_new_tokens, Sampler(temperature, seed))
        sys.stdout.write(prompt)
    out: list[int] = []
    shown = ""
    t = time.perf_counter()
    for chunk in pol.generate(ids, max_new_tokens, Sampler(temperature, seed)):
        out.extend(chunk)
        text = tok.decode(out, skip_special_tokens=True)
        sys.stdout.write(text[len(shown):])  # print only the new characters
        sys.stdout.flush()
        shown = text
    wall = time.perf_counter() - t
    s = pol.stats
    if len(out) < max_new_tokens and not (out and out[-1] in target.eos_ids):
        err.print(f"\nstopped after {len(out)} of {max_new_tokens} new tokens: the context of "
                  f"{target.context} tokens is full (compile a larger context for longer outputs)",
                  markup=False, highlight=False)
    decode = max(wall - s.prefill_seconds, 1e-9)
    extra = ""
    if s.accepted:
        extra = f", {s.tokens / max(s.n_target_calls, 1):.2f} tokens per target call"
    err.print(f"\n[dim]{s.tokens} tokens, {s.tokens / decode:.1f} tok/s decode, "
              f"prefill {s.prefill_seconds * 1e3:.0f} ms{extra}[/]")


def fit_new_tokens(ids: list[int], asked: int | None, context: int, prompt: str) -> int:
    """--max-new-tokens checked against the prompt and the artifact's context (default: what fits)."""
    if not ids:
        raise MobcError(f"--prompt {prompt!r} has no tokens: give some text to continue (or use --chat)")
    room = context - len(ids)
    if room < 1:
        raise MobcError(f"the prompt is {len(ids)} tokens and this artifact's context is {context}, which leaves "
                        "no room for new tokens: shorten the prompt or compile the recipe with a larger context")
    if asked is None:
        return min(DEFAULT_NEW_TOKENS, room)
    if asked > room:
        raise MobcError(f"--max-new-tokens {asked}: the prompt ({len(ids)} tokens) leaves room for {room} new "
                        f"tokens in this artifact's context of {context}; ask for at most {room} or compile "
                        "the recipe with a larger context")
    return asked


def policy_options(model: Any, policy: str, adapters: list[str], forecast: Path | None) -> dict[str, Any]:
    """`mobc run` options for LoRA artifacts: ctg gets its styles; other policies get the adapter bound to every row."""
    from toolchain.runtime.adapters import resolve_adapter
    from toolchain.runtime.policies.ctg import bind_adapters
    from toolchain.runtime.policies.ds2d import load_forecast

    loaded = [None if a == "base" else resolve_adapter(model.folder, a) for a in adapters]
    if policy == "ctg":
        if len(loaded) < 2:
            raise MobcError("--policy ctg decodes several styles: pass --adapter once per style (at least 2)")
        return {"styles": loaded}
    if len(loaded) > 1:
        raise MobcError(f"--policy {policy} runs one adapter per request; pass --adapter once (or use --policy ctg)")
    if loaded:
        bind_adapters(model, [a for a in loaded if a is not None], 0 if loaded[0] is not None else None)
    if policy == "ds2d":
        return {"forecast": load_forecast(model.folder, forecast)}
    return {}


def print_styles(pol: Any, ids: list[int], prompt: str, max_new_tokens: int, sampler: Any) -> None:
    import time

    t = time.perf_counter()
    list(pol.generate(ids, max_new_tokens, sampler))
    wall = time.perf_counter() - t
    tok = pol.target.tokenizer
    for style, out in zip(pol.styles, pol.outputs, strict=True):
        console.rule(f"style {style.name if style else 'base'}")
        console.print(prompt + tok.decode(out, skip_special_tokens=True), markup=False, highlight=False)
    s = pol.stats
    err.print(f"[dim]{len(pol.styles)} styles, {s.tokens} tokens in {s.n_target_calls} calls, "
              f"{s.tokens / max(wall - s.prefill_seconds, 1e-9):.1f} tok/s decode[/]")
