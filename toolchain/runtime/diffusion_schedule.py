"""Decision rules of diffusion decoding, as pure functions over confidences (easy to test).

- `transfer_counts`: LLaDA's fixed schedule — B masked tokens over S steps, B // S per step and
  the remainder on the first steps (so every block finishes in exactly S steps).
- `low_confidence_pick`: LLaDA low-confidence remasking — unmask the k most confident masked
  positions, keep the rest masked.
- `threshold_pick`: Fast-dLLM parallel decoding — unmask every masked position whose confidence
  is above a threshold, and at least the most confident one (so each step makes progress).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def transfer_counts(n_masked: int, steps: int) -> list[int]:
    """Tokens to unmask at each of `steps` steps for `n_masked` masks (LLaDA get_num_transfer_tokens)."""
    if steps < 1:
        raise ValueError("steps must be >= 1")
    steps = min(steps, max(n_masked, 1))
    base, rem = divmod(n_masked, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


def due_now(n_masked: int, steps_left: int) -> int:
    """How many to unmask now so `n_masked` masks finish within `steps_left` steps (the schedule's head).

    Equals transfer_counts(n_masked, steps_left)[0]; recomputed every step so masks that come back
    (re-masked revisable tokens) or go early (speculation) still finish on time.
    """
    if n_masked <= 0:
        return 0
    return transfer_counts(n_masked, max(steps_left, 1))[0]


def _order(conf: np.ndarray) -> np.ndarray:
    return np.argsort(-conf, kind="stable")  # ties -> leftmost first: deterministic


def low_confidence_pick(conf: Sequence[float], k: int) -> list[int]:
    """Indices (into conf) of the k most confident masked positions."""
    c = np.asarray(conf, dtype=np.float64)
    return sorted(int(i) for i in _order(c)[: max(0, k)])


def threshold_pick(conf: Sequence[float], threshold: float, at_least: int = 1) -> list[int]:
    """Indices above the threshold, or the `at_least` most confident when none is."""
    c = np.asarray(conf, dtype=np.float64)
    if c.size == 0:
        return []
    picked = set(np.nonzero(c > threshold)[0].tolist())
    if len(picked) < at_least:
        picked |= set(_order(c)[:at_least].tolist())
    return sorted(int(i) for i in picked)


def _softmax(logits: np.ndarray, banned: Sequence[int]) -> np.ndarray:
    """Row-wise softmax of logits [n, V] in float64, banned ids given probability 0."""
    z = logits.astype(np.float64, copy=True)
    if len(banned):
        z[:, list(banned)] = -np.inf
    z -= z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def softmax_conf(logits: np.ndarray, banned: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
    """(argmax token, its probability) per row of logits [n, V], never choosing a banned id."""
    p = _softmax(logits, banned)
    tok = p.argmax(axis=1)
    return tok, p[np.arange(len(tok)), tok]


def token_prob(logits: np.ndarray, tokens: Sequence[int], banned: Sequence[int] = ()) -> np.ndarray:
    """Probability each row gives to a given token (for keep/revision checks)."""
    p = _softmax(logits, banned)
    return p[np.arange(len(tokens)), np.asarray(tokens, dtype=np.int64)]
