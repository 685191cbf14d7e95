"""mobc's CacheAttention row kernel called directly: softmax attention over the admitted slots, a
MASK_MIN slot weighing exactly 0 (its value row never read), within 1e-6 of a float64 softmax."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from toolchain import kernels
from toolchain.artifact.layout import MASK_MIN

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler for mobc's CPU kernels")


@pytest.mark.parametrize("admitted", [5, 8, 37])
def test_masked_slots_weigh_exactly_zero(admitted):
    lib = ctypes.CDLL(str(kernels.library()))
    rng = np.random.default_rng(admitted)
    d, p, nn = 16, 64, 1
    q = rng.standard_normal(d).astype(np.float32)
    past_key = rng.standard_normal((d, p)).astype(np.float32)  # transposed, as the step graphs keep it
    past_value = rng.standard_normal((p, d)).astype(np.float32)
    new_key, new_value = rng.standard_normal((d, nn)).astype(np.float32), rng.standard_normal((nn, d)).astype(np.float32)
    mask = np.zeros(p + nn, np.float32)
    mask[admitted:p] = MASK_MIN
    past_value[admitted:] = np.nan  # masked slots, inside an admitted chunk and beyond: never read
    out, scratch = np.zeros(d, np.float32), np.zeros(p + nn, np.float32)
    ptr = ctypes.c_void_p
    fn = lib.mobc_cache_attention_row
    fn.argtypes = [ptr] * 6 + [ctypes.c_int64] * 3 + [ctypes.c_float, ptr, ptr]
    fn(q.ctypes.data, past_key.ctypes.data, new_key.ctypes.data, past_value.ctypes.data, new_value.ctypes.data,
       mask.ctypes.data, d, p, nn, ctypes.c_float(0.25), out.ctypes.data, scratch.ctypes.data)
    keys = np.concatenate([past_key[:, :admitted], new_key], 1).astype(np.float64)
    values = np.concatenate([past_value[:admitted], new_value]).astype(np.float64)
    s = q.astype(np.float64) @ keys * 0.25
    w = np.exp(s - s.max())
    ref = (w / w.sum()) @ values
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def _heads_reference(q, past_key, new_key, past_value, new_value, mask, scale):
    """float64 softmax attention of each head row over the slots the mask admits."""
    admitted = np.flatnonzero(mask[: past_key.shape[1]] > MASK_MIN / 10)
    keys = np.concatenate([past_key[:, admitted], new_key], 1).astype(np.float64)
    values = np.concatenate([past_value[admitted], new_value]).astype(np.float64)
    bias = np.concatenate([mask[admitted], mask[past_key.shape[1]:]]).astype(np.float64)
    s = q.astype(np.float64) @ keys * scale + bias
    w = np.exp(s - s.max(1, keepdims=True))
    return (w / w.sum(1, keepdims=True)) @ values


@pytest.mark.parametrize(("heads", "d", "p", "nn", "runs"), [
    (3, 64, 200, 1, [(0, 37), (120, 131)]),   # SmolLM2's group: one tile of heads, score tails of 5 and 11 slots
    (5, 32, 96, 4, [(0, 96)]),                # two head tiles (4 + 1), four new slots, a full cache
    (4, 40, 64, 1, [(8, 40)]),                # head dim no multiple of 16: the row function per head
    (1, 16, 512, 8, [(0, 3), (500, 512)]),    # one head; runs at both ends of a long cache
])
def test_every_head_of_a_group_at_once(heads, d, p, nn, runs):
    lib = ctypes.CDLL(str(kernels.library()))
    rng = np.random.default_rng(heads * 1000 + p)
    q = rng.standard_normal((heads, d)).astype(np.float32)
    past_key = rng.standard_normal((d, p)).astype(np.float32)
    past_value = rng.standard_normal((p, d)).astype(np.float32)
    new_key, new_value = rng.standard_normal((d, nn)).astype(np.float32), rng.standard_normal((nn, d)).astype(np.float32)
    mask = np.full(p + nn, MASK_MIN, np.float32)
    mask[p:] = 0.0
    for a, b in runs:
        mask[a:b] = rng.uniform(-2, 0, b - a).astype(np.float32)  # admitted, with a real additive bias
    masked = mask[:p] <= MASK_MIN / 10
    past_value[masked] = np.nan  # never read
    out = np.zeros((heads, d), np.float32)
    scratch = np.zeros(heads * (p + nn + 1), np.float32)
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn = lib.mobc_cache_attention_heads
    fn.argtypes = [ptr, i64, i64] + [ptr] * 5 + [i64] * 3 + [ctypes.c_float, ptr, i64, ptr]
    fn(q.ctypes.data, d, heads, past_key.ctypes.data, new_key.ctypes.data, past_value.ctypes.data,
       new_value.ctypes.data, mask.ctypes.data, d, p, nn, ctypes.c_float(0.125), out.ctypes.data, d,
       scratch.ctypes.data)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, _heads_reference(q, past_key, new_key, past_value, new_value, mask, 0.125),
                               rtol=1e-5, atol=1e-6)
