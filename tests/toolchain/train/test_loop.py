"""The shared timed AdamW loop: same steps as the hand-written loop it replaced, logs, train/eval mode."""

from __future__ import annotations

import torch

from toolchain.train.loop import cosine_by_steps, cosine_by_time, timed_adamw_loop


def _problem(seed: int = 0):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    return net, x, y


def test_loop_matches_the_hand_written_loop_step_for_step():
    net, x, y = _problem()
    params = list(net.parameters())
    lines: list[str] = []
    modes: list[bool] = []

    def step_loss() -> torch.Tensor:
        modes.append(net.training)
        return torch.nn.functional.mse_loss(net(x), y) * 100  # large gradients: the clip acts

    res = timed_adamw_loop(
        net,
        params,
        step_loss,
        lr=0.1,
        seconds=0.3,
        log=lines.append,
        label="MSE",
        every=3,
        lr_at=lambda step: 0.1 * min(1.0, (step + 1) / 4),
    )
    assert res.steps >= 3 and len(res.losses) == res.steps and all(modes) and not net.training
    assert lines[0].startswith("step 3: MSE ") and len(lines) == res.steps // 3
    assert res.first(2) == sum(res.losses[:2]) / 2 and res.last(1) == res.losses[-1]

    ref, _, _ = _problem()  # the loop train/diffusion.py and train/draft.py had, for as many steps
    ref_params = list(ref.parameters())
    opt = torch.optim.AdamW(ref_params, lr=0.1, weight_decay=0.0)
    for step in range(res.steps):
        for g in opt.param_groups:
            g["lr"] = 0.1 * min(1.0, (step + 1) / 4)
        loss = torch.nn.functional.mse_loss(ref(x), y) * 100
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref_params, 1.0)
        opt.step()
        assert loss.item() == res.losses[step]
    for a, b in zip(params, ref_params, strict=True):
        assert torch.equal(a, b)


def test_weight_decay_shrinks_the_matrices_by_each_steps_lr_and_leaves_biases_alone():
    net, _, _ = _problem()
    before = [p.detach().clone() for p in net.parameters()]
    lrs = [0.1, 0.05, 0.2, 0.1]

    def zero_gradient() -> torch.Tensor:  # gradients of zero: Adam moves nothing, only the decay acts
        return sum(p.sum() for p in net.parameters()) * 0.0

    res = timed_adamw_loop(net, list(net.parameters()), zero_gradient, lr=0.1, seconds=60.0, log=print, label="x",
                           every=10, lr_at=lambda step: lrs[step], max_steps=len(lrs), weight_decay=0.5)
    assert res.steps == len(lrs)
    shrink = torch.prod(torch.tensor([1.0 - lr * 0.5 for lr in lrs]))
    for p, p0 in zip(net.parameters(), before, strict=True):
        expected = p0 * shrink if p.ndim >= 2 else p0
        assert torch.allclose(p, expected, atol=1e-6), p.shape


def test_no_step_when_no_time():
    net, x, y = _problem()
    res = timed_adamw_loop(
        net, list(net.parameters()), lambda: net(x).sum(), lr=0.1, seconds=0.0, log=print, label="x", every=1
    )
    assert res.steps == 0 and res.first() is None and res.last() is None and not net.training


def test_cosine_by_time_warms_up_peaks_and_decays_to_the_floor_on_the_clock():
    now = [100.0]  # the clock starts at the first call, not at construction
    lr_at = cosine_by_time(1.0, seconds=100.0, warmup=0.1, floor=0.2, clock=lambda: now[0])
    seen = {}
    for t in [0, 5, 10, 55, 100, 150]:
        now[0] = 100.0 + t
        seen[t] = lr_at(0)
    assert seen[0] == 1.0 / 64  # never a zero step
    assert abs(seen[5] - 0.5) < 1e-9 and abs(seen[10] - 1.0) < 1e-9
    assert abs(seen[55] - 0.6) < 1e-9  # halfway through the cosine: midway between 1 and the floor
    assert abs(seen[100] - 0.2) < 1e-9 and abs(seen[150] - 0.2) < 1e-9


def test_cosine_by_steps_is_the_time_schedule_counted_in_steps():
    lr_at = cosine_by_steps(1.0, steps=200, warmup=0.1, floor=0.2)
    now = [0.0]
    by_time = cosine_by_time(1.0, seconds=200.0, warmup=0.1, floor=0.2, clock=lambda: now[0])
    for step in [0, 10, 20, 110, 200, 300]:
        now[0] = float(step)
        assert abs(lr_at(step) - by_time(0)) < 1e-12, step
    assert lr_at(0) == 1.0 / 64 and abs(lr_at(20) - 1.0) < 1e-9 and abs(lr_at(110) - 0.6) < 1e-9
    assert abs(lr_at(200) - 0.2) < 1e-9 and abs(lr_at(300) - 0.2) < 1e-9


def test_reused_freed_memory_stops_the_page_faults_of_each_large_allocation():
    """In a fresh process: malloc serves a block from freed heap memory before it maps a new one, so what this
    process's other tests freed would hide the faults."""
    import subprocess
    import sys

    probe = """
import ctypes, ctypes.util, resource, sys
import torch
from toolchain.train.loop import reuse_freed_memory
name = ctypes.util.find_library("c")
if not name or not hasattr(ctypes.CDLL(name), "mallopt"):
    print("skip"); sys.exit()
libc = ctypes.CDLL(name)
def faults_of_20_activations():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        torch.ones(8 << 20).sum()  # 32 MB written, then freed, as a training step's activations are
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
libc.mallopt(-3, 128 * 1024)  # glibc's starting mmap threshold, pinned: every block is a fresh mapping
libc.mallopt(-1, 256 * 1024)
fresh = faults_of_20_activations()
pinned = reuse_freed_memory()
print(fresh, pinned, faults_of_20_activations())
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    if out == ["skip"]:
        import pytest

        pytest.skip("no glibc malloc here")
    fresh, pinned, reused = int(out[0]), out[1] == "True", int(out[2])
    assert fresh > 20 * 4000  # each 32 MB block faulted in again, ~8k pages of 4 KB each
    assert pinned and reused < fresh / 5  # the first block's pages, then the same memory again
