"""mobc's MatMulQ8I16 CPU op (the certified lm_head's first pass), run through onnxruntime: a Q8_0
[N, K] weight's product with activation blocks rounded to int16, within that rounding's proven
bound; a row's logits the same whatever rows share its call; the plain-C path the same product;
non-finite activations poison only their own row; shape mismatches are errors, not crashes."""

from __future__ import annotations

import ctypes

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from passes.certified_lm_head import STEP_FRACTION
from toolchain import kernels
from toolchain.runtime.sessions import session_options

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler for mobc's CPU kernels")


def _weights(n: int, k: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 codes [N, K/32, 32] as stored (code + 128) and float16 scales [N, K/32]"""
    codes = rng.integers(-128, 128, (n, k // 32, 32)).astype(np.int16)
    scales = (rng.random((n, k // 32)) * 0.02 + 1e-3).astype(np.float16)
    return (codes + 128).astype(np.uint8), scales


def _session(k: int | str, n: int, rows: list, codes: np.ndarray, scales: np.ndarray, threads: int = 1):
    node = helper.make_node("MatMulQ8I16", ["x", "q", "d"], ["y"], domain=kernels.DOMAIN)
    graph = helper.make_graph(
        [node], "q8", [helper.make_tensor_value_info("x", TensorProto.FLOAT, rows + [k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, rows + [n])],
        [numpy_helper.from_array(codes, "q"), numpy_helper.from_array(scales, "d")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid(kernels.DOMAIN, kernels.OPSET)])
    return ort.InferenceSession(model.SerializeToString(), session_options(threads), providers=["CPUExecutionProvider"])


def _reference(x: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x @ W^T in float64, each output's bound: sum_b max|x_b| / 65534 * |d_b| * sum|c_b|)"""
    n, nb, _ = codes.shape
    c = codes.astype(np.float64) - 128
    w = (c * scales.astype(np.float64)[..., None]).reshape(n, -1)
    x64 = x.reshape(-1, nb * 32).astype(np.float64)
    l1 = np.abs(scales.astype(np.float64)) * np.abs(c).sum(-1)  # [N, nb]
    step = np.abs(x64).reshape(-1, nb, 32).max(-1) * STEP_FRACTION["int16"]  # [rows, nb]
    return x64 @ w.T, step @ l1.T


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k,n,rows", [(64, 1030, [1]), (96, 2053, [3]), (576, 1500, [1, 5]), (64, 8, [2, 1, 9])])
def test_within_the_int16_rounding_bound(k, n, rows, threads):
    rng = np.random.default_rng(k + n)
    codes, scales = _weights(n, k, rng)
    x = rng.standard_normal(rows + [k]).astype(np.float32)
    x[..., rng.integers(0, k, 2)] *= 30  # a few massive channels, as real hidden states have
    y = _session(k, n, rows, codes, scales, threads).run(None, {"x": x})[0]
    assert y.shape == tuple(rows + [n])
    ref, bound = _reference(x, codes, scales)
    err = np.abs(y.reshape(ref.shape) - ref)
    float_slack = 1e-5 * np.abs(ref).max()  # float32 sums after the exact integer products
    assert (err <= bound + float_slack).all()
    assert err.max() > 0.01 * bound.max()  # int16 rounding really happened: the check is not vacuous


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_logits_do_not_depend_on_its_call(threads):
    """Every row of a 9-row call equals the same row computed alone, bit for bit: a verify row's
    head is the decode step's."""
    rng = np.random.default_rng(7)
    k, n = 128, 3000
    codes, scales = _weights(n, k, rng)
    x = rng.standard_normal((9, k)).astype(np.float32)
    together = _session(k, n, ["rows"], codes, scales, threads).run(None, {"x": x})[0]
    alone = _session(k, n, ["rows"], codes, scales, threads)
    for r in range(9):
        np.testing.assert_array_equal(alone.run(None, {"x": x[r : r + 1]})[0][0], together[r])


def test_a_non_finite_block_poisons_only_its_row():
    rng = np.random.default_rng(3)
    k, n = 64, 40
    codes, scales = _weights(n, k, rng)
    x = rng.standard_normal((3, k)).astype(np.float32)
    x[1, 5] = np.nan
    x[2, 40] = np.inf
    y = _session(k, n, ["rows"], codes, scales).run(None, {"x": x})[0]
    assert np.isfinite(y[0]).all() and np.isnan(y[1]).all() and np.isnan(y[2]).all()


def test_shape_mismatch_is_an_error_not_a_crash():
    rng = np.random.default_rng(2)
    codes, scales = _weights(8, 64, rng)
    sess = _session("K", 8, ["rows"], codes, scales)
    with pytest.raises(Exception, match="MatMulQ8I16: x has K=96 but the codes hold K=64"):
        sess.run(None, {"x": np.zeros((1, 96), np.float32)})


class _Weights(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("K", ctypes.c_int64), ("N", ctypes.c_int64)]


def test_portable_path_matches_the_vectorized_one():
    """The plain-C path (CPUs without AVX2): the same integer products, float sums in block order."""
    lib = ctypes.CDLL(str(kernels.library()))
    rng = np.random.default_rng(4)
    k, n, rows = 192, 70, 5
    codes, scales = _weights(n, k, rng)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = _Weights(codes.ctypes.data, scales.ctypes.data, k, n)
    p = ctypes.c_void_p
    lib.mobc_q8_row_bytes.restype = ctypes.c_size_t
    lib.mobc_q8_row_bytes.argtypes = [ctypes.c_int64]
    prepared = np.zeros(rows * lib.mobc_q8_row_bytes(k) + 64, np.uint8)
    start = -prepared.ctypes.data % 64  # the kernels read it 64-byte aligned
    buf = prepared[start:].ctypes.data
    lib.mobc_q8_prepare.argtypes = [p, ctypes.c_int64, ctypes.c_int64, p]
    lib.mobc_q8_prepare(x.ctypes.data, rows, k, buf)
    outs = []
    for fn in (lib.mobc_q8_matmul_portable, lib.mobc_q8_matmul):
        y = np.zeros((rows, n), np.float32)
        fn.argtypes = [p, ctypes.c_int64, ctypes.POINTER(_Weights), p, ctypes.c_int64, ctypes.c_int64]
        fn(buf, rows, ctypes.byref(w), y.ctypes.data, 0, n)
        outs.append(y)
    ref, bound = _reference(x, codes, scales)
    for y in outs:
        assert (np.abs(y - ref) <= bound + 1e-5 * np.abs(ref).max()).all()
    np.testing.assert_allclose(outs[0], outs[1], rtol=0, atol=2e-6 * np.abs(ref).max())
