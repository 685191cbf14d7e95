"""A small artifact compiled once per test session, for the tests that run, inspect or damage one
(damaging tests work on a copy: `artifact_copy`)."""

from __future__ import annotations

import shutil

import pytest

TINY_GRAPHS = "  decode: {width: 1, context: 32}\n  prefill: {width: 4, context: 32}\n"


@pytest.fixture(scope="session")
def tiny_source(tmp_path_factory):
    from tests.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny_src") / "hf", "llama")


@pytest.fixture(scope="session")
def tiny_artifact(tiny_source, tmp_path_factory):
    """exported tiny llama: decode (N=1) and prefill (N=4) at context 32, no greedy check (~6 s)."""
    from tests.tiny import write_recipe
    from toolchain.compile.pipeline import compile_recipe

    recipe = write_recipe(tmp_path_factory.mktemp("tiny_art") / "tiny.yaml", tiny_source, graphs=TINY_GRAPHS)
    recipe.write_text(recipe.read_text().replace("greedy_tokens: 12", "greedy_tokens: 0"))
    return compile_recipe(recipe).out_dir


@pytest.fixture
def artifact_copy(tiny_artifact, tmp_path):
    copy = tmp_path / "artifact"
    shutil.copytree(tiny_artifact, copy)
    return copy
