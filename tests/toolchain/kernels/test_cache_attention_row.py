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
    out, scratch = np.zeros(d, np.float32), np.zeros(3 * (p + nn), np.float32)
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


@pytest.mark.parametrize("rows,admitted", [(8, 37), (11, 200), (3, 64)])
def test_a_verify_row_equals_the_decode_step_bit_for_bit(rows, admitted):
    """Row n of one call over `rows` new tokens (a verify: new slots causal among themselves) against
    the decode step of the same token alone, its earlier tokens committed into the past slots that
    follow the prompt's: the same slots in the same order, so the same numbers, bit for bit. Blocks
    of eight rows and a remainder; speculation then verifies exactly what AR decodes."""
    lib = ctypes.CDLL(str(kernels.library()))
    rng = np.random.default_rng(rows)
    d, p = 64, 256
    q = rng.standard_normal((rows, d)).astype(np.float32)
    past_key = rng.standard_normal((d, p)).astype(np.float32)
    past_value = rng.standard_normal((p, d)).astype(np.float32)
    new_key = rng.standard_normal((d, rows)).astype(np.float32)
    new_value = rng.standard_normal((rows, d)).astype(np.float32)
    mask = np.full((rows, p + rows), MASK_MIN, np.float32)
    mask[:, :admitted] = 0.0
    mask[:, p:] = np.where(np.tril(np.ones((rows, rows), bool)), 0.0, MASK_MIN)
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn = lib.mobc_cache_attention_rows
    fn.argtypes = [i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_float, ptr, ptr]

    def call(n, q_, mask_, pk, nk, pv, nv, nn):
        out, scratch = np.zeros((n, d), np.float32), np.zeros(10 * (p + nn), np.float32)
        fn(n, q_.ctypes.data, mask_.ctypes.data, pk.ctypes.data, nk.ctypes.data, pv.ctypes.data, nv.ctypes.data,
           d, p, nn, ctypes.c_float(0.125), out.ctypes.data, scratch.ctypes.data)
        return out

    together = call(rows, q, mask, past_key, new_key, past_value, new_value, rows)
    for n in range(rows):
        pk, pv = past_key.copy(), past_value.copy()
        pk[:, admitted:admitted + n], pv[admitted:admitted + n] = new_key[:, :n], new_value[:n]  # committed
        m = np.full((1, p + 1), MASK_MIN, np.float32)
        m[0, :admitted + n], m[0, p] = 0.0, 0.0
        alone = call(1, q[n:n + 1].copy(), m, pk, np.ascontiguousarray(new_key[:, n:n + 1]), pv,
                     new_value[n:n + 1].copy(), 1)
        np.testing.assert_array_equal(together[n], alone[0])
