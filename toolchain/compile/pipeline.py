"""The compile pipeline: recipe -> source -> capture/export -> passes -> emit -> verify -> manifest.

Each stage is a plain function call; `Reporter` receives stage start/finish events so the CLI
can show progress without the pipeline knowing about terminals.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import passes as pass_registry
from toolchain.artifact.layout import StepLayout
from toolchain.artifact.manifest import Manifest
from toolchain.compile.capture import layout_for, rope_tables
from toolchain.compile.emit import staging, write_graphs, write_rope
from toolchain.compile.export import StoredWeights, export_step_graph
from toolchain.compile.pass_runner import run_passes
from toolchain.compile.recipe import Recipe, check_against_model, load_recipe
from toolchain.compile.records import CompileResult, model_record, tool_versions
from toolchain.compile.report import write_report
from toolchain.compile.source import LoadedModel, load
from toolchain.compile.verify import (
    Case,
    check_tolerance,
    compare,
    eos_ids,
    hf_greedy_of,
    real_text,
    reference_case,
)
from toolchain.errors import RecipeError, VerificationError
from toolchain.ir import disk
from toolchain.ir.graphset import GraphEntry, GraphSet
from toolchain.runtime.greedy import decode_family, greedy
from toolchain.runtime.sessions import PART_BUDGET_BYTES, ArtifactSessions, stage_feeds


class Reporter:
    """Progress sink; the CLI subclasses it with rich output."""

    def start(self, stage: str) -> None: ...

    def done(self, stage: str, seconds: float, detail: str = "") -> None: ...

    def note(self, message: str) -> None:
        """Progress inside a long stage (calibration, QAT steps)."""


class StageTimer:
    def __init__(self, reporter: Reporter):
        self.reporter = reporter
        self.timings: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str, detail: str = "") -> Iterator[None]:
        self.reporter.start(name)
        t = time.perf_counter()
        yield
        self.timings[name] = round(time.perf_counter() - t, 2)
        self.reporter.done(name, self.timings[name], detail)


def export_graphs(recipe: Recipe, loaded: LoadedModel, timer: StageTimer,
                  spill: disk.Spill) -> tuple[GraphSet, dict[str, StepLayout]]:
    graphs, layouts = GraphSet(), {}
    weights = StoredWeights(loaded.store, loaded.model, spill) if loaded.store else None
    for name, spec in recipe.graphs.items():
        layout = layout_for(loaded.config, spec.width, spec.context)
        with timer.stage(f"export {name} (N={spec.width}, CL={spec.context})"):
            model = export_step_graph(loaded.model, layout, graph_name=name, weights=weights)
        graphs.add(GraphEntry(name=name, model=model, family=name, role=recipe.graph_role(name),
                              width=spec.width, context=spec.context))
        layouts[name] = layout
    return graphs, layouts


def reference_cases(loaded: LoadedModel, layouts: dict[str, StepLayout], rope: dict,
                    roles: dict[str, str] | None = None) -> dict[str, Case]:
    tokens = loaded.tokenizer(real_text()).input_ids
    mask_id = (loaded.diffusion or {}).get("mask_token_id")
    # a diffusion model's block graphs are checked on a bidirectional block with mask tokens
    return {name: reference_case(loaded.model, tokens, lay, rope, seed=i,
                                 mask_token_id=mask_id if (roles or {}).get(name) == "diffusion" else None)
            for i, (name, lay) in enumerate(layouts.items())}


def verify_artifact(folder: Path, recipe: Recipe, loaded: LoadedModel, cases: dict[str, Case],
                    timer: StageTimer) -> dict[str, Any]:
    """Numeric checks of the written graphs (files, not in-memory models)."""
    # one part's sessions at a time when the model is large (parts are cut to ~PART_BUDGET_BYTES)
    sessions = ArtifactSessions(folder, max_resident_bytes=PART_BUDGET_BYTES)
    families: dict[str, Any] = {}
    argmax_exact = frozenset(pass_registry.argmax_exact_outputs(recipe.passes))
    for family, case in cases.items():
        # the check fails inside its stage, so a failing family is never shown as done
        with timer.stage(f"verify {family} vs transformers"):
            figures = compare(sessions.run_family(family, case.feeds), case.expected, argmax_exact,
                              recipe.tolerance.max_abs)
            block = recipe.graph_role(family) == "diffusion" and loaded.diffusion
            figures["past_len"] = case.past_len
            figures["mask"] = "bidirectional block, ~half mask tokens" if block else "random tree over the new tokens"
            families[family] = figures
            check_tolerance(family, figures, recipe.tolerance.max_abs)
    result: dict[str, Any] = {"tolerance": recipe.tolerance.max_abs, "families": families}
    if loaded.diffusion:  # a diffusion LM: block decoding through the graphs vs torch, not AR greedy
        from toolchain.diffusion.verify_decode import decode_check

        with timer.stage("verify diffusion decoding vs torch"):
            result["diffusion_decode"] = decode_check(folder, loaded.model, loaded.tokenizer(recipe.verify.prompt).input_ids)
    n = recipe.verify.greedy_tokens
    if n:
        with timer.stage(f"verify greedy {n} tokens vs transformers"):
            ids = loaded.tokenizer(recipe.verify.prompt).input_ids
            room = sessions.chain(decode_family(sessions))[0].context - 1
            if len(ids) + n > room:
                raise RecipeError(
                    f"verify.greedy_tokens: the verification prompt ({len(ids)} tokens) plus {n} greedy tokens "
                    f"do not fit the decode graph's context ({room + 1}); lower verify.greedy_tokens, "
                    "shorten verify.prompt or raise the context"
                )
            ours = greedy(sessions, ids, n, eos_ids(loaded.config))
            ref = hf_greedy_of(loaded.model, ids, ours)
            first_diff = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), None)
            identical = ours == ref
            result["greedy"] = {"tokens": n, "prompt_tokens": len(ids), "identical": identical,
                                "first_mismatch": first_diff, "decode_family": decode_family(sessions),
                                "reference": ref, "ours": ours}
            if not identical:
                raise VerificationError(
                    f"greedy decoding through the emitted graphs diverges from transformers' greedy decoding at "
                    f"token {first_diff} (ours {ours[:first_diff + 1]}, generate {ref[:first_diff + 1]})"
                )
    return result


# the gate's prompt runs token by token through the decode binaries (~1.7 s per emulated SmolLM2 call)
LOCKSTEP_PROMPT_TOKENS = 8


def lockstep_applies(records: list[dict[str, Any]], spec: Any, loaded: LoadedModel) -> bool:
    """Whether the qnn: gate's lockstep runs: on, binaries built, and an AR model (a diffusion LM has
    no AR decode graph; its block binaries get the one-call gate)."""
    return bool(spec.verify and spec.lockstep_tokens and records and records[0]["status"] != "skipped"
                and not loaded.diffusion)


def lockstep_stage(folder: Path, records: list[dict[str, Any]], spec: Any, recipe: Recipe,
                   loaded: LoadedModel, reference: Path | None = None) -> dict[str, Any]:
    """The qnn: gate's greedy lockstep through the binaries `records` lists, on the verify prompt;
    `reference`: the float artifact of a quantized one."""
    from toolchain.qnn.lockstep import lockstep_gate

    ids = loaded.tokenizer(recipe.verify.prompt).input_ids[:LOCKSTEP_PROMPT_TOKENS]
    return lockstep_gate(folder, records, spec, ids, reference=reference)


def emit_qnn_stage(folder: Path, recipe: Recipe, cases: dict[str, Case]) -> list[dict[str, Any]]:
    """QNN HTP context binaries of every emitted graph, each run on real inputs and compared with CPU."""
    from toolchain.qnn import context as qnn

    sessions = ArtifactSessions(folder)
    graph_files = {name: folder / stage.file for name, stage in sessions.stages.items()}
    feeds = stage_feeds(sessions, {family: case.feeds for family, case in cases.items()})
    return qnn.emit_qnn(graph_files, folder / "qnn", recipe.qnn, feeds)


def quantized_qnn_stage(folder: Path, recipe: Recipe, loaded: LoadedModel) -> dict[str, Any]:
    """HTP binaries of every quantized graph (integer kernels; the fp16 flag only for the float tensors
    of `float_residual`), each run on two calls of held-out text (`gate_calls`) and gated against the
    CPU EP's QDQ simulation, with the float graphs as the reference both approximate (`qnn.compare`),
    then the lockstep greedy run."""
    from toolchain.artifact.manifest import Manifest
    from toolchain.qnn import context as qnn
    from toolchain.quantize.calibrate import corpus_tokens
    from toolchain.quantize.float_residual import FP16_TENSORS
    from toolchain.quantize.ppl import QUANT_DIR
    from toolchain.quantize.qnn_check import float_outputs, gate_calls

    qdir = folder / QUANT_DIR
    fp16_tensors = FP16_TENSORS if recipe.quantize.float_residual else {}
    spec = recipe.qnn.model_copy(update={"fp16": False, "options": {**recipe.qnn.options, **fp16_tensors}})
    sessions = ArtifactSessions(qdir, max_resident_bytes=PART_BUDGET_BYTES)
    held = corpus_tokens(loaded.tokenizer, "heldout", 2048)
    files = {name: qdir / stage.file for name, stage in sessions.stages.items()}
    calls = gate_calls(sessions, held)
    records = qnn.emit_qnn(files, qdir / "qnn", spec, calls, float_outputs(folder, calls))
    result: dict[str, Any] = {"graphs": records}
    lockstep = (lockstep_stage(qdir, records, spec, recipe, loaded, reference=folder)
                if lockstep_applies(records, spec, loaded) else None)
    if lockstep is not None:
        result["lockstep"] = lockstep
    qm = Manifest.load(qdir, check_files=False)
    qm.qnn, qm.qnn_lockstep = records, lockstep
    qm.write(qdir)
    return result


def compile_recipe(recipe_path: str | Path, out: str | Path | None = None, force: bool = False,
                   reporter: Reporter | None = None) -> CompileResult:
    reporter = reporter or Reporter()
    timer = StageTimer(reporter)
    recipe_path = Path(recipe_path)
    recipe = load_recipe(recipe_path)
    pass_registry.check_order(list(recipe.passes))  # bad names, options or order fail before any work
    out_dir = Path(out) if out else recipe.output_dir()
    from toolchain.compile.emit import claim_output

    # refuses anything but an absent/empty folder or (with --force) an artifact; sweeps dead compiles' staging
    # folders beside it; locks out_dir against a concurrent compile until the swap into place
    claim_output(out_dir, force)
    assets = asset_files(recipe, recipe_path)  # a missing shipped file fails before any work

    with timer.stage("load model", recipe.source.describe()):
        # a head recipe reads the target's embeddings and runs it for the reference: load it whole
        loaded = load(recipe.source, base=recipe_path.parent, stream=recipe.head is None)
    check_against_model(recipe, getattr(loaded.config, "max_position_embeddings", None))
    # tensors the export and the passes create live in a scratch folder beside the output (same
    # disk as the artifact), never all in memory; it goes away with the compile (and, named with
    # our PID like the staging folder, is swept by the next compile if this process is killed)
    scratch = out_dir.resolve().parent / f".{out_dir.name}.scratch-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        spill = disk.Spill(scratch)
        with disk.spilling(spill):
            return _compile(recipe, recipe_path, out_dir, force, loaded, timer, spill, assets)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def asset_files(recipe: Recipe, recipe_path: Path) -> dict[str, Path]:
    """The recipe's shipped assets by artifact file name, each checked to exist."""
    out = {}
    for name, spec in recipe.assets.items():
        path = (recipe_path.parent / spec.file).resolve()
        if not path.is_file():
            how = f" (it is made by {spec.made_by.strip()})" if spec.made_by else ""
            raise RecipeError(f"assets.{name}.file: {path} does not exist{how}; restore it from the repository "
                              "or re-create it, or drop the asset from the recipe")
        out[name] = path
    return out


def _compile(recipe: Recipe, recipe_path: Path, out_dir: Path, force: bool, loaded: LoadedModel,
             timer: StageTimer, spill: disk.Spill, assets: dict[str, Path]) -> CompileResult:
    if recipe.head is not None:
        from toolchain.compile.head_pipeline import compile_head

        if assets:
            raise RecipeError("assets: a draft head recipe ships none of its own; list them in its target's recipe")
        return compile_head(recipe, recipe_path, out_dir, force, loaded, timer)
    graphs, layouts = export_graphs(recipe, loaded, timer, spill)
    any_layout = next(iter(layouts.values()))
    rope = rope_tables(loaded.model, any_layout, max(s.context for s in recipe.graphs.values()))
    with timer.stage("reference cases (transformers)"):
        cases = reference_cases(loaded, layouts, rope, {n: recipe.graph_role(n) for n in layouts})

    pass_rows: list[dict[str, Any]] = []
    if recipe.passes:
        with timer.stage(f"passes ({len(recipe.passes)})"):
            graphs, pass_rows = run_passes(graphs, list(recipe.passes), recipe.tolerance.max_abs,
                                           {f: c.feeds for f, c in cases.items()}, progress=timer.reporter.note)

    with staging(out_dir, force) as tmp:
        with timer.stage("emit"):
            # each scratch tensor's blocks are freed once it is in weights.bin: the disk holds about
            # one copy of the weights at the end, not two (the scratch and the artifact)
            records, weights = write_graphs(tmp, graphs, release=spill.release)
            del graphs  # every weight now lives in weights.bin: the scratch copies can go
            spill.clear()
            rope_rec = write_rope(tmp, rope)
            loaded.tokenizer.save_pretrained(tmp / "tokenizer")
            for name, path in assets.items():  # hashed into manifest.files like every other file
                shutil.copyfile(path, tmp / name)
            manifest = Manifest(
                name=recipe.name,
                source={"spec": recipe.source.model_dump(exclude_none=True), "description": loaded.description,
                        "fingerprint": loaded.fingerprint, "files": loaded.files},
                recipe=recipe.model_dump(mode="json"),
                recipe_file=str(recipe_path.resolve()),
                tools=tool_versions(),
                model=model_record(loaded, any_layout),
                graphs=records,
                weights=weights,
                rope=rope_rec,
                passes=pass_rows,
            )
            manifest.write(tmp)  # provisional: sessions read it; the folder is not in place yet
        manifest.verification = verify_artifact(tmp, recipe, loaded, cases, timer)
        if recipe.qnn and not recipe.quantize:  # a quantized recipe's binaries are of its quantized graphs
            with timer.stage(f"qnn context binaries (soc {recipe.qnn.soc_model}, htp v{recipe.qnn.htp_arch})"):
                manifest.qnn = emit_qnn_stage(tmp, recipe, cases)
            if lockstep_applies(manifest.qnn, recipe.qnn, loaded):
                with timer.stage(f"qnn lockstep greedy {recipe.qnn.lockstep_tokens} tokens (emulated HTP)"):
                    manifest.qnn_lockstep = lockstep_stage(tmp, manifest.qnn, recipe.qnn, recipe, loaded)
        if recipe.quantize:  # after passes and float verification: writes tmp/quantized/
            from toolchain.quantize.stage import pipeline_quantize, report_section

            manifest.quantization = pipeline_quantize(tmp, recipe, loaded, timer)
            if recipe.qnn:
                with timer.stage(f"qnn context binaries of the quantized graphs (soc {recipe.qnn.soc_model})"):
                    manifest.quantization["qnn"] = quantized_qnn_stage(tmp, recipe, loaded)
            manifest.report_sections.append(report_section(manifest.quantization))
        manifest.timings = timer.timings
        write_report(tmp, manifest)
        manifest.write(tmp)
    return CompileResult(out_dir=out_dir.resolve(), manifest=manifest, timings=timer.timings)
