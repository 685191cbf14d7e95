"""`mobc run`: generate text from an artifact with a decoding policy, streamed to stdout."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import typer

from toolchain.cli.common import EP_OPTION, PROVIDER, THREADS, console, err, load_models
from toolchain.errors import MobcError


def run(
    artifact: Path = typer.Argument(..., help="artifact folder written by mobc compile"),
    prompt: str = typer.Option(..., "--prompt", help="text to continue"),
    policy: str = typer.Option("ar", "--policy", help="ar or chain"),
    draft: Path | None = typer.Option(None, "--draft", help="draft artifact folder (policy chain)"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy"),
    gamma: int = typer.Option(4, "--gamma", help="draft tokens per verify call (chain)"),
    chat: bool = typer.Option(False, "--chat", help="wrap the prompt in the model's chat template"),
    seed: int = typer.Option(0, "--seed"),
    adapter: list[str] = typer.Option([], "--adapter", help="packed LoRA adapter name or .npz (repeatable: "
                                      "one per style with --policy ctg)"),
    forecast: Path | None = typer.Option(None, "--forecast", help="ds2d forecast embeddings (default: ARTIFACT/forecast.npz)"),
    provider: str = PROVIDER,
    threads: int | None = THREADS,
    ep_option: list[str] = EP_OPTION,
) -> None:
    """Generate text with a decoding policy and stream it to stdout."""
    from toolchain.runtime.policies import Sampler, make_policy

    target, drafter = load_models(artifact, draft, provider, threads, ep_option)
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
    decode = max(wall - s.prefill_seconds, 1e-9)
    extra = ""
    if s.accepted:
        extra = f", {s.tokens / max(s.n_target_calls, 1):.2f} tokens per target call"
    err.print(f"\n[dim]{s.tokens} tokens, {s.tokens / decode:.1f} tok/s decode, "
              f"prefill {s.prefill_seconds * 1e3:.0f} ms{extra}[/]")


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
