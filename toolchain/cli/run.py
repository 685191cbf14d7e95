"""Runtime commands of the `mobc` CLI: run, bench decode, train draft (registered in toolchain/cli/main.py)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from toolchain.errors import MobcError

# tables stay readable when piped to a file or a CI log (rich would wrap them at 80 columns)
console = Console() if sys.stdout.isatty() else Console(width=200)
err = Console(stderr=True)
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print tables (and write JSON).")
train_app = typer.Typer(no_args_is_help=True, help="Train helper models (drafts) for the runtime.")

_PROVIDER = typer.Option("cpu", "--provider", help="onnxruntime provider: cpu or qnn")
_THREADS = typer.Option(None, "--threads", help="intra-op threads (default: onnxruntime's choice)")
_EP_OPT = typer.Option([], "--ep-option", help="provider option key=value (repeatable), e.g. soc_model=57")


def _ep_options(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise MobcError(f"--ep-option {item!r}: write key=value")
        out[key] = value
    return out


def _models(artifact: Path, draft: Path | None, provider: str, threads: int | None, ep: list[str]):
    from toolchain.runtime.model import StepModel

    opts = _ep_options(ep)
    target = StepModel(artifact, provider, threads, opts)
    drafter = StepModel(draft, provider, threads, opts) if draft else None
    return target, drafter


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
    provider: str = _PROVIDER,
    threads: int | None = _THREADS,
    ep_option: list[str] = _EP_OPT,
) -> None:
    """Generate text with a decoding policy and stream it to stdout."""
    from toolchain.runtime.policies import Sampler, make_policy

    target, drafter = _models(artifact, draft, provider, threads, ep_option)
    options = {}
    if adapter or policy in ("ctg", "ds2d"):  # issue 7: adapters bound per request, ctg styles, ds2d forecasts
        from toolchain.cli.adapter import policy_options

        options = policy_options(target, policy, adapter, forecast)
    pol = make_policy(policy, target, drafter, gamma=gamma, **options)
    tok = target.tokenizer
    if chat:
        if not target.manifest["model"].get("has_chat_template"):
            raise MobcError(f"{target.name} has no chat template; drop --chat")
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
    else:
        ids = tok(prompt).input_ids
        if policy == "ctg":  # K styles: printed one after another, not streamed
            from toolchain.cli.adapter import print_styles

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


def _fmt(v, spec: str) -> str:
    return "—" if v is None else format(v, spec)


@bench_app.command("decode")
def bench_decode(
    artifact: Path = typer.Argument(..., help="target artifact folder"),
    draft: Path | None = typer.Option(None, "--draft", help="draft artifact folder"),
    policies: str = typer.Option("ar,chain", "--policies", help="comma-separated policies"),
    prompts: str = typer.Option("humaneval:20", "--prompts", help="humaneval:N or file:PATH"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    gamma: int = typer.Option(4, "--gamma"),
    temperature: float = typer.Option(0.0, "--temperature"),
    device: str = typer.Option("snapdragon-8-gen-3", "--device", help="device profile name or YAML"),
    target_dram: float = typer.Option(0.0, "--target-dram",
                                      help="target DRAM budget: fraction of its weights (0 = all on flash) or bytes"),
    draft_dram: float = typer.Option(1.0, "--draft-dram", help="draft DRAM budget (1 = fully resident)"),
    llamacpp: bool = typer.Option(True, "--llamacpp/--no-llamacpp", help="add a llama.cpp AR row if installed"),
    json_out: Path | None = typer.Option(None, "--json", help="write all numbers and tokens here"),
    provider: str = _PROVIDER,
    threads: int | None = _THREADS,
    ep_option: list[str] = _EP_OPT,
) -> None:
    """Run policies on the same prompts; print CPU speed, acceptance and predicted phone latency."""
    from toolchain.bench import llamacpp as lcpp
    from toolchain.bench.decode import bench_decode as run_bench
    from toolchain.bench.decode import load_prompts

    names = [p.strip() for p in policies.split(",") if p.strip()]
    if any(n != "ar" for n in names) and draft is None:
        raise MobcError(f"--policies {policies}: speculative policies need --draft <artifact folder>")
    texts = load_prompts(prompts)
    target, drafter = _models(artifact, draft, provider, threads, ep_option)
    res = run_bench(target, drafter, names, texts, max_new_tokens, gamma, temperature, device,
                    target_dram, draft_dram, log=lambda m: err.print(f"[dim]{m}[/]"))
    ar_row = next(r for r in res["rows"] if r["policy"] == "ar")
    gguf = lcpp.source_gguf(target.manifest)
    if llamacpp and lcpp.available() and gguf is not None:
        n_new = [d["tokens"] for d in res["details"]["ar"]]
        used = [texts[d["prompt"]] for d in res["details"]["ar"]]
        lc = lcpp.bench(gguf, used, n_new, threads, target.context)
        lc["mobc_ar_over_llamacpp"] = ar_row["tokens_per_s_cpu"] / lc["tokens_per_s_cpu"]
        res["llamacpp"] = lc
    elif llamacpp:
        res["llamacpp"] = None
        why = "llama-cpp-python is not installed (pip install 'mobc\\[llamacpp]')" if not lcpp.available() \
            else "the target was not compiled from a GGUF"
        err.print(f"[yellow]no llama.cpp row:[/] {why}")

    title = (f"decode {res['target']} (draft {res['draft']}, γ={gamma}, T={temperature}) on "
             f"{res['prompts']} prompts; phone = {device}, target DRAM {target_dram:g}, draft DRAM {draft_dram:g}")
    table = Table(title=title)
    for col in ("policy", "tokens", "tok/s CPU", "accepted/verify", "tokens/target call", "target calls/token",
                "phone ms/token", "speedup CPU", "speedup phone", "== ar"):
        table.add_column(col, justify="right" if col != "policy" else "left")
    for r in res["rows"]:
        table.add_row(r["policy"], str(r["tokens"]), _fmt(r["tokens_per_s_cpu"], ".1f"),
                      _fmt(r["accepted_per_verify"], ".2f"), _fmt(r["tokens_per_target_call"], ".2f"),
                      _fmt(r["target_calls_per_token"], ".3f"), _fmt(r["phone_ms_per_token"], ".2f"),
                      _fmt(r["speedup_cpu"], ".2f") + "x", _fmt(r["speedup_phone"], ".2f") + "x",
                      f"{r['identical_to_ar']}/{res['prompts']}")
    lc = res.get("llamacpp")
    if lc:
        table.add_row("llama.cpp ar", str(lc["tokens"]), f"{lc['tokens_per_s_cpu']:.1f}", "—", "—", "—", "—",
                      f"{lc['tokens_per_s_cpu'] / ar_row['tokens_per_s_cpu']:.2f}x", "—", "—")
    console.print(table)
    if lc:
        console.print(f"mobc ar / llama.cpp ar (CPU decode tok/s): {lc['mobc_ar_over_llamacpp']:.2f}")
    if temperature == 0:
        bad = [r["policy"] for r in res["rows"] if r["identical_to_ar"] != res["prompts"]]
        console.print("[green]greedy: every policy reproduces ar token for token on every prompt[/]" if not bad
                      else f"[red]greedy mismatch vs ar: {', '.join(bad)}[/]")
    if json_out:
        json_out.write_text(json.dumps(res, indent=1))
        console.print(f"wrote {json_out}")


@train_app.command("draft")
def train_draft(
    recipe: Path = typer.Argument(..., help="the target's recipe, e.g. recipes/smollm2-135m.yaml"),
    out: Path = typer.Option(..., "--out", help="folder for the draft (Hugging Face save_pretrained layout)"),
    layers: str = typer.Option("6", "--layers", help="k (first k-1 layers + last) or indices like 0-4,29"),
    minutes: float = typer.Option(4.0, "--minutes", help="wall-clock budget of the distillation loop"),
    seq_len: int = typer.Option(256, "--seq-len"),
    batch: int = typer.Option(4, "--batch"),
    lr: float = typer.Option(2e-4, "--lr"),
    corpus_tokens: int = typer.Option(65_536, "--corpus-tokens", help="most stdlib tokens the teacher pass covers"),
    generated: int = typer.Option(0, "--generated-windows",
                                  help="also distill on this many windows of the target's own greedy continuations "
                                       "of stdlib prompts (on-policy data; what speculative decoding is judged on)"),
    init: Path | None = typer.Option(None, "--init", help="continue distilling a draft this command saved "
                                                           "(--layers is then taken from it)"),
    recipe_out: Path | None = typer.Option(None, "--recipe-out", help="also write a recipe compiling the draft"),
) -> None:
    """Derive a draft from the target (kept layers + shared embeddings/lm_head) and distill it on stdlib source."""
    from toolchain.compile.recipe import load_recipe
    from toolchain.train.draft import DistillConfig
    from toolchain.train.draft import train_draft as run_train

    cfg = DistillConfig(seconds=minutes * 60, seq_len=seq_len, batch=batch, lr=lr, corpus_tokens=corpus_tokens,
                        generated_windows=generated, init=str(init) if init else None)
    report = run_train(recipe, out, layers, cfg, log=lambda m: err.print(f"[dim]{m}[/]"))
    console.print(f"[bold green]draft[/] {out}: {report['params'] / 1e6:.1f}M params, layers {report['config']['layers']}, "
                  f"held-out top-1 agreement with the target: lens {report['agreement_lens']:.3f}, distilled "
                  f"{report['agreement_distilled']:.3f} after {report['steps']} steps (kept {report['kept']}; "
                  f"{report['loop_seconds']:.0f} s teacher pass + distillation, {report['total_seconds']:.0f} s total)")
    if recipe_out:
        target = load_recipe(recipe)
        graphs = "\n".join(f"  {n}: {{width: {g.width}, context: {g.context}}}" for n, g in target.graphs.items()
                           if n in ("decode", "prefill"))
        rel = Path(__import__("os").path.relpath(out.resolve(), recipe_out.resolve().parent))
        recipe_out.write_text(
            f"# Draft for {target.name}, made by `mobc train draft` (layers {report['config']['layers']}).\n"
            f"name: {target.name}-draft\nsource: {{path: {rel}}}\ngraphs:\n{graphs}\n"
            f"tolerance: {{max_abs: {target.tolerance.max_abs:g}}}\nverify: {{greedy_tokens: 16}}\n")
        console.print(f"wrote {recipe_out}; compile it with mobc compile {recipe_out}")
