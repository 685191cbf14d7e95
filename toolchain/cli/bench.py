"""`mobc bench decode|lever|diffusion|ctg|ds2d|compile|startup|train-step|head`: each policy family against its baseline, as tables."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from toolchain.cli.common import (
    EP_OPTION,
    PROVIDER,
    THREADS,
    attach_draft,
    console,
    err,
    fmt,
    load_models,
    log,
    open_model,
    print_rows,
    write_json,
)
from toolchain.errors import MobcError

PROMPTS_HELP = "humaneval:N, chat:N (the shipped chat prompts) or file:PATH; join sets with +"

app = typer.Typer(no_args_is_help=True, help="Benchmarks that print tables (and write JSON).")


@app.command("decode")
def bench_decode(
    artifact: Path = typer.Argument(..., help="target artifact folder"),
    draft: list[Path] = typer.Option([], "--draft", help="draft artifact folder; repeat it for rows of the same "
                                     "policies with another draft (<policy>@<folder>), in the same run"),
    policies: str = typer.Option("ar,chain", "--policies", help="comma-separated policies (+lookup: add the "
                                 "context's own continuation to the draft's proposals; chain:extend=P: draft "
                                 "past gamma while the draft's probability >= P, default 0.8; chain:rows=N: such "
                                 "a round verifies up to N rows, default 8; chain+lookup:runs=M: a context match "
                                 "of M+ tokens drafts what followed it with no draft call, default 3, 0 = off)"),
    prompts: str = typer.Option("humaneval:20", "--prompts", help=PROMPTS_HELP),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    gamma: int = typer.Option(4, "--gamma"),
    temperature: float = typer.Option(0.0, "--temperature"),
    device: str = typer.Option("snapdragon-8-gen-3", "--device", help="device profile name or YAML"),
    target_dram: float = typer.Option(0.0, "--target-dram",
                                      help="target DRAM budget: fraction of its weights (0 = all on flash) or bytes"),
    draft_dram: float = typer.Option(1.0, "--draft-dram", help="draft DRAM budget (1 = fully resident)"),
    llamacpp: bool = typer.Option(True, "--llamacpp/--no-llamacpp", help="add a llama.cpp AR row if installed"),
    baseline: list[Path] = typer.Option([], "--baseline",
                                        help="another artifact of the model (e.g. the float one) for an ar row "
                                             "beside the target's, same prompts, interleaved (repeatable)"),
    genai: Path | None = typer.Option(None, "--genai", help="an onnxruntime-genai model folder of the same model "
                                      "(e.g. its builder's int4 CPU model) for an ar row, same prompt ids"),
    json_out: Path | None = typer.Option(None, "--json", help="write all numbers and tokens here"),
    provider: str = PROVIDER,
    threads: int | None = THREADS,
    ep_option: list[str] = EP_OPTION,
) -> None:
    """Run policies on the same prompts; print CPU speed, acceptance and predicted phone latency."""
    from toolchain.bench import llamacpp as lcpp
    from toolchain.bench.decode import bench_decode as run_bench
    from toolchain.bench.prompts import encode, load_prompts

    names = [p.strip() for p in policies.split(",") if p.strip()]
    if any(n != "ar" for n in names) and not draft:
        raise MobcError(f"--policies {policies}: speculative policies need --draft <artifact folder>")
    texts = load_prompts(prompts)
    target, drafter = load_models(artifact, draft[0] if draft else None, provider, threads, ep_option)
    others = [attach_draft(target, d, provider, threads, ep_option) for d in draft[1:]]
    baselines = [load_models(b, None, provider, threads, ep_option)[0] for b in baseline]
    res = run_bench(target, drafter, names, texts, max_new_tokens, gamma, temperature, device,
                    target_dram, draft_dram, log=log, baselines=baselines, other_drafts=others)
    ar_row = next(r for r in res["rows"] if r["policy"] == "ar")
    gguf = lcpp.source_gguf(target.manifest)
    if llamacpp and lcpp.available() and gguf is not None:
        n_new = [d["tokens"] for d in res["details"]["ar"]]
        used = [encode(target.tokenizer, texts[d["prompt"]]) for d in res["details"]["ar"]]
        lc = lcpp.bench(gguf, used, n_new, threads, target.context)
        lc["mobc_ar_over_llamacpp"] = ar_row["tokens_per_s_cpu"] / lc["tokens_per_s_cpu"]
        res["llamacpp"] = lc
    elif llamacpp:
        res["llamacpp"] = None
        why = "llama-cpp-python is not installed (pip install 'mobc\\[llamacpp]')" if not lcpp.available() \
            else "the target was not compiled from a GGUF"
        err.print(f"[yellow]no llama.cpp row:[/] {why}")
    if genai is not None:
        from toolchain.bench import genai_peer

        if not genai_peer.available():
            raise MobcError("--genai needs onnxruntime-genai: pip install onnxruntime-genai")
        details = res["details"]["ar"]
        ids = [encode(target.tokenizer, texts[d["prompt"]]) for d in details]
        res["genai"] = genai_peer.bench(genai, ids, [d["tokens"] for d in details], threads,
                                        [d["output"] for d in details])

    title = (f"decode {res['target']} (draft {res['draft']}, γ={gamma}, T={temperature}) on "
             f"{res['prompts']} prompts; phone = {device}, target DRAM {target_dram:g}, draft DRAM {draft_dram:g}")
    table = Table(title=title)
    for col in ("policy", "tokens", "tok/s CPU", "prompt ms", "accepted/verify", "tokens/target call",
                "target calls/token", "phone ms/token", "speedup CPU", "speedup phone", "== ar"):
        table.add_column(col, justify="right" if col != "policy" else "left")
    for r in res["rows"]:
        table.add_row(r["policy"], str(r["tokens"]), fmt(r["tokens_per_s_cpu"], ".1f"),
                      fmt(r["prompt_ms_median"], ".0f"), fmt(r["accepted_per_verify"], ".2f"), fmt(r["tokens_per_target_call"], ".2f"),
                      fmt(r["target_calls_per_token"], ".3f"), fmt(r["phone_ms_per_token"], ".2f"),
                      fmt(r["speedup_cpu"], ".2f") + "x", fmt(r["speedup_phone"], ".2f") + "x",
                      f"{r['identical_to_ar']}/{res['prompts']}" + (f" +{r['ties_with_ar']} tie" if r["ties_with_ar"] else ""))
    lc = res.get("llamacpp")
    if lc:
        table.add_row("llama.cpp ar", str(lc["tokens"]), f"{lc['tokens_per_s_cpu']:.1f}",
                      fmt(lc.get("prompt_ms_median"), ".0f"), "—", "—", "—", "—",
                      f"{lc['tokens_per_s_cpu'] / ar_row['tokens_per_s_cpu']:.2f}x", "—", "—")
    ga = res.get("genai")
    if ga:
        prompt_ms = 1e3 * ga["prompt_seconds_median"] if ga.get("prompt_seconds_median") else None
        table.add_row("onnxruntime-genai ar", str(ga["tokens"]), f"{ga['tokens_per_s_cpu']:.1f}",
                      fmt(prompt_ms, ".0f"), "—", "—", "—", "—",
                      f"{ga['tokens_per_s_cpu'] / ar_row['tokens_per_s_cpu']:.2f}x", "—",
                      f"{ga['identical_to_ar']}/{ga['prompts']}")
    console.print(table)
    print_rows("measured decode-phase calls on this CPU (a draft's cost: its ms/call against a target decode)",
               res["cpu_calls"], [("model", "model", ""), ("family", "family", ""), ("calls", "calls", "d"),
                                  ("ms/call", "ms_per_call", ".2f"), ("vs a target decode", "vs_target_decode", ".3fx")])
    if lc:
        console.print(f"mobc ar / llama.cpp ar (CPU decode tok/s): {lc['mobc_ar_over_llamacpp']:.2f}")
    if temperature == 0:
        print_greedy_verdict([(r["policy"], r["identical_to_ar"], r["ties_with_ar"], res["prompts"])
                              for r in res["rows"]])
    write_json(json_out, res)


def print_greedy_verdict(rows: list[tuple[str, int, int, int]]) -> None:
    """A greedy bench's closing line from (policy, outputs equal to ar's, float ties, prompts) per row."""
    from toolchain.bench.decode import TIE_LOGITS

    bad = [name for name, same, ties, n in rows if same + ties != n]
    ties = sum(t for _, _, t, _ in rows)
    if bad:
        console.print(f"[red]greedy mismatch vs ar: {', '.join(bad)}[/]")
    elif ties:
        console.print(f"[yellow]greedy: every policy reproduces ar token for token, except {ties} output(s) that "
                      f"left it where the target's two best logits were within {TIE_LOGITS:g} (a float tie the "
                      "graphs of different widths round apart; the JSON's `divergence` has each)[/]")
    else:
        console.print("[green]greedy: every policy reproduces ar token for token on every prompt[/]")


@app.command("lever")
def bench_lever(
    artifact: Path = typer.Argument(..., help="target artifact (tree widths, split_lm_head, split_layers)"),
    draft: Path = typer.Option(..., "--draft", help="draft artifact folder"),
    policies: str = typer.Option("ar,chain,lever,lever+prune,ahasd", "--policies"),
    prompts: str = typer.Option("humaneval:20", "--prompts", help=PROMPTS_HELP),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    gamma: int = typer.Option(4, "--gamma", help="draft tokens per chain/ahasd verify"),
    device: str = typer.Option("snapdragon-8-gen-3", "--device"),
    target_dram: float = typer.Option(0.0, "--target-dram", help="fraction of target weights resident (0 = Flash-AR)"),
    draft_dram: float = typer.Option(1.0, "--draft-dram"),
    ablation: bool = typer.Option(True, "--ablation/--no-ablation"),
    sweep: str = typer.Option("0,0.5,1", "--sweep", help="target DRAM budgets to sweep ('' = none)"),
    plot: Path = typer.Option(Path("build/lever/tokens_vs_tree.png"), "--plot"),
    json_out: Path | None = typer.Option(None, "--json"),
    provider: str = PROVIDER,
    threads: int | None = THREADS,
    ep_option: list[str] = EP_OPTION,
) -> None:
    """ar, chain, lever (+prune) and ahasd on the same prompts: decode, ablation and DRAM-sweep tables and a PNG."""
    from toolchain.bench.lever import LeverBench
    from toolchain.bench.prompts import prompt_ids

    target, drafter = load_models(artifact, draft, provider, threads, ep_option)
    names = [p.strip() for p in policies.split(",") if p.strip()]
    if "lever+prune" in names and not (target.folder / "predictor.json").is_file():
        err.print(f"[yellow]no {target.folder / 'predictor.json'}: dropping lever+prune (run mobc train predictor)[/]")
        names = [n for n in names if "prune" not in n]
    ids = [x for x in prompt_ids(target.tokenizer, prompts, 0) if len(x) + max_new_tokens + 40 < target.context]
    if not ids:
        raise MobcError(f"no prompt of {prompts!r} leaves room for {max_new_tokens} new tokens in {target.name}'s "
                        f"context of {target.context}: pass shorter prompts or a smaller --max-new-tokens")
    b = LeverBench(target, drafter, ids, max_new_tokens, gamma, device, target_dram, draft_dram,
                   log=log)
    main = b.table(["ar", *[n for n in names if n != "ar"]])
    res: dict = {"target": target.name, "draft": drafter.name, "device": device, "target_dram": target_dram,
                 "draft_dram": draft_dram, "prompts": len(ids), "max_new_tokens": max_new_tokens, "decode": main}
    cols = [("policy", "policy", ""), ("tok/s CPU", "tokens_per_s_cpu", ".1f"),
            ("tokens/cycle", "tokens_per_cycle", ".2f"), ("phone ms/tok", "phone_ms_per_token", ".2f"),
            ("speedup CPU", "speedup_cpu", ".2fx"), ("phone vs ar", "speedup_phone", ".2fx"),
            ("phone vs chain", "speedup_phone_vs_chain", ".2fx"), ("tree nodes", "mean_tree_nodes", ".1f"),
            ("lm_head rows", "lm_head_rows", ""), ("overlap", "overlap", ".2f"), ("== ar", "identical_to_ar", "d")]
    print_rows(f"decode {target.name} + {drafter.name}, {len(ids)} prompts, {device}, target DRAM {target_dram:g}",
           main, cols)
    lever_name = "lever"  # the sweep re-runs the main lever policy (its decisions read the cost model)
    if ablation and "lever" in names:
        abl = ["ar", "chain", "lever+full"] + (["lever+prune+full", "lever+prune+path"] if "lever+prune" in names
                                               else ["lever+path"])
        rows = b.table(abl)
        labels = {"lever+full": "gain/cost trees only", "lever+prune+full": "+ predictor pruning",
                  "lever+prune+path": "+ path-only logits", "lever+path": "+ path-only logits (no predictor)"}
        for r in rows:
            r["variant"], r["policy"] = r["policy"], labels.get(r["policy"], r["policy"])
        res["ablation"] = rows
        print_rows("ablation", rows, [*cols[:7], ("lm_head GFLOP saved", "lm_head_gflops_saved", ".2f"),
                                  ("pruned nodes", "pruned_nodes", ""), ("verify GFLOP saved", "verify_gflops_saved", ".1f"),
                                  ("== ar", "identical_to_ar", "d")])
    budgets = [float(x) for x in sweep.split(",") if x.strip()]
    if budgets and "lever" in names:
        rows = b.sweep(budgets, lever_name)
        res["dram_sweep"] = rows
        print_rows(f"DRAM sweep (target layers resident), {lever_name}", rows,
               [("target DRAM", "target_dram", ".0%"), ("ar ms/tok", "ar_ms", ".2f"), ("chain ms/tok", "chain_ms", ".2f"),
                (f"{lever_name} ms/tok", f"{lever_name}_ms", ".2f"), ("ahasd ms/tok", "ahasd_ms", ".2f"),
                ("lever vs ar", "lever_vs_ar", ".2fx"), ("lever vs chain", "lever_vs_chain", ".2fx"),
                ("== ar", "lever_identical", "d")])
    if "lever" in names:
        console.print(f"plot: {b.plot(lever_name, plot)}")
    print_greedy_verdict([(r["policy"], r["identical_to_ar"], r["ties_with_ar"], r["prompts"]) for r in main])
    write_json(json_out, res)


@app.command("diffusion")
def bench_diffusion(
    artifact: Path = typer.Argument(..., help="artifact compiled from a diffusion LM"),
    configs: str = typer.Option("dllm,fastdllm,llada-off,llada,llada+rev", "--policies",
                                help="comma-separated configurations (toolchain/bench/diffusion.py)"),
    prompts: str = typer.Option("humaneval:4", "--prompts", help="humaneval:N or file:PATH"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    block: int = typer.Option(0, "--block", help="block size (0 = the graph width)"),
    steps: int = typer.Option(8, "--steps", help="LLaDA steps per block"),
    threshold: float = typer.Option(0.9, "--threshold", help="Fast-dLLM confidence threshold"),
    device: str = typer.Option("snapdragon-8-gen-3", "--device"),
    dram: float = typer.Option(1.0, "--dram", help="DRAM budget for the latency column (fraction or bytes)"),
    prefetch_budgets: str = typer.Option("1.0,0.5,0.25", "--prefetch-budgets", help="DRAM budgets for the prefetch table"),
    threads: int | None = typer.Option(None, "--threads"),
    json_out: Path | None = typer.Option(None, "--json"),
) -> None:
    """Compare diffusion decoding policies: calls/token, CPU tok/s, phone latency, agreement; prefetch."""
    from toolchain.bench.diffusion import bench, prefetch_section
    from toolchain.bench.prompts import load_prompts

    model = open_model(artifact, threads)
    names = [c.strip() for c in configs.split(",") if c.strip()]
    res = bench(model, names, load_prompts(prompts), max_new_tokens, block, steps, threshold, device, dram,
                log=log)
    table = Table(title=f"diffusion decode {res['artifact']}: width {res['width']}, block {res['block']}, "
                        f"S={steps}, threshold {threshold}, {res['prompts']} prompts x {max_new_tokens} tokens; "
                        f"phone = {device}, DRAM {dram:g}")
    for col in ("policy", "tokens", "calls/token", "tok/s CPU", "phone ms/token", "agree w/ dllm", "== rule base",
                "spec kept/decided", "revision overlap"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in res["rows"]:
        spec = f"{r['spec_kept']}/{r['spec_decided']}" if "spec_decided" in r else "—"
        rev = (f"{r['revision_overlap']:.0%} ({r['revised']}/{r['provisional']} re-masked)"
               if r.get("revision_overlap") is not None else "—")
        table.add_row(r["policy"], str(r["tokens"]), fmt(r["calls_per_token"], ".3f"),
                      fmt(r["tokens_per_s_cpu"], ".1f"), fmt(r["phone_ms_per_token"], ".2f"),
                      fmt(r["agreement_with_dllm"], ".1%"), r["equals_rule_baseline"] or "—", spec, rev)
    console.print(table)
    pre = prefetch_section(model, device, [float(b) for b in prefetch_budgets.split(",")])
    res["prefetch"] = pre
    t2 = Table(title=f"weight prefetch, {pre['parts']} parts ({'split artifact' if pre['split_artifact'] else 'modelled split'})"
                     f": predicted phone ms per diffusion call on {device}")
    for col in ("DRAM budget", "streamed parts (serial/prefetch)", "serial ms", "prefetch ms", "speedup"):
        t2.add_column(col, justify="right")
    for p in pre["predicted"]:
        t2.add_row(f"{p['dram_budget']:g}", f"{p['streamed_parts_serial']}/{p['streamed_parts_prefetch']}",
                   f"{p['serial_ms']:.2f}", f"{p['prefetch_ms']:.2f}", fmt(p["speedup"], ".2f") + "x")
    console.print(t2)
    if pre.get("measured_cpu"):
        t3 = Table(title="part streaming on this CPU (resident parts = the DRAM budget)")
        for col in ("resident parts", "prefetch", "ms/call", "load ms/call", "wait ms/call"):
            t3.add_column(col, justify="right")
        for m in pre["measured_cpu"]:
            t3.add_row(str(m["resident_parts"]), str(m["prefetch"]), f"{m['ms_per_call']:.1f}",
                       f"{m['load_ms_per_call']:.1f}", f"{m['wait_ms_per_call']:.1f}")
        console.print(t3)
    bad = [r["policy"] for r in res["rows"] if r["equals_rule_baseline"] not in (None, f"{res['prompts']}/{res['prompts']}")]
    if bad:
        console.print(f"[red]speculation off differs from its baseline: {', '.join(bad)}[/]")
    write_json(json_out, res)


@app.command("ctg")
def bench_ctg_cmd(
    artifact: Path = typer.Argument(..., help="artifact compiled with lora_inputs (slots >= K) and a width >= K graph"),
    adapter: list[str] = typer.Option([], "--adapter", help="packed adapter per style (repeatable; 'base' = none)"),
    k: int = typer.Option(8, "-k", help="styles (cycles through --adapter when fewer are given)"),
    prompts: str = typer.Option("humaneval:4", "--prompts", help="humaneval:N or file:PATH"),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="per style"),
    threads: int | None = typer.Option(None, "--threads"),
    json_out: Path | None = typer.Option(None, "--json"),
) -> None:
    """K styles decoded concurrently (one call per step) vs K sequential runs: tokens/s and ratio."""
    from toolchain.bench.lora import bench_ctg
    from toolchain.bench.prompts import load_prompts
    from toolchain.runtime.adapters import resolve_adapter

    model = open_model(artifact, threads)
    pool = [None if a == "base" else resolve_adapter(artifact, a) for a in adapter] or [None]
    styles = [pool[i % len(pool)] for i in range(k)]
    res = bench_ctg(model, styles, load_prompts(prompts), max_new_tokens, log=log)
    table = Table(title=f"ctg {res['artifact']}: K={k} styles ({', '.join(res['styles'])}) on {res['prompts']} prompts")
    for col in ("mode", "tokens", "decode tok/s", "calls", "ratio (decode)", "ratio (end to end)", "phone ms/token",
                "== sequential"):
        table.add_column(col, justify="right" if col != "mode" else "left")
    rows = res["rows"]
    table.add_row(f"{k} sequential", str(sum(r["seq_tokens"] for r in rows)), f"{res['sequential_tokens_per_s']:.1f}",
                  str(sum(r["seq_tokens"] for r in rows)), "1.00x", "1.00x",
                  f"{res['phone_ms_per_token_sequential']:.2f}", "—")
    table.add_row(f"ctg K={k}", str(sum(r["ctg_tokens"] for r in rows)), f"{res['ctg_tokens_per_s']:.1f}",
                  str(sum(r["ctg_calls"] for r in rows)), f"{res['ratio_decode']:.2f}x", f"{res['ratio_end_to_end']:.2f}x",
                  f"{res['phone_ms_per_token_ctg']:.2f}", f"{res['identical_styles']}/{res['total_styles']}")
    console.print(table)
    write_json(json_out, res)


@app.command("ds2d")
def bench_ds2d_cmd(
    artifact: Path = typer.Argument(..., help="artifact compiled with forecast_inputs, trained forecast.npz"),
    prompts: str = typer.Option("humaneval:8", "--prompts", help="humaneval:N or file:PATH"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    forecast: Path | None = typer.Option(None, "--forecast", help="default: ARTIFACT/forecast.npz"),
    depth: int | None = typer.Option(None, "--depth", help="drafts per round (default m)"),
    threads: int | None = typer.Option(None, "--threads"),
    json_out: Path | None = typer.Option(None, "--json"),
) -> None:
    """DS2D vs greedy AR: acceptance length, tokens per call, decode speed, token-for-token equality."""
    from toolchain.bench.lora import bench_ds2d
    from toolchain.bench.prompts import load_prompts
    from toolchain.runtime.policies.ds2d import load_forecast

    model = open_model(artifact, threads)
    res = bench_ds2d(model, load_forecast(artifact, forecast), load_prompts(prompts), max_new_tokens, depth, log=log)
    table = Table(title=f"ds2d {res['artifact']} (m={res['m']}) on {res['prompts']} prompts, greedy")
    for col in ("policy", "decode tok/s", "accepted/round", "tokens/call", "speedup CPU", "phone ms/token", "== ar"):
        table.add_column(col, justify="right" if col != "policy" else "left")
    table.add_row("ar", f"{res['ar_tokens_per_s']:.1f}", "—", "1.00", "1.00x", f"{res['phone_ms_per_token_ar']:.2f}", "—")
    table.add_row("ds2d", f"{res['ds2d_tokens_per_s']:.1f}", f"{res['accepted_per_round']:.2f}",
                  f"{res['tokens_per_call']:.2f}", f"{res['speedup']:.2f}x", f"{res['phone_ms_per_token_ds2d']:.2f}",
                  f"{res['identical']}/{res['prompts']}")
    console.print(table)
    write_json(json_out, res)


@app.command("compile")
def bench_compile(
    sizes: str = typer.Option("0.1b,0.5b,1.2b", "--sizes", help="comma-separated shapes: 0.1b,0.5b,1.2b,3b,8b,8b-8l (8 of the 8B's layers)"),
    variants: str = typer.Option("npu", "--variants", help="npu (the NPU pass list) and/or w4a16"),
    work: Path = typer.Option(Path("build/bench-compile"), "--work", help="checkpoints, recipes, logs, artifacts"),
    context: int = typer.Option(1024, "--context", help="CL of the decode and prefill graphs"),
    prefill: int = typer.Option(128, "--prefill", help="width of the prefill graph"),
    keep: bool = typer.Option(False, "--keep-artifacts", help="keep each compiled artifact (default: delete after measuring)"),
    json_out: Path | None = typer.Option(None, "--json"),
) -> None:
    """Compile random-weight Llamas of growing size; print wall time, peak RSS and peak/weights per size."""
    from toolchain.bench.checkpoints import SHAPES
    from toolchain.bench.compile_scale import bench, chart

    names = [s.strip() for s in sizes.split(",") if s.strip()]
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        err(f"--sizes: unknown {unknown}; known: {', '.join(SHAPES)}")
        raise typer.Exit(2)
    kinds = [v.strip() for v in variants.split(",") if v.strip()]
    if not kinds or any(v not in ("npu", "w4a16") for v in kinds):
        err(f"--variants: {variants!r}; give npu and/or w4a16")
        raise typer.Exit(2)
    work.mkdir(parents=True, exist_ok=True)
    rows = bench(names, kinds, work, context, prefill, keep=keep, log=log)
    table = Table(title=f"compile cost vs model size (random-weight Llamas, decode N=1 + prefill N={prefill}, CL={context})")
    for col in ("size", "variant", "params", "fp32 weights", "wall s", "peak RSS", "peak / weights",
                "max |logits diff|", "greedy", "peak came after", "exit"):
        table.add_column(col, justify="left" if col in ("size", "variant") else "right")
    for r in rows:
        table.add_row(r["size"], r["variant"], f"{r['parameters'] / 1e9:.2f}B", f"{r['fp32_weight_bytes'] / 1e9:.2f} GB",
                      f"{r['seconds']:.0f}", f"{r['peak_rss_bytes'] / 1e9:.2f} GB", f"{r['peak_over_weights']:.2f}x",
                      fmt(r.get("logits_max_abs"), ".2e"), {True: "identical", False: "DIFFERS"}.get(r.get("greedy_identical"), "—"),
                      r["peak_after_stage"], str(r["exit_code"]))
    console.print(table)
    png = chart(rows, work / "compile_scale.png")
    console.print(f"chart: {png}")
    write_json(json_out, {"rows": rows})
    if any(r["exit_code"] for r in rows):
        raise typer.Exit(1)


@app.command("startup")
def bench_startup(
    artifact: Path = typer.Argument(..., help="artifact folder written by mobc compile"),
    prompt: str = typer.Option("def fibonacci(n):", "--prompt"),
    rounds: int = typer.Option(7, "--rounds", min=1, help="interleaved rounds (one run per mode each)"),
    json_out: Path | None = typer.Option(None, "--json"),
) -> None:
    """What the integrity check adds to a `mobc run` start: unchecked vs cold vs warm cache, interleaved;
    first token and exit times, measured from outside the process."""
    from toolchain.artifact.manifest import Manifest
    from toolchain.bench.startup import MODES, measure

    Manifest.load(artifact)  # a damaged or missing artifact is one clear error, before any timing
    res = measure(artifact, prompt, rounds, progress=log)
    table = Table(title=f"mobc run start ({artifact}, --max-new-tokens 1), medians of {rounds} interleaved rounds")
    for col in ("integrity check", "first token s", "wall s", "min-max s", "vs unchecked", "added", "peak RSS"):
        table.add_column(col, justify="left" if col == "integrity check" else "right")
    for mode in MODES:
        r = res["modes"][mode]
        table.add_row(mode, f"{r['first_token_median_s']:.2f} (max {r['first_token_max_s']:.2f})", f"{r['median_s']:.2f}", f"{r['min_s']:.2f}-{r['max_s']:.2f}", f"{r['ratio']:.3f}x",
                      f"{r['added_s'] * 1e3:+.0f} ms", f"{r['peak_rss_bytes'] / 1e9:.2f} GB")
    console.print(table)
    write_json(json_out, res)


@app.command("train-step")
def bench_train_step(
    recipe: Path = typer.Argument(Path("recipes/smollm2-135m.yaml"), help="the target's recipe"),
    windows: Path = typer.Option(Path("assets/heads/smollm2-135m/onpolicy-1600.pt"), "--windows",
                                 help="on-policy cache whose answer windows the steps train on"),
    n_windows: int = typer.Option(32, "--n-windows", min=4, help="answer windows (their teacher states are computed once)"),
    rounds: int = typer.Option(3, "--rounds", min=1, help="interleaved rounds (one block per variant each)"),
    steps: int = typer.Option(20, "--steps", min=1, help="training steps per block"),
    json_out: Path | None = typer.Option(None, "--json"),
) -> None:
    """The draft head's training step (`mobc train draft --kind head`): fp32 vs bf16 matmuls and glibc's default
    vs the training loop's pinned malloc thresholds, in alternating blocks in one process."""
    from toolchain.bench.train_step import measure
    from toolchain.train.head import HeadConfig, answer_windows, load_target

    if not recipe.is_file():
        raise MobcError(f"{recipe}: no such recipe; give the target's recipe, e.g. recipes/smollm2-135m.yaml")
    w = answer_windows(windows, "--windows")[:n_windows]
    target, tok, name, _ = load_target(recipe)
    cfg = HeadConfig()
    log(f"{name}: {len(w)} answer windows of {w.shape[1]} tokens from {windows}, batch {cfg.batch}, "
        f"unroll {cfg.unroll}; {rounds} rounds of {steps} steps per variant")
    res = measure(target, tok, w, rounds, steps, cfg, progress=log)
    if not res["glibc"]:
        console.print("[yellow]no glibc mallopt here: the malloc rows ran with this C library's own setting[/]")
    print_rows(f"head training step ({name}, batch {cfg.batch} x {w.shape[1]} tokens, unroll {cfg.unroll}), "
               f"medians of {rounds} interleaved blocks of {steps} steps",
               [{**r, "mode": f"{r['precision']} malloc {r['malloc']}"} for r in res["rows"]],
               [("mode", "mode", ""), ("s per step", "median_s", ".3f"), ("min", "min_s", ".3f"),
                ("max", "max_s", ".3f"), ("page faults per step", "faults_per_step", ",.0f"),
                ("steps/min vs fp32 default", "steps_per_minute_vs_base", ".2fx")])
    console.print(f"peak RSS {res['peak_rss_bytes'] / 1e9:.2f} GB")
    write_json(json_out, res)


@app.command("head")
def bench_head(
    heads: list[Path] = typer.Argument(..., help="trained heads: head.safetensors files or the folders "
                                       "`mobc train draft --kind head` wrote (the first is the ratios' base)"),
    recipe: Path = typer.Option(Path("recipes/smollm2-135m.yaml"), "--recipe", help="the target's recipe"),
    prompts: str = typer.Option("humaneval:20+chat:24", "--prompts", help=PROMPTS_HELP),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1),
    gamma: int = typer.Option(4, "--gamma", min=1),
    windows: list[str] = typer.Option([], "--windows", help="FILE[:N]: also N (default 64) evenly spaced answer "
                                      "windows of an on-policy cache a training read, a set of its own (how much "
                                      "the heads over-fit; repeatable)"),
    json_out: Path | None = typer.Option(None, "--json"),
) -> None:
    """Draft heads side by side on the target's greedy answers, per prompt set, in minutes and with no compile:
    tokens per target call teacher-forced from every answer position, and as a chain run and a chain+lookup
    run would reach them (each answer replayed with the runtime's own rules)."""
    from toolchain.bench.head import CONFIDENCE, confidence_cells, head_labels, measure, window_answers
    from toolchain.bench.prompts import load_prompts
    from toolchain.compile.head import load_head
    from toolchain.train.head import head_weights, load_target

    if not recipe.is_file():
        raise MobcError(f"{recipe}: no such recipe; give the target's recipe with --recipe")
    files = [head_weights(h) for h in heads]
    if len(set(files)) < len(files):
        raise MobcError("the same head is given twice; give each head once")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise MobcError(f"no head at {', '.join(missing)}: give head.safetensors files or the folders "
                        "`mobc train draft --kind head` wrote")
    load_prompts(prompts)  # a bad --prompts or --windows is refused before the target loads
    window_sets = dict(window_answers(w) for w in windows)
    if len(window_sets) < len(windows):
        raise MobcError("--windows: the same cache is given twice; give each file once")
    target, tok, name, _ = load_target(recipe)
    labels = head_labels(heads)  # short names: the table's head column is narrow
    models = {label: load_head(target, f) for label, f in zip(labels, files, strict=True)}
    log(f"{name}: {len(models)} heads, gamma {gamma}, answers of up to {max_new_tokens} tokens to {prompts}")
    res = measure(target, tok, models, prompts, max_new_tokens, gamma, progress=log, windows=window_sets)
    rows = [{**r, **{f"d{k + 1}": a for k, a in enumerate(r["accept_at_depth"])}} for r in res["rows"]]
    print_rows(f"draft heads on {name}'s greedy answers ({res['answers']} prompts, up to {max_new_tokens} tokens), "
               f"teacher-forced chain γ={gamma}",
               rows, [("set", "set", ""), ("head", "head", ""), ("tokens/target call", "tokens_per_call", ".3f"),
                      *[(f"≥{k + 1} accepted", f"d{k + 1}", ".3f") for k in range(gamma)],
                      ("chains", "rounds", "d"), ("answer tokens in vocab", "vocab_coverage", ".3f"),
                      ("vs first head", "vs_first", ".3fx"), ("as chain runs", "run:chain", ".3f"),
                      ("as chain+lookup runs", "run:chain+lookup", ".3f")])
    print_rows("first drafts by the target's own probability p of the token they guess: the head's acceptance "
               "there, of the share of positions", [{**r, **confidence_cells(r["first_draft_by_confidence"])}
                                                    for r in res["rows"]],
               [("set", "set", ""), ("head", "head", ""),
                *[(f"{lo:g} ≤ p < {hi:g}" if hi < 1 else f"p ≥ {lo:g}", f"conf{k}", "")
                  for k, (lo, hi) in enumerate(zip(CONFIDENCE, CONFIDENCE[1:], strict=False))]])
    write_json(json_out, {**res, "heads": {label: str(h) for label, h in zip(labels, heads, strict=True)}})
