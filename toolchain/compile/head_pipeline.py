"""The compile pipeline of a head recipe: export, passes, emit, verification (toolchain/compile/head.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from toolchain.artifact.manifest import Manifest
from toolchain.compile.capture import rope_tables
from toolchain.compile.emit import staging, write_graphs, write_rope
from toolchain.compile.head import (
    VOCAB_FILE,
    example_feeds,
    export_head_graph,
    head_layout,
    load_head,
    verify_head,
)
from toolchain.compile.pass_runner import run_passes
from toolchain.compile.recipe import Recipe
from toolchain.compile.records import CompileResult, model_record, tool_versions
from toolchain.compile.report import write_report
from toolchain.compile.source import LoadedModel
from toolchain.compile.verify import real_text
from toolchain.ir.graphset import GraphEntry, GraphSet

VERIFY_ROWS = 48


def compile_head(recipe: Recipe, recipe_path: Path, out_dir: Path, force: bool, loaded: LoadedModel,
                 timer: Any) -> Any:
    assert recipe.head is not None
    weights = (recipe_path.parent / recipe.head.weights).resolve()
    with timer.stage("load head", str(weights)):
        head = load_head(loaded.model, weights)
    graphs, layouts = GraphSet(), {}
    for name, spec in recipe.graphs.items():
        layout = head_layout(head, spec.width, spec.context)
        with timer.stage(f"export head {name} (N={spec.width}, CL={spec.context})"):
            model = export_head_graph(head, layout, name)
        graphs.add(GraphEntry(name=name, model=model, family=name, role=recipe.graph_role(name),
                              width=spec.width, context=spec.context))
        layouts[name] = layout
    any_layout = next(iter(layouts.values()))
    rope = rope_tables(loaded.model, any_layout, max(s.context for s in recipe.graphs.values()))
    pass_rows: list[dict[str, Any]] = []
    if recipe.passes:
        with timer.stage(f"passes ({len(recipe.passes)})"):
            feeds = {f: example_feeds(lay, seed=i) for i, (f, lay) in enumerate(layouts.items())}
            graphs, pass_rows = run_passes(graphs, list(recipe.passes), recipe.tolerance.max_abs, feeds,
                                           progress=timer.reporter.note)
    vocab = head.vocab_ids.numpy().astype(np.int64)
    with staging(out_dir, force) as tmp:
        with timer.stage("emit"):
            records, weight_rec = write_graphs(tmp, graphs)
            del graphs
            rope_rec = write_rope(tmp, rope)
            np.save(tmp / VOCAB_FILE, vocab)
            loaded.tokenizer.save_pretrained(tmp / "tokenizer")
            info = replace(model_record(loaded, any_layout), draft_head={
                "vocab_file": VOCAB_FILE, "target_vocab": int(loaded.config.vocab_size),
                "target": recipe.source.describe(), "weights": str(weights), "made_by": recipe.head.made_by,
                "features": "the target's residual stream before its final norm, at each row's previous position",
            })
            manifest = Manifest(
                name=recipe.name,
                source={"spec": recipe.source.model_dump(exclude_none=True), "description": loaded.description,
                        "fingerprint": loaded.fingerprint, "files": loaded.files},
                recipe=recipe.model_dump(mode="json"), recipe_file=str(recipe_path.resolve()),
                tools=tool_versions(), model=info, graphs=records, weights=weight_rec, rope=rope_rec,
                passes=pass_rows,
            )
            manifest.write(tmp)
        with timer.stage(f"verify head vs torch ({VERIFY_ROWS} decoded rows)"):
            tokens = loaded.tokenizer(real_text()).input_ids[:VERIFY_ROWS]
            manifest.verification = {"head": verify_head(tmp, head, loaded.model, tokens, recipe.tolerance.max_abs)}
        h = manifest.verification["head"]
        manifest.report_sections.append(
            "## Draft head verification\n\n"
            f"{h['rows']} real tokens decoded one row at a time through `{manifest.graphs[0].family}` with the "
            f"runtime's cache, against the torch module's causal pass over the whole sequence: max |logits diff| "
            f"{h['max_abs_logits']:.2e}, max relative |hidden diff| {h['max_rel_hidden']:.2e}, argmax identical on "
            f"{h['argmax_identical']}/{h['rows']} rows. Draft vocabulary: {len(vocab)} of the target's "
            f"{loaded.config.vocab_size} tokens (`{VOCAB_FILE}`).")
        manifest.inspect_tables.append({
            "title": f"Draft head verification ({h['rows']} real tokens through `{manifest.graphs[0].family}` "
                     "vs the torch module)",
            "head": ["max |logits diff|", "max relative |hidden diff|", "argmax identical", "tolerance", "ok"],
            "rows": [[f"{h['max_abs_logits']:.2e}", f"{h['max_rel_hidden']:.2e}", f"{h['argmax_identical']}/{h['rows']}",
                      f"{recipe.tolerance.max_abs:g}", "yes" if h["ok"] else "NO"]]})
        manifest.timings = timer.timings
        write_report(tmp, manifest)
        manifest.write(tmp)
    return CompileResult(out_dir=out_dir.resolve(), manifest=manifest, timings=timer.timings)
