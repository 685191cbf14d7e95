"""The registry's order check: declared runs_after / runs_before constraints, one clear error."""

from __future__ import annotations

import pytest

from passes import PASSES, check_order
from passes.base import GraphPass, GraphSetPass
from toolchain.errors import PassError


def test_every_registered_pass_is_one_of_the_two_kinds():
    for name, cls in PASSES.items():
        assert issubclass(cls, GraphPass | GraphSetPass), name
        for other in (*cls.runs_after, *cls.runs_before):
            assert other in PASSES, f"{name} names an unknown pass {other!r}"


def test_a_valid_order_builds_every_pass():
    built = check_order(["fold_constants", "mha_to_sha", {"lora_inputs": {"max_rank": 4}}, "linear_to_conv",
                         "split_lm_head", {"split_parts": {"max_part_bytes": 1e6}}, "check_htp"])
    assert [p.pass_name for p in built][2:4] == ["lora_inputs", "linear_to_conv"]
    assert built[2].config.max_rank == 4


@pytest.mark.parametrize(("specs", "message"), [
    (["linear_to_conv", "mha_to_sha"], r"passes.1: mha_to_sha must run before linear_to_conv"),
    (["lora_inputs", "mha_to_sha"], r"passes.0: lora_inputs must run after mha_to_sha"),
    (["split_lm_head", "lora_inputs"], r"passes.1: lora_inputs must run before split_lm_head"),
    (["scale_rmsnorm", "rescale_residual"], r"rescale_residual must run before scale_rmsnorm"),
    (["split_parts", {"forecast_inputs": {"m": 2}}], r"forecast_inputs must run before split_parts"),
])
def test_a_wrong_order_names_both_passes_and_the_fix(specs, message):
    with pytest.raises(PassError, match=message):
        check_order(specs)
