"""forecast_inputs: zero inputs are the base graph exactly; a selected row takes the bound vector."""

from __future__ import annotations

import numpy as np
import torch

from passes import build
from tests.lora_tiny import run_graph
from tests.passes.tiny import feeds_for, hf_model, tiny


def test_forecast_rows_take_the_bound_embedding(arch):
    layout, base = tiny(arch)
    feeds = feeds_for(layout)
    m = base.clone()
    build({"forecast_inputs": {"m": 2}})(m)
    zeros = {"forecast_embeds": np.zeros([2, layout.hidden], np.float32),
             "forecast_select": np.zeros([1, layout.width, 2], np.float32)}
    want = run_graph(base, feeds)
    got = run_graph(m, {**feeds, **zeros})
    for name, w in want.items():
        assert np.array_equal(got[name], w), name
    # forecast slot 1 bound to the embedding (module output, scale included) of token t at row 2
    # must equal feeding token t at row 2
    t = 7
    with torch.no_grad():
        vec = hf_model(arch).model.embed_tokens(torch.tensor([[t]]))[0, 0].numpy()
    embeds = np.zeros([2, layout.hidden], np.float32)
    embeds[1] = vec
    select = np.zeros([1, layout.width, 2], np.float32)
    select[0, 2, 1] = 1.0
    ids = feeds["input_ids"].copy()
    ids[0, 2] = t
    got = run_graph(m, {**feeds, "forecast_embeds": embeds, "forecast_select": select})
    want = run_graph(base, {**feeds, "input_ids": ids})
    np.testing.assert_allclose(got["logits"], want["logits"], atol=1e-4)
