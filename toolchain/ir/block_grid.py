"""Block quantization grids that a float weight already sits on (GGUF Q4_0, Q4_1, Q8_0).

A GGUF source dequantized to float keeps its grid: per block of `block` input elements,
w = d*k (+ c for Q4_1's per-block minimum) with integer codes k. `fit_block_grid` recovers d, k
and c from the float weight exactly (within float32 rounding of the dequantized source), so the
quantizer (toolchain/quantize/source_grid.py) and the CPU int4 pass (passes/matmul_nbits.py)
reuse the source's own codes instead of rounding the weights a second time. numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

INT_RANGE = {"int4": (-8, 7), "int8": (-128, 127)}


@dataclass
class GridFit:
    """W[in, out] = repeat(d, block) * k + repeat(c, block) along the input axis."""

    codes: np.ndarray  # int k, [in, out]
    scale: np.ndarray  # d, [in/block, out]
    offset: np.ndarray | None  # c, [in/block, out]; None when the grid is symmetric
    dtype: str  # int4 | int8

    def symmetric(self) -> np.ndarray:
        """d*k [in, out] in float32: the part a symmetric block DequantizeLinear reproduces."""
        block = self.codes.shape[0] // self.scale.shape[0]
        return np.repeat(self.scale, block, axis=0) * self.codes.astype(np.float32)


def fit_block_grid(w: np.ndarray, block: int, dtype: str) -> GridFit | None:
    """The exact block grid of a [in, out] weight, or None when some block is off every grid.

    Per block: the symmetric grid (Q4_0/Q8_0: the largest |w| at code -8, +7 or +-127) or, for
    int4, the asymmetric one (Q4_1: block min at code 0, max at 15, so an offset). Tolerance:
    float32 rounding of the dequantized source.
    """
    rows, cols = w.shape
    if rows % block:
        return None
    lo_code, hi_code = INT_RANGE[dtype]
    b = w.astype(np.float64).reshape(rows // block, block, cols)
    amax = np.abs(b).max(1)
    tol = 1e-5 * np.maximum(amax, 1e-12)

    def fits(d: np.ndarray, k: np.ndarray, base: np.ndarray) -> np.ndarray:
        err = np.abs(k * d[:, None, :] + base[:, None, :] - b).max(1)
        return (k.min(1) >= lo_code) & (k.max(1) <= hi_code) & (err <= tol)

    codes = np.zeros(b.shape, np.int64)
    scale = np.ones(amax.shape)
    offset = np.zeros(amax.shape)
    done = np.zeros(amax.shape, bool)
    zero = np.zeros(amax.shape)
    for steps in sorted({-lo_code, hi_code}, reverse=True):
        d = np.where(amax > 0, amax / steps, 1.0)
        k = np.round(b / d[:, None, :])
        ok = fits(d, k, zero) & ~done
        codes, scale, done = np.where(ok[:, None, :], k, codes), np.where(ok, d, scale), done | ok
    if dtype == "int4" and not done.all():
        mn, mx = b.min(1), b.max(1)
        d = np.where(mx > mn, (mx - mn) / (hi_code - lo_code), 1.0)
        c = mn - lo_code * d  # w = d*q + mn = d*(q + lo_code) + (mn - lo_code*d)
        k = np.round((b - mn[:, None, :]) / d[:, None, :]) + lo_code
        ok = fits(d, k, c) & ~done
        codes, scale, done = np.where(ok[:, None, :], k, codes), np.where(ok, d, scale), done | ok
        offset = np.where(ok, c, offset)
    if not done.all():
        return None
    return GridFit(codes.reshape(rows, cols).astype(np.int8), scale.astype(np.float32),
                   offset.astype(np.float32) if offset.any() else None, dtype)
