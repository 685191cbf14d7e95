"""cache_attention on tiny models: each layer's attention over the static cache becomes one
CacheAttention that keeps the graph's numbers and reads only the slots the mask admits."""

from __future__ import annotations

import numpy as np
import pytest

from passes import build
from tests.passes.tiny import feeds_for, graphset_for, tiny
from toolchain import kernels
from toolchain.artifact.layout import MASK_MIN
from toolchain.compile.pass_runner import ort_run, run_passes
from toolchain.ir.graphset import GraphEntry

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler for mobc's CPU kernels")


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])  # GQA; q/k norms; sliding-window masks
def test_every_layer_becomes_one_op_and_numerics_hold(arch):
    gs, feeds = graphset_for(arch, (1, 4))
    out, rows = run_passes(gs, ["fold_constants", "attend_past_in_place", "cache_attention"], 1e-4, feeds)
    assert rows[-1]["worst"]["diff"] < 1e-5
    layers = tiny(arch, 1)[0].n_layers
    for entry in out.entries.values():
        ops = [n.op_type for n in entry.model.graph]
        assert ops.count("CacheAttention") == layers
        assert "Softmax" not in ops
        build("cache_attention").ensures(entry.model)


def _short_history(layout, valid: int) -> dict[str, np.ndarray]:
    """A cache holding `valid` committed tokens: every later slot masked, and NaN, which a kernel
    that read it would spread into the output."""
    feeds = feeds_for(layout)
    past = layout.context - layout.width
    for name in feeds:
        if name.startswith("attention_mask"):
            feeds[name][..., valid:past] = MASK_MIN
            feeds[name][..., :valid] = 0.0
    return feeds


def test_slots_the_mask_excludes_are_never_read():
    layout, model = tiny("llama", 1)
    build("attend_past_in_place")(model)
    before = GraphEntry(name="g", model=model.clone(), family="g", role="decode", width=1,
                        context=layout.context)
    feeds = _short_history(layout, valid=5)
    want = ort_run(before, feeds)  # masked slots hold finite numbers here: weight 0 in the graph
    build("cache_attention")(model)
    assert sum(n.op_type == "CacheAttention" for n in model.graph) == layout.n_layers
    past = layout.context - layout.width
    for name in feeds:
        if name.startswith(("past_key_", "past_value_")):
            axis = -1 if name.startswith("past_key_") else -2
            idx = [slice(None)] * feeds[name].ndim
            idx[axis] = slice(8, past)  # whole chunks of 8 past the history
            feeds[name][tuple(idx)] = np.nan
    got = ort_run(GraphEntry(name="g", model=model, family="g", role="decode", width=1,
                             context=layout.context), feeds)
    for key, value in want.items():
        assert np.isfinite(got[key]).all(), key
        np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-5)


def test_a_masked_gap_between_admitted_runs_is_skipped():
    """Admitted slots 0-7 and 16-23 with a masked chunk between them (a sliding window's or a tree's
    hole): the kernel computes the two runs and never reads the gap or the tail."""
    layout, model = tiny("llama", 1)
    build("attend_past_in_place")(model)
    feeds = feeds_for(layout)
    past = layout.context - layout.width
    for name in feeds:
        if name.startswith("attention_mask"):
            feeds[name][..., :past] = 0.0
            feeds[name][..., 8:16] = MASK_MIN
            feeds[name][..., 24:past] = MASK_MIN
    before = GraphEntry(name="g", model=model.clone(), family="g", role="decode", width=1,
                        context=layout.context)
    want = ort_run(before, feeds)
    build("cache_attention")(model)
    for name in feeds:
        if name.startswith(("past_key_", "past_value_")):
            axis = -1 if name.startswith("past_key_") else -2
            for gap in (slice(8, 16), slice(24, past)):
                idx = [slice(None)] * feeds[name].ndim
                idx[axis] = gap
                feeds[name][tuple(idx)] = np.nan
    got = ort_run(GraphEntry(name="g", model=model, family="g", role="decode", width=1,
                             context=layout.context), feeds)
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-5)
