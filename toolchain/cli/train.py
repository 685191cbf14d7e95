"""`mobc train draft|predictor|diffusion|forecast`: the small trained assets the runtime uses."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.table import Table

from toolchain.cli.common import THREADS, console, load_models, load_source, log
from toolchain.compile.report import rich_table
from toolchain.errors import MobcError

app = typer.Typer(no_args_is_help=True, help="Train helper models for the runtime (drafts, predictor, diffusion LM, forecasts).")


@app.command("draft")
def train_draft(
    recipe: Path = typer.Argument(..., help="the target's recipe, e.g. recipes/smollm2-135m.yaml"),
    out: Path | None = typer.Option(None, "--out", help="folder for the draft (Hugging Face save_pretrained layout; "
                                    "not needed with --generate-only)"),
    layers: str = typer.Option("6", "--layers", help="k (first k-1 layers + last) or indices like 0-4,29"),
    minutes: float | None = typer.Option(None, "--minutes", help="wall-clock budget of the distillation loop "
                                         "(default 4; --kind head: of the whole command, default 20)"),
    steps: int | None = typer.Option(None, "--steps", help="head: instead of --minutes, exactly N training steps "
                                     "with every generation and the teacher pass run to completion (the same "
                                     "head on a faster or busier machine)"),
    seq_len: int = typer.Option(256, "--seq-len"),
    batch: int = typer.Option(4, "--batch"),
    lr: float | None = typer.Option(None, "--lr", help="peak learning rate (default 2e-4; --kind head: 1e-3, decayed "
                                    "by a cosine to a tenth)"),
    corpus_tokens: int = typer.Option(65_536, "--corpus-tokens", help="most stdlib tokens the teacher pass covers"),
    generated: int = typer.Option(0, "--generated-windows",
                                  help="also distill on this many windows of the target's own greedy continuations "
                                       "of stdlib prompts (on-policy data; what speculative decoding is judged on)"),
    init: Path | None = typer.Option(None, "--init", help="continue distilling a draft this command saved "
                                                           "(--layers is then taken from it; --kind head: a head "
                                                           "folder or its head.safetensors, whose layer count and "
                                                           "draft vocabulary it keeps)"),
    recipe_out: Path | None = typer.Option(None, "--recipe-out", help="also write a recipe compiling the draft"),
    kind: str = typer.Option("layers", "--kind", help="layers: the target's first layers + a lens (an HF model); "
                             "head: a feature-level draft head (EAGLE-style, one layer over the target's features)"),
    seed: int = typer.Option(0, "--seed", help="head: the seed the shipped head was trained with"),
    app_share: float | None = typer.Option(None, "--app-share", help="head: share of the budget spent generating the "
                                           "target's answers to app prompts (on-policy data; default 0.2)"),
    self_chat: int | None = typer.Option(None, "--self-chat", help="head: most chat requests the target writes "
                                         "itself and answers (default 192)"),
    onpolicy_cache: Path | None = typer.Option(None, "--onpolicy-cache", help="head: file keeping the target's "
                                               "generated windows; a rerun with the same settings reads them instead "
                                               "of generating (most of a run's budget) and trains longer"),
    unroll: int | None = typer.Option(None, "--unroll", help="head: passes over each window, each continuing "
                                      "from the head's own features (default 2; 1: no unrolling)"),
    self_chat_openers: bool = typer.Option(False, "--self-chat-openers", help="head: start the target's own chat "
                                           "requests with common instruction verbs and question words (Write, "
                                           "Explain, Solve, ...) for more kinds of request"),
    answer_batch: int | None = typer.Option(None, "--answer-batch", help="head: rows per batched greedy answer "
                                            "generation (default 32; 64 is ~1.4x faster here)"),
    precision: str = typer.Option("fp32", "--precision", help="head: training matmuls in fp32 or bf16 (autocast; "
                                  "~1.6x the steps on a CPU with AVX512-BF16; weights and teacher stay fp32)"),
    generate_only: bool = typer.Option(False, "--generate-only", help="head: only write --onpolicy-cache (the "
                                       "target's answers, with no time limit) and stop; training runs then read it"),
    unroll_mode: str = typer.Option("shift", "--unroll-mode", help="head: shift (each unrolled pass reads the "
                                     "head's own features on every row) or chain (each unrolled row sees the true "
                                     "prefix and its own chain, as the chain policy drafts; 1.06x-1.36x a step's time)"),
    onpolicy_round: int = typer.Option(0, "--onpolicy-round", help="head, with --generate-only: K >= 1 writes only "
                                       "answers to --self-chat more requests the target writes itself (other ones "
                                       "for each K), for a training's --onpolicy-extra"),
    onpolicy_extra: list[Path] = typer.Option([], "--onpolicy-extra", help="head: also train on the answers in "
                                              "this --onpolicy-round K cache (repeatable)"),
    teacher_precision: str = typer.Option("fp32", "--teacher-precision", help="head: the teacher pass over the "
                                          "training windows in fp32 or bf16 (autocast; 1.38x faster here, 0.994 "
                                          "argmax agreement; the held-out sets stay fp32)"),
    teacher_cache: Path | None = typer.Option(None, "--teacher-cache", help="head: local file keeping the teacher "
                                              "pass's states (fp16, ~0.3 MB per window; the run holds and trains on "
                                              "those, half the memory of fp32); a rerun reads those of the windows it "
                                              "holds and runs the pass over the others only"),
    until_end_of_turn: bool = typer.Option(False, "--until-end-of-turn", help="head: train each answer only up to "
                                           "where the target itself would end it (its greedy next token is "
                                           "end-of-turn); the answers are generated past that point"),
    weight_decay: float | None = typer.Option(None, "--weight-decay", help="head: AdamW's decoupled weight decay "
                                              "on the head's matrices (default 0: none)"),
    extra_held_out: int | None = typer.Option(None, "--extra-held-out", help="head: of the --onpolicy-extra "
                                              "answers, hold out N evenly spaced windows (at most a quarter; default "
                                              "64) for the report's held-out set of the extra rounds; 0 trains on all"),
    head_layers: int | None = typer.Option(None, "--head-layers", help="head: decoder layers of the target's class "
                                           "in the head (default 1; each costs what one of the target's layers does; "
                                           "with --init, more than the saved head's grows it)"),
    dropout: float | None = typer.Option(None, "--dropout", help="head: dropout on the head's layer inputs and "
                                         "attention weights while training (default 0: none)"),
    argmax_weight: float | None = typer.Option(None, "--argmax-weight", help="head: weight of a cross-entropy on "
                                               "the target's greedy token beside the KL (default 0: none); it "
                                               "counts most where the target decides narrowly"),
    checkpoint: Path | None = typer.Option(None, "--checkpoint", help="head, with --steps: file keeping the "
                                           "training's state every 10 minutes; the same command run again after a "
                                           "stop resumes from it and makes the same head (removed when the head is "
                                           "written)"),
) -> None:
    """Derive a draft from the target (kept layers + shared embeddings/lm_head) and distill it on stdlib source,
    or (--kind head) train a draft head that reads the target's features."""
    from toolchain.compile.recipe import load_recipe

    if out is None and not (kind == "head" and generate_only):
        raise MobcError("--out DIR: give the folder the draft is written to")
    if kind == "head":
        _train_head(recipe, out, minutes, steps, seed, app_share, self_chat, onpolicy_cache, unroll,
                    self_chat_openers=self_chat_openers, answer_batch=answer_batch, precision=precision,
                    generate_only=generate_only, onpolicy_round=onpolicy_round, onpolicy_extra=onpolicy_extra,
                    unroll_mode=unroll_mode, teacher_precision=teacher_precision, teacher_cache=teacher_cache,
                    until_end_of_turn=until_end_of_turn, weight_decay=weight_decay, extra_held_out=extra_held_out,
                    head_layers=head_layers, checkpoint=checkpoint, dropout=dropout, init=init, lr=lr,
                    argmax_weight=argmax_weight)
        return
    if kind != "layers":
        raise MobcError(f"--kind {kind!r}: choose layers or head")
    if steps is not None:
        raise MobcError("--steps: a fixed step count is for --kind head; --kind layers trains for --minutes")
    if weight_decay is not None:
        raise MobcError("--weight-decay: it is for --kind head; --kind layers trains without decay")
    if extra_held_out is not None:
        raise MobcError("--extra-held-out: it is for --kind head with --onpolicy-extra")
    if head_layers is not None:
        raise MobcError("--head-layers: it is for --kind head; --kind layers takes --layers")
    if dropout is not None:
        raise MobcError("--dropout: it is for --kind head; --kind layers trains without dropout")
    if argmax_weight is not None:
        raise MobcError("--argmax-weight: it is for --kind head; --kind layers distills on the KL alone")
    if checkpoint is not None:
        raise MobcError("--checkpoint: it is for --kind head with --steps")
    from toolchain.train.draft import DistillConfig
    from toolchain.train.draft import train_draft as run_train

    cfg = DistillConfig(seconds=(minutes or 4.0) * 60, seq_len=seq_len, batch=batch, lr=2e-4 if lr is None else lr,
                        corpus_tokens=corpus_tokens,
                        generated_windows=generated, init=str(init) if init else None)
    report = run_train(recipe, out, layers, cfg, log=log)
    console.print(f"[bold green]draft[/] {out}: {report['params'] / 1e6:.1f}M params, layers {report['config']['layers']}, "
                  f"held-out top-1 agreement with the target: lens {report['agreement_lens']:.3f}, distilled "
                  f"{report['agreement_distilled']:.3f} after {report['steps']} steps (kept {report['kept']}; "
                  f"{report['loop_seconds']:.0f} s teacher pass + distillation, {report['total_seconds']:.0f} s total)")
    if recipe_out:
        target = load_recipe(recipe)
        graphs = "\n".join(f"  {n}: {{width: {g.width}, context: {g.context}}}" for n, g in target.graphs.items()
                           if n in ("decode", "prefill"))
        rel = Path(os.path.relpath(out.resolve(), recipe_out.resolve().parent))
        recipe_out.write_text(
            f"# Draft for {target.name}, made by `mobc train draft` (layers {report['config']['layers']}).\n"
            f"name: {target.name}-draft\nsource: {{path: {rel}}}\ngraphs:\n{graphs}\n"
            f"tolerance: {{max_abs: {target.tolerance.max_abs:g}}}\nverify: {{greedy_tokens: 16}}\n")
        console.print(f"wrote {recipe_out}; compile it with mobc compile {recipe_out}")


def _train_head(recipe: Path, out: Path | None, minutes: float | None, steps: int | None, seed: int, app_share: float | None,
                self_chat: int | None, onpolicy_cache: Path | None, unroll: int | None, *, self_chat_openers: bool,
                answer_batch: int | None, precision: str, generate_only: bool, onpolicy_round: int,
                onpolicy_extra: list[Path], unroll_mode: str, teacher_precision: str,
                teacher_cache: Path | None, until_end_of_turn: bool = False,
                weight_decay: float | None = None, extra_held_out: int | None = None,
                head_layers: int | None = None, checkpoint: Path | None = None,
                dropout: float | None = None, init: Path | None = None, lr: float | None = None,
                argmax_weight: float | None = None) -> None:
    from toolchain.train.head import (
        HEAD_FILE,
        HeadConfig,
        generate_onpolicy,
        head_weights,
        held_out_table,
        train_head,
    )
    from toolchain.train.head_model import layers_in

    given = {"minutes": minutes, "steps": steps, "app_share": app_share, "self_chat": self_chat, "unroll": unroll,
             "onpolicy_cache": str(onpolicy_cache) if onpolicy_cache else None, "answer_batch": answer_batch,
             "weight_decay": weight_decay, "extra_held_out": extra_held_out, "head_layers": head_layers,
             "dropout": dropout, "lr": lr, "argmax_weight": argmax_weight}
    cfg = HeadConfig(seed=seed, self_chat_openers=self_chat_openers, precision=precision,
                     onpolicy_round=onpolicy_round, onpolicy_extra=tuple(str(p) for p in onpolicy_extra),
                     unroll_mode=unroll_mode, teacher_precision=teacher_precision,
                     teacher_cache=str(teacher_cache) if teacher_cache else None, until_end_of_turn=until_end_of_turn,
                     checkpoint=str(checkpoint) if checkpoint else None, init=str(init) if init else None,
                     **{k: v for k, v in given.items() if v is not None})
    if steps is not None and (minutes is not None or generate_only or steps < 1):
        raise MobcError(f"--steps {steps}: give N >= 1 training steps, without --minutes (the steps replace the time "
                        "budget) and without --generate-only (it trains nothing)")
    if onpolicy_round < 0 or (onpolicy_round and not generate_only):
        raise MobcError(f"--onpolicy-round {onpolicy_round}: give K >= 1 with --generate-only (it writes more answers "
                        "for a training's --onpolicy-extra; round 0 is a whole run's data)")
    if onpolicy_extra and generate_only:
        raise MobcError("--onpolicy-extra: extra rounds are read by a training run, not by --generate-only")
    if missing := [p for p in onpolicy_extra if not p.is_file()]:
        raise MobcError(f"--onpolicy-extra {missing[0]}: no such file; write it with --generate-only "
                        "--onpolicy-round K --onpolicy-cache FILE")
    if unroll_mode not in ("shift", "chain"):
        raise MobcError(f"--unroll-mode {unroll_mode!r}: choose shift or chain")
    for option, value in (("--precision", precision), ("--teacher-precision", teacher_precision)):
        if value not in ("fp32", "bf16"):
            raise MobcError(f"{option} {value!r}: choose fp32 or bf16")
    if teacher_cache and generate_only:
        raise MobcError("--teacher-cache: the teacher pass belongs to a training run, not to --generate-only")
    if until_end_of_turn and generate_only:
        raise MobcError("--until-end-of-turn: it changes what a training run learns from; --generate-only trains nothing")
    if not 1 <= cfg.answer_batch <= 512:
        raise MobcError(f"--answer-batch {cfg.answer_batch}: give 1 to 512 rows")
    if not 0.0 < cfg.app_share < 0.6:
        raise MobcError(f"--app-share {cfg.app_share}: give a share of the budget between 0 and 0.6 (the teacher "
                        "pass and the training need the rest)")
    if not 1 <= cfg.unroll <= 4:
        raise MobcError(f"--unroll {cfg.unroll}: give 1 to 4 passes (each costs a full pass over the batch)")
    if not 0.0 <= cfg.weight_decay < 1.0:
        raise MobcError(f"--weight-decay {cfg.weight_decay}: give a decay from 0 (none) to below 1 (0.01-0.1 is usual)")
    if extra_held_out is not None and (extra_held_out < 0 or not onpolicy_extra):
        raise MobcError(f"--extra-held-out {extra_held_out}: give N >= 0 windows, with the --onpolicy-extra rounds "
                        "they are held out of")
    if not 1 <= cfg.head_layers <= 4:
        raise MobcError(f"--head-layers {cfg.head_layers}: give 1 to 4 layers (a head is a small fraction of the target)")
    if checkpoint is not None and (steps is None or generate_only):
        raise MobcError(f"--checkpoint {checkpoint}: a run resumes step for step, so give it with --steps N (not a "
                        "--minutes budget, and not with --generate-only)")
    if not 0.0 < cfg.lr < 0.1:
        raise MobcError(f"--lr {cfg.lr}: give a learning rate above 0 and below 0.1 (1e-3 trains a head from scratch, "
                        "a few 1e-4 goes on from one with --init)")
    if not 0.0 <= cfg.dropout < 0.5:
        raise MobcError(f"--dropout {cfg.dropout}: give a rate from 0 (none) to below 0.5 (0.05-0.2 is usual)")
    if not 0.0 <= cfg.argmax_weight <= 10.0:
        raise MobcError(f"--argmax-weight {cfg.argmax_weight}: give a weight from 0 (none) to 10 (0.5-1 sits beside "
                        "a KL of ~0.5)")
    for option, value in (("--head-layers", head_layers), ("--dropout", dropout), ("--argmax-weight", argmax_weight),
                          ("--init", init)):
        if value is not None and generate_only:
            raise MobcError(f"{option}: it shapes the trained head; --generate-only trains nothing")
    if init is not None:
        if not head_weights(init).is_file():
            raise MobcError(f"--init {init}: no head there; give a head folder or head.safetensors this command "
                            "wrote (assets/heads/ ships some)")
        try:
            saved = layers_in(head_weights(init))
        except Exception as exc:  # safetensors' own errors name no fix
            raise MobcError(f"--init {init}: not a head this command wrote ({exc}); give a head folder or its "
                            "head.safetensors") from exc
        if head_layers is not None and head_layers < saved:
            raise MobcError(f"--head-layers {head_layers}: --init {init} has {saved} layers and goes on training all "
                            f"of them; give --head-layers {saved} or more (more grows the head) or drop it")
    if cfg.self_chat < 0:
        raise MobcError(f"--self-chat {cfg.self_chat}: give a count >= 0")
    if generate_only:
        counts = generate_onpolicy(recipe, cfg, log=log)
        console.print(f"[bold green]on-policy windows[/] {onpolicy_cache}: {counts['app_windows']} answer windows "
                      f"({counts['self_chat_requests']} self-written chat requests), {counts['stdlib_continuations']} "
                      f"stdlib continuations, {counts['held_out_windows']} held-out; "
                      + (f"train with round 0's --onpolicy-cache and --onpolicy-extra {onpolicy_cache}" if onpolicy_round
                         else f"train with the same settings and --onpolicy-cache {onpolicy_cache}"))
        return
    report = train_head(recipe, out, cfg, log=log)
    console.print(f"[bold green]draft head[/] {out / HEAD_FILE}: {report['params_trained'] / 1e6:.1f}M trained params, "
                  f"draft vocabulary {report['draft_vocab']} (covers {report['vocab_coverage_held_out']:.3f} of the "
                  f"target's held-out tokens), {report['steps']} steps, {report['seconds']:.0f} s")
    console.print(rich_table(f"held-out chain gamma={cfg.gamma} on the target's own greedy text",
                             held_out_table(report)))


@app.command("predictor")
def train_predictor(
    artifact: Path = typer.Argument(..., help="target artifact compiled with split_layers at the predictor layer"),
    draft: Path = typer.Option(..., "--draft", help="draft artifact folder"),
    prompts: str = typer.Option("humaneval:40", "--prompts"),
    skip: int = typer.Option(100, "--skip", help="skip the first N prompts (keep the bench's prompts out)"),
    minutes: float = typer.Option(3.0, "--minutes"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    recall: float = typer.Option(0.95, "--recall", help="recall of accepted-worthy branches to keep"),
    out: Path | None = typer.Option(None, "--out", help="default: ARTIFACT/predictor.json (found by lever+prune)"),
    threads: int | None = THREADS,
) -> None:
    """Fit lever's branch predictor on real target + draft runs; report precision/recall."""
    from toolchain.bench.prompts import prompt_ids
    from toolchain.runtime.predictor import save_predictor
    from toolchain.train.predictor import train_predictor as fit

    target, drafter = load_models(artifact, draft, "cpu", threads, [])
    if drafter is None:
        raise MobcError("--draft is required")
    texts = [target.tokenizer.decode(x) for x in prompt_ids(target.tokenizer, prompts, skip)]
    spec = fit(target, drafter, texts, seconds=minutes * 60, max_new_tokens=max_new_tokens, recall=recall,
               log=log)
    path = save_predictor(spec, out or artifact / "predictor.json")
    m = spec.metrics
    console.print(f"[bold green]predictor[/] {path}: layer {spec.layer}, threshold {spec.threshold:.3f}, "
                  f"{m['train_nodes']} train / {m['test_nodes']} test nodes from {m['prompts']} prompts "
                  f"({m['seconds']:.0f} s)")
    t, bb = m["test"], m["backbone_only"]
    console.print(f"held-out: precision {t['precision']:.3f}, recall {t['recall']:.3f}, pruned {t['pruned_fraction']:.1%} "
                  f"of nodes (backbone only: precision {bb['precision']:.3f}, recall {bb['recall']:.3f})")


@app.command("diffusion")
def train_diffusion(
    recipe: Path = typer.Argument(..., help="the AR model's recipe, e.g. recipes/smollm2-135m.yaml"),
    out: Path = typer.Option(..., "--out", help="folder for the diffusion LM (save_pretrained + diffusion.json)"),
    minutes: float = typer.Option(15.0, "--minutes", help="wall-clock budget of the training loop"),
    seq_len: int = typer.Option(96, "--seq-len"),
    block: int = typer.Option(32, "--block", help="diffusion block size trained for (= the graph width)"),
    batch: int = typer.Option(4, "--batch"),
    lr: float = typer.Option(2e-4, "--lr"),
    mask_token: str = typer.Option("<empty_output>", "--mask-token", help="an unused special token to use as [MASK]"),
    init: Path | None = typer.Option(None, "--init", help="continue training a diffusion LM saved by an earlier --out"),
    seed: int = typer.Option(0, "--seed", help="which windows and masks are drawn (give a new one with --init)"),
) -> None:
    """Adapt an AR LM into a masked diffusion LM (Dream-style) on stdlib source; report masked accuracy."""
    from toolchain.train.diffusion import DiffusionTrainConfig
    from toolchain.train.diffusion import train_diffusion as run_train

    cfg = DiffusionTrainConfig(seconds=minutes * 60, seq_len=seq_len, block=block, batch=batch, lr=lr, seed=seed,
                               mask_token=mask_token)
    rep = run_train(recipe, out, cfg, log=log, init=init)
    b, a = rep["accuracy_before"], rep["accuracy_after"]
    table = Table(title=f"held-out masked-token accuracy ({rep['steps']} steps, {rep['seconds']:.0f} s training)")
    for col in ("mask rate", "acc before", "acc after", "NLL before", "NLL after"):
        table.add_column(col, justify="right")
    for rate in ("0.15", "0.5", "0.9"):
        table.add_row(rate, f"{b['acc@' + rate]:.3f}", f"{a['acc@' + rate]:.3f}", f"{b['nll@' + rate]:.2f}",
                      f"{a['nll@' + rate]:.2f}")
    console.print(table)
    for s in rep["samples"]:
        console.print(f"[bold]prompt[/] {s['prompt']!r} (S={s['steps']} steps per block)\n[bold]->[/] "
                      f"{s['completion']!r}", highlight=False)
    console.print(f"[bold green]diffusion LM[/] {out} ({rep['total_seconds']:.0f} s total); compile it with "
                  "mobc compile recipes/smollm2-135m-diffusion.yaml")


@app.command("forecast")
def train_forecast_cmd(
    artifact: Path = typer.Argument(..., help="artifact folder compiled with forecast_inputs"),
    minutes: float = typer.Option(3.0, "--minutes", help="wall-clock budget of the training loop"),
    seq_len: int = typer.Option(128, "--seq-len"),
    anchors: int = typer.Option(32, "--anchors", help="forecast sets per training sequence"),
    lr: float = typer.Option(1e-2, "--lr"),
    out: Path | None = typer.Option(None, "--out", help="default: ARTIFACT/forecast.npz"),
    resume: bool = typer.Option(False, "--resume", help="start from the embeddings already at --out"),
) -> None:
    """Prefix-tune DS2D's forecast embeddings on stdlib source with the base model frozen."""
    from toolchain.artifact.manifest import Manifest
    from toolchain.runtime.policies.ds2d import FORECAST_FILE
    from toolchain.train.forecast import ForecastConfig, save_forecast, train_forecast

    manifest = Manifest.load(artifact)
    shapes = [i.shape for g in manifest.graphs for i in g.inputs if i.name == "forecast_embeds"]
    if not shapes:
        raise MobcError(f"{artifact} has no forecast_embeds input; add `- forecast_inputs: {{m: 3}}` to the "
                        "recipe's passes and recompile")
    path = out or artifact / FORECAST_FILE
    init = None
    if resume:
        from toolchain.runtime.policies.ds2d import load_forecast

        init = load_forecast(artifact, path)
    lm = load_source(artifact)
    cfg = ForecastConfig(seconds=minutes * 60, seq_len=seq_len, anchors=anchors, lr=lr)
    embeds, report = train_forecast(lm.model, lm.tokenizer, shapes[0][0], cfg, log=log, init=init)
    save_forecast(path, embeds, report)
    console.print(f"[bold green]forecast[/] {path}: m={report['m']}, {report['steps']} steps in {report['seconds']:.0f} s; "
                  f"top-1 per slot {report['accuracy_before']} -> {report['accuracy_after']} (held-out stdlib files)")
