"""Test-session settings: a private mobc cache so tests never read or fill the user's ~/.cache/mobc."""

import os
import tempfile

import pytest


@pytest.fixture(scope="session", autouse=True)
def _private_mobc_cache():
    if "MOBC_TEST_USE_USER_CACHE" in os.environ:  # opt-in reuse of the GGUF float cache
        yield
        return
    with tempfile.TemporaryDirectory(prefix="mobc-cache-") as folder:
        old = os.environ.get("MOBC_CACHE")
        os.environ["MOBC_CACHE"] = folder
        yield
        if old is None:
            os.environ.pop("MOBC_CACHE", None)
        else:
            os.environ["MOBC_CACHE"] = old


@pytest.fixture(scope="session")
def real_smollm2(tmp_path_factory):
    """recipes/smollm2-135m.yaml compiled once per session (~3 minutes here): the real-model tests
    of compile, runtime and bundles share it."""
    from pathlib import Path

    from toolchain.compile.pipeline import compile_recipe

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-135m.yaml"
    return compile_recipe(recipe, out=tmp_path_factory.mktemp("real") / "smollm2")


@pytest.fixture(scope="session")
def lora_artifact(tmp_path_factory):
    """(artifact folder, source model folder): tiny llama with mha_to_sha + lora_inputs + forecast_inputs."""
    from tests import lora_tiny
    from tests.tiny import save_tiny, write_recipe
    from toolchain.compile.pipeline import compile_recipe

    tmp = tmp_path_factory.mktemp("lora_rt")
    src = save_tiny(tmp / "src", "llama")
    recipe = write_recipe(tmp / "r.yaml", src, "tiny-lora", lora_tiny.GRAPHS, lora_tiny.PASSES)
    return compile_recipe(recipe).out_dir, src


TREE_BASE = "  decode: {width: 1, context: 64}\n"  # the widest tree graph doubles as prefill: fewer compiles
TREE_GRAPHS = "  tree4: {width: 4, context: 64, role: tree}\n  tree8: {width: 8, context: 64, role: tree}\n"


@pytest.fixture(scope="session")
def tree_artifacts(tmp_path_factory):
    """(target, draft) folders: the target has tree widths 4/8, its lm_head split off and a cut at layer 1."""
    from tests.tiny import save_tiny, write_recipe
    from toolchain.compile.pipeline import compile_recipe

    root = tmp_path_factory.mktemp("tree_policies")
    target = write_recipe(root / "t.yaml", save_tiny(root / "t_hf", "llama", seed=0), name="target",
                          graphs=TREE_BASE + TREE_GRAPHS, extra="passes: [split_lm_head, {split_layers: {at: [1]}}]\n")
    draft = write_recipe(root / "d.yaml", save_tiny(root / "d_hf", "llama", seed=1), name="draft",
                         graphs=TREE_BASE + "  tree4: {width: 4, context: 64, role: tree}\n")
    return compile_recipe(target).out_dir, compile_recipe(draft).out_dir



@pytest.fixture(scope="session")
def near_draft(tmp_path_factory):
    """A draft artifact for any seed-0 tiny llama target: that target plus weight noise (tests/tiny.py
    save_near_tiny), with tree width 4 for lever and ahasd; acceptance is partial, not all or nothing."""
    from tests.tiny import save_near_tiny, write_recipe
    from toolchain.compile.pipeline import compile_recipe

    root = tmp_path_factory.mktemp("near_draft")
    recipe = write_recipe(root / "n.yaml", save_near_tiny(root / "hf", "llama"), name="near-draft",
                          graphs=TREE_BASE + "  tree4: {width: 4, context: 64, role: tree}\n")
    return compile_recipe(recipe).out_dir

def pytest_runtest_setup(item):
    """qnn-marked tests need onnxruntime-qnn. Where it is a declared dependency (Linux x86_64) a
    missing backend fails them; elsewhere (no wheel, or not declared) they skip."""
    if item.get_closest_marker("qnn") is None:
        return
    from toolchain.qnn.context import availability, declared_here

    ok, reason = availability()
    if ok:
        return
    if declared_here():
        pytest.fail(f"onnxruntime-qnn is a declared dependency on Linux x86_64 but unusable: {reason}; "
                    "reinstall with `pip install -e '.[dev]'`", pytrace=False)
    pytest.skip(f"onnxruntime-qnn unavailable: {reason}")
