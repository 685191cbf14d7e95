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
