"""mobc's MatMulQ4 CPU op, run through onnxruntime: the float model's arithmetic on 4-bit block-grid
weights (Q4_0 and Q4_1), for one row and several, any column count, one and two threads; and
MatMulQ4I16, the same product on activations rounded to int16 per block, within its proven bound."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from passes.matmul_nbits import pack_q4_kernel, unpack_q4_kernel
from toolchain import kernels
from toolchain.runtime.sessions import session_options

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler for mobc's CPU kernels")


def _model(k: int | str, n: int, rows: list, codes: np.ndarray, scales: np.ndarray, mins: np.ndarray,
           op: str = "MatMulQ4") -> bytes:
    node = helper.make_node(op, ["x", "q", "d", "m"], ["y"], domain=kernels.DOMAIN)
    graph = helper.make_graph(
        [node], "q4", [helper.make_tensor_value_info("x", TensorProto.FLOAT, rows + [k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, rows + [n])],
        [numpy_helper.from_array(pack_q4_kernel(codes), "q"), numpy_helper.from_array(scales, "d"),
         numpy_helper.from_array(mins, "m")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid(kernels.DOMAIN, 1)])
    return model.SerializeToString()


def _case(k: int, n: int, rows: list, threads: int, symmetric: bool, seed: int = 0, op: str = "MatMulQ4",
          x: np.ndarray | None = None):
    rng = np.random.default_rng(seed)
    codes = rng.integers(-8, 8, (k, n)).astype(np.int8)
    d = (rng.random((k // 32, n)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    c = np.zeros_like(d) if symmetric else (rng.random((k // 32, n)) - 0.5).astype(np.float16).astype(np.float32)
    w = np.repeat(d, 32, 0) * codes.astype(np.float32) + np.repeat(c, 32, 0)  # the float model's weight
    mins = (c.astype(np.float64) - 8 * d.astype(np.float64)).astype(np.float32)
    so = session_options(threads)
    sess = ort.InferenceSession(_model(k, n, rows, codes, np.ascontiguousarray(d.T), mins, op), so,
                                providers=["CPUExecutionProvider"])
    if x is None:
        x = rng.standard_normal(rows + [k]).astype(np.float32)
    y = sess.run(None, {"x": x})[0]
    ref = x.astype(np.float64) @ w.astype(np.float64)
    # what rounding x to int16 per block can move each output: max|x_b| / 65534 per element
    q = np.abs(np.repeat(d, 32, 0) * (codes.astype(np.float64) + 8))  # |d q|, the integer product's part
    step = np.abs(x.astype(np.float64)).reshape(-1, k // 32, 32).max(-1) / 65534  # [rows, blocks]
    bound = (step @ q.reshape(k // 32, 32, n).sum(1)).reshape(rows + [n])
    return y, ref, bound


@pytest.mark.parametrize("k,n,rows,threads,symmetric", [
    (576, 3072, [1, 1], 1, False),    # SmolLM2's gate/up on a decode row (Q4_1)
    (1536, 576, [1], 2, True),        # down_proj, Q4_0, both threads
    (64, 37, [1, 3], 1, False),       # a column count off every vector width, three rows
    (96, 130, [2, 5], 2, True),       # ten rows: the row tiles of four and a remainder
])
def test_float_arithmetic_on_block_grid_weights(k, n, rows, threads, symmetric):
    y, ref, _ = _case(k, n, rows, threads, symmetric)
    assert y.shape == tuple(rows + [n])
    err = np.abs(y - ref).max() / np.abs(ref).max()
    assert err < 1e-6, err  # float32 summation; an int8-activation kernel is ~1e-2 off


@pytest.mark.parametrize("k,n,rows,threads,symmetric", [
    (576, 3072, [1, 1], 1, False),    # gate/up on a decode row
    (1536, 576, [1], 2, True),        # down_proj, both threads
    (64, 37, [1, 3], 1, False),       # a column count off the four-column tile, three rows
    (96, 130, [2, 5], 2, True),
])
def test_int16_activations_stay_within_their_rounding_bound(k, n, rows, threads, symmetric):
    rng = np.random.default_rng(7)
    x = rng.standard_normal(rows + [k]).astype(np.float32)
    x[..., ::37] *= 40.0  # outlier channels, as RMSNorm outputs have
    x[..., :32] = 0.0     # an all-zero block: scale 0, no division by it
    y, ref, bound = _case(k, n, rows, threads, symmetric, op="MatMulQ4I16", x=x)
    assert y.shape == tuple(rows + [n])
    err = np.abs(y - ref)
    slack = 1e-6 * np.abs(ref).max()  # float32 accumulation of the block results
    assert (err <= bound + slack).all(), (err - bound).max()
    assert err.max() > 1e-6 * np.abs(ref).max()  # it does round: not the float kernel under another name


def test_pack_roundtrip_and_layout():
    rng = np.random.default_rng(1)
    codes = rng.integers(-8, 8, (64, 5)).astype(np.int8)
    packed = pack_q4_kernel(codes)
    assert packed.shape == (5, 2, 16) and packed.dtype == np.uint8
    q = unpack_q4_kernel(packed).reshape(5, 64).T.astype(np.int16) - 8
    np.testing.assert_array_equal(q, codes)
    # element 4 (k 0, lane 4) sits in word 0's second nibble, element 8 in word 0's third
    one = np.full((32, 1), -8, np.int8)
    one[4, 0], one[8, 0] = -7, -6
    np.testing.assert_array_equal(pack_q4_kernel(one)[0, 0, :4], [0x10, 0x02, 0, 0])


def test_shape_mismatch_is_an_error_not_a_crash():
    rng = np.random.default_rng(2)
    codes = rng.integers(-8, 8, (64, 8)).astype(np.int8)
    d = np.ones((8, 2), np.float32)
    sess = ort.InferenceSession(_model("K", 8, ["rows"], codes, d, np.zeros((2, 8), np.float32)),
                                session_options(1), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match="MatMulQ4"):
        sess.run(None, {"x": np.zeros((1, 96), np.float32)})  # K 96 against codes for 64


def test_portable_path_matches_the_vectorized_one():
    """The plain-C path (CPUs without AVX2) computes the same product; called directly, since this
    machine's dispatch picks the vectorized one."""
    import ctypes

    lib = ctypes.CDLL(str(kernels.library()))
    rng = np.random.default_rng(3)
    k, n, rows = 96, 21, 5
    codes = rng.integers(-8, 8, (k, n)).astype(np.int8)
    d = rng.random((n, k // 32)).astype(np.float32)
    m = rng.standard_normal((k // 32, n)).astype(np.float32)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    packed = pack_q4_kernel(codes)
    w = np.repeat(d.T, 32, 0) * (codes + 8).astype(np.float32) + np.repeat(m, 32, 0)
    outs = []
    for fn in (lib.mobc_q4_matmul_cols_portable, lib.mobc_q4_matmul_cols):
        y = np.zeros((rows, n), np.float32)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
        fn(x.ctypes.data, rows, k, packed.ctypes.data, d.ctypes.data, m.ctypes.data, n, y.ctypes.data, 0, n)
        outs.append(y)
    ref = x.astype(np.float64) @ w.astype(np.float64)
    for y in outs:
        assert np.abs(y - ref).max() / np.abs(ref).max() < 1e-6


def test_int16_portable_path_matches_the_vectorized_one():
    """Both paths compute the same exact integer dot products on the same rounded rows."""
    import ctypes

    lib = ctypes.CDLL(str(kernels.library()))
    rng = np.random.default_rng(4)
    k, n, rows = 96, 21, 3
    codes = rng.integers(-8, 8, (k, n)).astype(np.int8)
    d = rng.random((n, k // 32)).astype(np.float32)
    m = rng.standard_normal((k // 32, n)).astype(np.float32)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    xq = np.zeros((rows, k), np.int16)
    xscale, xsum = np.zeros((rows, k // 32), np.float32), np.zeros((rows, k // 32), np.float32)
    p = ctypes.c_void_p
    lib.mobc_q4_quantize_i16.argtypes = [p, ctypes.c_int64, ctypes.c_int64, p, p, p]
    lib.mobc_q4_quantize_i16(x.ctypes.data, rows, k, xq.ctypes.data, xscale.ctypes.data, xsum.ctypes.data)
    np.testing.assert_allclose(xsum, x.reshape(rows, -1, 32).sum(-1), rtol=1e-5)
    assert np.abs(xq).max() == 32767  # each block's largest element lands on the int16 range's end
    packed = pack_q4_kernel(codes)
    outs = []
    for fn in (lib.mobc_q4i16_matmul_cols_portable, lib.mobc_q4i16_matmul_cols):
        y = np.zeros((rows, n), np.float32)
        fn.argtypes = [p, p, p, ctypes.c_int64, ctypes.c_int64, p, p, p, ctypes.c_int64, p, ctypes.c_int64,
                       ctypes.c_int64]
        fn(xq.ctypes.data, xscale.ctypes.data, xsum.ctypes.data, rows, k, packed.ctypes.data, d.ctypes.data,
           m.ctypes.data, n, y.ctypes.data, 0, n)
        outs.append(y)
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5 * np.abs(outs[0]).max())
    w = np.repeat(d.T, 32, 0) * (codes + 8).astype(np.float32) + np.repeat(m, 32, 0)
    ref = x.astype(np.float64) @ w.astype(np.float64)
    assert np.abs(outs[1] - ref).max() / np.abs(ref).max() < 1e-4
