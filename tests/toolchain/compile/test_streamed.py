"""The streamed torch reference: transformers' own forward, one module's weights in memory at a time."""

from __future__ import annotations

import pytest
import torch

from tests.passes.tiny import hf_model
from toolchain.compile.streamed import streamed_model, units
from toolchain.compile.weight_store import WeightStore


def _resident_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_streamed_forward_and_generate_match_and_hold_one_unit(arch, tmp_path):
    real = hf_model(arch)
    real.save_pretrained(tmp_path)
    model = streamed_model(real.config, WeightStore.of_folder(tmp_path))
    assert _resident_bytes(model) == 0
    peak = []
    for _, unit in units(model):
        unit.register_forward_hook(lambda m, a, o: peak.append(_resident_bytes(model)))
    ids = torch.tensor([[3, 17, 42, 5, 99, 7]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, real(ids).logits, rtol=0, atol=0)
    largest = max(sum(p.numel() * 4 for p in u.parameters()) for _, u in units(real))
    assert max(peak) <= largest  # one unit at a time, never the model
    assert _resident_bytes(model) == 0
    kw = dict(max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(ids))
    assert torch.equal(model.generate(ids, **kw), real.generate(ids, **kw))
