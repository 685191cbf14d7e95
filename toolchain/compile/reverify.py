"""`mobc verify`: re-check an artifact's files and numerics against its source model."""

from __future__ import annotations

from pathlib import Path

from toolchain.artifact.manifest import Manifest
from toolchain.compile.capture import layout_for, rope_tables
from toolchain.compile.recipe import parse_recipe
from toolchain.compile.source import load
from toolchain.errors import ArtifactError


def reverify(folder: str | Path, reporter) -> bool:
    from toolchain.compile.pipeline import StageTimer, reference_cases, verify_artifact

    folder = Path(folder)
    manifest = Manifest.load(folder, check_files=False)  # every file is hashed again just below
    timer = StageTimer(reporter)
    with timer.stage("file checksums"):  # raised inside the stage: no check mark for a failed check
        bad = manifest.changed_files(folder)
        if bad:
            raise ArtifactError(
                f"{folder}: files changed or missing since compile: {', '.join(bad[:5])}; recompile the recipe"
            )
    recipe = parse_recipe(manifest.recipe or {}, origin=f"{folder}/manifest.json recipe")
    base = Path(manifest.recipe_file or folder).parent
    with timer.stage("load model", recipe.source.describe()):
        loaded = load(recipe.source, base=base, stream=True)  # one layer of weights at a time
    if loaded.fingerprint != manifest.source["fingerprint"]:
        raise ArtifactError(
            f"the source model {recipe.source.describe()} changed since this artifact was compiled "
            "(weights fingerprint differs); recompile the recipe"
        )
    layouts = {name: layout_for(loaded.config, s.width, s.context) for name, s in recipe.graphs.items()}
    rope = rope_tables(loaded.model, next(iter(layouts.values())), max(s.context for s in recipe.graphs.values()))
    with timer.stage("reference cases (transformers)"):
        cases = reference_cases(loaded, layouts, rope)
    result = verify_artifact(folder, recipe, loaded, cases, timer)
    for fam, f in result["families"].items():
        reporter.done(f"{fam}: max |logits diff| {f['logits_max_abs']:.2e}, KV {f['kv_max_abs']:.2e}", 0.0)
    return True
