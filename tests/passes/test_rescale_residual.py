"""rescale_residual on tiny models of every architecture: exact on CPU, the stream really scaled."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from passes import build
from passes.rescale_residual import META_KEY, residual_stream
from tests.passes.tiny import feeds_for, tiny
from toolchain.compile.pass_runner import ort_run
from toolchain.errors import PassError, RecipeError
from toolchain.ir.graphset import GraphEntry


def _run(model, layout, feeds, outputs=()):
    if outputs:
        model = model.clone()
        values = ir.convenience.create_value_mapping(model.graph)
        model.graph.outputs.extend(values[n] for n in outputs)
    entry = GraphEntry(name="g", model=model, family="g", role="decode", width=layout.width,
                       context=layout.context)
    return ort_run(entry, feeds)


def test_rescale_residual_is_exact_and_scales_the_stream(arch):
    layout, model = tiny(arch)
    feeds = feeds_for(layout)
    stream, adds, norms = residual_stream(model.graph)
    last = stream[-1].name
    before = _run(model, layout, feeds, outputs=[last])
    p = build({"rescale_residual": {"factor": 0.25}})
    assert p(model).modified  # onnx_ir runs p.ensures after call
    assert model.metadata_props[META_KEY] == "0.25"
    new_stream, new_adds, new_norms = residual_stream(model.graph)
    assert len(new_adds) == len(adds) and len(new_norms) == len(norms)
    after = _run(model, layout, feeds, outputs=[new_stream[-1].name])
    for name, _, _ in layout.outputs():
        assert np.array_equal(after[name], before[name]), name  # powers of two: bit-exact
    np.testing.assert_array_equal(after[new_stream[-1].name], before[last] * 0.25)


def test_rescale_then_scale_rmsnorm_stays_within_float_rounding():
    layout, model = tiny("gemma3")
    feeds = feeds_for(layout)
    before = _run(model, layout, feeds)
    build("rescale_residual")(model)
    build("scale_rmsnorm")(model)
    after = _run(model, layout, feeds)
    for name, ref in before.items():
        assert float(np.abs(after[name] - ref).max()) < 1e-5, name


def test_rescale_residual_rules_and_errors():
    _, model = tiny("llama")
    build("scale_rmsnorm")(model)
    with pytest.raises(PassError, match="before scale_rmsnorm"):
        build("rescale_residual")(model)
    _, model = tiny("llama")
    p = build("rescale_residual")
    assert p(model).modified and not p(model).modified  # applied once, recorded in metadata
    with pytest.raises(RecipeError, match="power of two"):
        build({"rescale_residual": {"factor": 0.3}})
