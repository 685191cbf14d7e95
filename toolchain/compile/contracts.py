"""What "the same numerics" means for an output whose pass relaxed it to argmax-exact.

A pass may declare outputs (PassSpec.argmax_exact_outputs) whose every row keeps the reference's
argmax and the value there, while its other entries move within a proven bound (certified_lm_head:
an int8 lm_head with the candidates rescored in float). For such an output the gated difference
is the one at each row's argmax, and a row whose argmax moved counts as infinitely different,
unless the reference itself has a near tie there (its two entries within `tie`). numpy only.
"""

from __future__ import annotations

import numpy as np


def argmax_exact_diff(ref: np.ndarray, got: np.ndarray, tie: float) -> float:
    """max over rows of |ref - got| at the argmaxes; inf when a row's argmax moved past a tie."""
    if not ref.size:
        return 0.0
    r = ref.reshape(-1, ref.shape[-1]).astype(np.float64)
    g = got.reshape(-1, got.shape[-1]).astype(np.float64)
    rows = np.arange(r.shape[0])
    want, have = r.argmax(-1), g.argmax(-1)
    if not (np.isfinite(r[rows, want]).all() and np.isfinite(g[rows, have]).all()):
        return float("inf")
    if np.any(r[rows, want] - r[rows, have] > tie):
        return float("inf")
    return float(max(np.abs(r[rows, want] - g[rows, want]).max(), np.abs(r[rows, have] - g[rows, have]).max()))
