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
