"""Building mobc's CPU kernel library: cached per source version, and a clear error (not a
traceback, not a half-written library) on a machine without a C compiler."""

from __future__ import annotations

import pytest

from toolchain import kernels


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOBC_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_built", {})
    return tmp_path / "kernels"


def test_no_compiler_is_a_message_naming_the_fix(fresh_cache, monkeypatch):
    from passes import build
    from tests.passes.test_matmul_nbits import _on_grids
    from tests.passes.tiny import graphset_for

    monkeypatch.setattr(kernels, "_compiler", lambda: None)
    with pytest.raises(kernels.KernelBuildError, match="no C compiler found.*kernel_rows"):
        kernels.library()
    assert not kernels.available() and not list(fresh_cache.rglob("*.so"))
    gs, _ = graphset_for("llama", (1,))
    _on_grids(gs)
    entry = next(iter(gs.entries.values()))
    with pytest.raises(kernels.KernelBuildError, match="kernel_rows"):
        build({"matmul_nbits": {"kernel_rows": 1}}).call(entry.model)


def test_no_compiler_names_the_certified_heads_option(fresh_cache, monkeypatch):
    """The int16 first pass of the certified head needs the kernels too: the error says which option."""
    monkeypatch.setattr(kernels, "_compiler", lambda: None)  # before the import below asks for the library
    from passes import build
    from tests.passes.test_certified_lm_head import _head_on_q8_0
    from tests.passes.tiny import graphset_for

    gs, _ = graphset_for("llama", (1,))
    _head_on_q8_0(gs)
    entry = next(iter(gs.entries.values()))
    with pytest.raises(kernels.KernelBuildError, match=r"certified_lm_head: \{activations: int16\} needs mobc's CPU kernels"):
        build({"certified_lm_head": {"activations": "int16"}}).call(entry.model)
    assert build({"certified_lm_head": {"activations": "int8"}}).call(entry.model).modified  # int8 needs none


@pytest.mark.skipif(kernels._compiler() is None, reason="no C compiler")
def test_built_once_per_source_version(fresh_cache):
    first = kernels.library()
    assert first.is_file() and first.parent.parent == fresh_cache
    stamp = first.stat().st_mtime_ns
    kernels._built.clear()
    assert kernels.library() == first and first.stat().st_mtime_ns == stamp  # reused, not rebuilt


def test_no_compiler_names_the_layer_fusion(fresh_cache, monkeypatch):
    """fuse_silu_mul emits a mobc op: without a compiler it fails naming itself, before any rewrite."""
    monkeypatch.setattr(kernels, "_compiler", lambda: None)
    from passes import build
    from tests.passes.tiny import tiny

    _, model = tiny("llama", 1)
    build("fuse_projections")(model)
    ops = [n.op_type for n in model.graph]
    with pytest.raises(kernels.KernelBuildError, match="fuse_silu_mul needs mobc's CPU kernels"):
        build("fuse_silu_mul").call(model)
    assert [n.op_type for n in model.graph] == ops
