"""Token choice: greedy argmax or temperature sampling, and speculative acceptance.

`accept_chain` is the verification rule of speculative decoding (Leviathan et al. 2023, Chen
et al. 2023): with temperature 0 it keeps the longest prefix of drafts equal to the target's
argmax; with temperature > 0 it keeps draft x_i with probability min(1, p_i(x_i)/q_i(x_i)),
and at the first rejection samples from norm(max(0, p_i - q_i)), so every emitted token is
distributed exactly as the target's own sampling would be.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def log_partition(logits: np.ndarray) -> tuple[np.ndarray, float]:
    """(z, lse): the logits shifted by their max, as float32, and log(sum(exp(z))) from a float64 sum.

    How a draft's confidences are computed: float32 exponentials are plenty for them, and float64
    ones cost ~1 ms per 49k-token row, as much as a draft head's own call."""
    z = np.asarray(logits, np.float32) - np.max(logits)
    return z, float(np.log(np.exp(z).sum(dtype=np.float64)))


def softmax(logits: np.ndarray) -> np.ndarray:
    """softmax(logits) as float64, a draft's own confidence in its tokens (float32 exponentials, as
    log_partition, float64 sum)."""
    e = np.exp(np.asarray(logits, np.float32) - np.max(logits))
    return e.astype(np.float64) / e.sum(dtype=np.float64)


def top_probability(logits: np.ndarray) -> float:
    """softmax(logits)[argmax] = exp(-lse), without the distribution."""
    return float(np.exp(-log_partition(logits)[1]))


@dataclass
class Sampler:
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        self.rng = np.random.default_rng(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """softmax(logits / T) in float64 (sums to 1 to rounding)."""
        z = logits.astype(np.float64) / self.temperature
        z -= z.max()
        e = np.exp(z)
        return e / e.sum()

    def sample(self, probs: np.ndarray) -> int:
        return int(self.rng.choice(len(probs), p=probs))

    def pick(self, logits: np.ndarray) -> int:
        if self.greedy:
            return int(np.argmax(logits))
        return self.sample(self.probs(logits))


def accept_chain(target_logits: np.ndarray, drafts: Sequence[int], draft_probs: Sequence[np.ndarray | None],
                 sampler: Sampler) -> tuple[int, int]:
    """(number of drafts accepted, the next token) from the target's logits [len(drafts)+1, V].

    Row i of target_logits is the target's prediction after drafts[:i]; draft_probs[i] is
    q_i, the distribution drafts[i] was sampled from (unused when greedy).
    """
    for i, x in enumerate(drafts):
        if sampler.greedy:
            best = int(np.argmax(target_logits[i]))
            if best != x:
                return i, best
            continue
        p = sampler.probs(target_logits[i])
        q = draft_probs[i]
        assert q is not None, "stochastic acceptance needs the draft's distribution"
        if sampler.rng.random() * q[x] < p[x]:  # u < p/q without dividing by a tiny q
            continue
        residual = np.maximum(p - q, 0.0)
        total = residual.sum()
        # p == q up to rounding: any rejection is measure zero; fall back to p
        return i, sampler.sample(residual / total if total > 0 else p)
    return len(drafts), sampler.pick(target_logits[len(drafts)])
