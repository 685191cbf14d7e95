"""mobc train forecast's trainer on a tiny model: only the m vectors learn, the base stays frozen."""

from __future__ import annotations

import numpy as np
import torch

from tests.tiny import tiny_model, tiny_tokenizer
from toolchain.train.forecast import ForecastConfig, train_forecast


def test_forecast_training_updates_only_the_embeddings():
    model = tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = ForecastConfig(seconds=60, seq_len=32, anchors=4, max_steps=3)
    emb, report = train_forecast(model, tiny_tokenizer(), 2, cfg)
    assert emb.shape == (2, model.config.hidden_size) and np.isfinite(emb).all()
    assert report["steps"] == 3 and len(report["accuracy_after"]) == 2
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.config._attn_implementation == "eager"  # the capture hook is undone
    again, _ = train_forecast(model, tiny_tokenizer(), 2, ForecastConfig(seconds=60, seq_len=32, anchors=4,
                                                                          max_steps=1), init=emb)
    assert not np.allclose(again, emb) and np.abs(again - emb).max() < 1.0  # resumed, one small step on



def test_forecast_training_lowers_the_held_out_loss():
    """40 steps (about 2 s): the forecast rows' cross-entropy on held-out stdlib files drops (measured
    6.356 -> 6.203; top-1 accuracy stays 0 on a random tiny model, so the loss is what can move)."""
    cfg = ForecastConfig(seconds=60, seq_len=32, anchors=4, max_steps=40, lr=3e-2)
    _, report = train_forecast(tiny_model("llama"), tiny_tokenizer(), 2, cfg)
    assert report["steps"] == 40
    assert report["held_out_nll_after"] < report["held_out_nll_before"] - 0.05, report
