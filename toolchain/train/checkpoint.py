"""Resumable training: a loop's whole state in one file, written every few minutes, read back by a rerun.

A long CPU training (the shipped draft head: ~90 minutes here) is lost to a session's end, a closed
laptop or a machine that runs out of memory. With a checkpoint the loop (loop.timed_adamw_loop) writes
the module's and the optimizer's state, the step, the losses so far and the random state of the batch
sampler every `every_seconds`, atomically (a stop mid-write leaves the last whole file); a rerun of the
same command reads it and goes on from that step with the same batches and the same lr at each step, so
it makes the model a run without a stop makes. A file of another run (other settings or data) is refused.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from toolchain.atomic import atomic_file
from toolchain.errors import MobcError


class CheckpointError(MobcError):
    """The checkpoint file cannot be resumed from."""


@dataclass
class Checkpoint:
    path: Path
    key: dict[str, Any]  # what the run is: settings and a fingerprint of its data (plain values only)
    generator: torch.Generator  # the batch sampler's: its state is where the batches go on from
    every_seconds: float = 600.0
    clock: Callable[[], float] = time.perf_counter
    saves: int = field(default=0, init=False)
    _last: float | None = field(default=None, init=False)

    def resume(self, module: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[int, list[float]]:
        """Load the file's state into `module`, `opt` and the generator; (step, losses) to go on from, or
        (0, []) when there is no file yet."""
        self._last = self.clock()
        if not self.path.is_file():
            return 0, []
        try:
            saved = torch.load(self.path, weights_only=True)
            old, step = saved["key"], int(saved["step"])
        except Exception as exc:
            raise CheckpointError(f"--checkpoint {self.path} is not a training checkpoint this command wrote "
                                  f"({type(exc).__name__}); delete it or give another path") from exc
        if old != self.key:
            diff = sorted(k for k in {*old, *self.key} if old.get(k) != self.key.get(k))
            raise CheckpointError(f"--checkpoint {self.path} holds another run's training state (it differs in "
                                  f"{', '.join(diff[:4])}); run the same command to resume it, or delete it or "
                                  "give another path to start over")
        module.load_state_dict(saved["module"])
        opt.load_state_dict(saved["optimizer"])
        self.generator.set_state(saved["generator"])
        torch.set_rng_state(saved["torch_rng"])
        return step, [float(x) for x in saved["losses"]]

    def due(self) -> bool:
        return self._last is None or self.clock() - self._last >= self.every_seconds

    def save(self, module: torch.nn.Module, opt: torch.optim.Optimizer, step: int, losses: list[float]) -> None:
        state = {"key": self.key, "step": step, "losses": torch.tensor(losses, dtype=torch.float64),
                 "module": module.state_dict(), "optimizer": opt.state_dict(),
                 "generator": self.generator.get_state(), "torch_rng": torch.get_rng_state()}
        with atomic_file(self.path) as tmp:
            torch.save(state, tmp)
        self.saves += 1
        self._last = self.clock()

    def remove(self) -> None:
        """The run finished and wrote its result: nothing is left to resume."""
        self.path.unlink(missing_ok=True)
