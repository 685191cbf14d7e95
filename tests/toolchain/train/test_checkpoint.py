"""Resumable training (toolchain/train/checkpoint.py): a stopped and resumed loop ends where an unstopped one does."""

from __future__ import annotations

import pytest
import torch

from toolchain.train.checkpoint import Checkpoint, CheckpointError
from toolchain.train.loop import cosine_by_steps, timed_adamw_loop


class Stop(Exception):
    pass


def _run(path=None, stop_at: int | None = None, key: dict | None = None, steps: int = 12):
    """A small regression trained on random batches drawn from its own generator (as the head's trainer does)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    gen = torch.Generator().manual_seed(1)
    calls = []

    def step_loss() -> torch.Tensor:
        calls.append(1)
        if stop_at is not None and len(calls) == stop_at:
            raise Stop
        rows = torch.randint(64, (8,), generator=gen)
        return torch.nn.functional.mse_loss(net(x[rows]), y[rows])

    ckpt = Checkpoint(path, key or {"run": "a"}, gen, every_seconds=0.0) if path else None
    res = timed_adamw_loop(net, list(net.parameters()), step_loss, lr=1e-2, seconds=float("inf"), log=lambda _m: None,
                           label="loss", every=4, lr_at=cosine_by_steps(1e-2, steps), max_steps=steps,
                           weight_decay=0.1, checkpoint=ckpt)
    return net, res, ckpt


def test_a_run_stopped_and_resumed_ends_with_the_unstopped_runs_weights_and_losses(tmp_path):
    whole, whole_res, _ = _run()
    path = tmp_path / "state.pt"
    with pytest.raises(Stop):
        _run(path, stop_at=8)  # seven steps done and saved, the eighth never finishes
    assert path.is_file() and torch.load(path, weights_only=True)["step"] == 7
    resumed, res, ckpt = _run(path)
    assert res.steps == 12 and res.losses == whole_res.losses and ckpt.saves == 5
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_checkpoint_of_another_run_or_no_checkpoint_at_all_is_refused(tmp_path):
    path = tmp_path / "state.pt"
    with pytest.raises(Stop):
        _run(path, stop_at=3)
    with pytest.raises(CheckpointError, match="another run's training state .*differs in run"):
        _run(path, key={"run": "b"})
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="not a training checkpoint"):
        _run(path)


def test_the_file_is_written_whole_when_due_and_removed_when_asked(tmp_path):
    now = [0.0]
    ckpt = Checkpoint(tmp_path / "c.pt", {"run": "a"}, torch.Generator(), every_seconds=60.0, clock=lambda: now[0])
    net = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(net.parameters())
    assert ckpt.resume(net, opt) == (0, [])
    assert not ckpt.due()
    now[0] = 61.0
    assert ckpt.due()
    ckpt.save(net, opt, 3, [1.0, 2.0, 3.0])
    assert not ckpt.due() and [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temporary left beside it
    assert ckpt.resume(net, opt) == (3, [1.0, 2.0, 3.0])
    ckpt.remove()
    assert not (tmp_path / "c.pt").exists()
