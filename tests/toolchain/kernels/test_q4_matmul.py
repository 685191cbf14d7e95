"""mobc's MatMulQ4 CPU op, run through onnxruntime: the float model's arithmetic on 4-bit block-grid
weights (Q4_0 and Q4_1), for one row and several, any column count, one and two threads; and
MatMulQ4I16, the same product on activations rounded to int16 per block, within its proven bound."""

from __future__ import annotations

import ctypes

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from passes.matmul_nbits import pack_q4_kernel, q4_kernel_scales, unpack_q4_kernel
from toolchain import kernels
from toolchain.runtime.sessions import session_options

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler for mobc's CPU kernels")


def _model(k: int | str, n: int, rows: list, codes: np.ndarray, d: np.ndarray, c: np.ndarray,
           op: str = "MatMulQ4") -> bytes:
    scales, offsets = q4_kernel_scales(d, c)
    node = helper.make_node(op, ["x", "q", "d", "o"], ["y"], domain=kernels.DOMAIN)
    graph = helper.make_graph(
        [node], "q4", [helper.make_tensor_value_info("x", TensorProto.FLOAT, rows + [k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, rows + [n])],
        [numpy_helper.from_array(pack_q4_kernel(codes), "q"), numpy_helper.from_array(scales, "d"),
         numpy_helper.from_array(offsets, "o")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid(kernels.DOMAIN, 1)])
    return model.SerializeToString()


def _grid(k: int, n: int, symmetric: bool, half: bool, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """codes [k, n] in -8..7 and per-block scales and offsets [k/32, n]: GGUF's float16 values, or
    float32 ones no float16 holds (the op's float32 inputs)"""
    codes = rng.integers(-8, 8, (k, n)).astype(np.int8)
    d = (rng.random((k // 32, n)) * 0.02 + 1e-3).astype(np.float32)
    c = np.zeros_like(d) if symmetric else (rng.random((k // 32, n)) - 0.5).astype(np.float32)
    if half:
        d, c = d.astype(np.float16).astype(np.float32), c.astype(np.float16).astype(np.float32)
    return codes, d, c


def _case(k: int, n: int, rows: list, threads: int, symmetric: bool, seed: int = 0, op: str = "MatMulQ4",
          x: np.ndarray | None = None, half: bool = True):
    rng = np.random.default_rng(seed)
    codes, d, c = _grid(k, n, symmetric, half, rng)
    assert (q4_kernel_scales(d, c)[0].dtype == np.float16) == half
    w = np.repeat(d, 32, 0) * codes.astype(np.float32) + np.repeat(c, 32, 0)  # the float model's weight
    so = session_options(threads)
    sess = ort.InferenceSession(_model(k, n, rows, codes, d, c, op), so, providers=["CPUExecutionProvider"])
    if x is None:
        x = rng.standard_normal(rows + [k]).astype(np.float32)
    y = sess.run(None, {"x": x})[0]
    ref = x.astype(np.float64) @ w.astype(np.float64)
    # what rounding x to int16 per block can move each output: max|x_b| / 65534 per element
    q = np.abs(np.repeat(d, 32, 0) * (codes.astype(np.float64) + 8))  # |d q|, the integer product's part
    step = np.abs(x.astype(np.float64)).reshape(-1, k // 32, 32).max(-1) / 65534  # [rows, blocks]
    bound = (step @ q.reshape(k // 32, 32, n).sum(1)).reshape(rows + [n])
    return y, ref, bound


@pytest.mark.parametrize("k,n,rows,threads,symmetric,half", [
    (576, 3072, [1, 1], 1, False, True),  # SmolLM2's gate/up on a decode row (Q4_1, GGUF's float16 scales)
    (1536, 576, [1], 2, True, True),      # down_proj, Q4_0, both threads
    (64, 36, [1, 3], 1, False, False),    # float32 scales and offsets; a task of 9 groups off every width
    (96, 132, [2, 5], 2, True, False),    # ten rows: the row tiles of four and a remainder
])
def test_float_arithmetic_on_block_grid_weights(k, n, rows, threads, symmetric, half):
    y, ref, _ = _case(k, n, rows, threads, symmetric, half=half)
    assert y.shape == tuple(rows + [n])
    err = np.abs(y - ref).max() / np.abs(ref).max()
    assert err < 1e-6, err  # float32 summation; an int8-activation kernel is ~1e-2 off


@pytest.mark.parametrize("k,n,rows,threads,symmetric,half", [
    (576, 3072, [1, 1], 1, False, True),  # gate/up on a decode row
    (1536, 576, [1], 2, True, True),      # down_proj, both threads
    (64, 36, [1, 3], 1, False, False),    # three rows, float32 scales
    (96, 132, [2, 5], 2, True, False),
])
def test_int16_activations_stay_within_their_rounding_bound(k, n, rows, threads, symmetric, half):
    rng = np.random.default_rng(7)
    x = rng.standard_normal(rows + [k]).astype(np.float32)
    x[..., ::37] *= 40.0  # outlier channels, as RMSNorm outputs have
    x[..., :32] = 0.0     # an all-zero block: scale 0, no division by it
    y, ref, bound = _case(k, n, rows, threads, symmetric, op="MatMulQ4I16", x=x, half=half)
    assert y.shape == tuple(rows + [n])
    err = np.abs(y - ref)
    slack = 1e-6 * np.abs(ref).max()  # float32 accumulation of the block results
    assert (err <= bound + slack).all(), (err - bound).max()
    assert err.max() > 1e-6 * np.abs(ref).max()  # it does round: not the float kernel under another name


def test_int16_a_non_finite_block_poisons_only_its_row():
    """A NaN escapes a block's max|x| but not its sum: the block's scale must be NaN (as for an
    infinity), so every output of its row is NaN and the other rows are untouched."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    x[1, 5] = np.nan
    x[2, 40] = np.inf
    y, _, _ = _case(64, 8, [3], 1, False, op="MatMulQ4I16", x=x)
    assert np.isfinite(y[0]).all() and np.isnan(y[1]).all() and np.isnan(y[2]).all()


@pytest.mark.parametrize("threads", [1, 2])
def test_int16_rows_do_not_depend_on_their_call(threads):
    """A verify call's row equals the one-row decode step's bit for bit: eleven rows in one call (a tile
    of eight and one of three) against each row alone, so speculation verifies what AR would decode."""
    rng = np.random.default_rng(11)
    k, n = 192, 72
    codes, d, c = _grid(k, n, False, True, rng)
    x = rng.standard_normal((11, k)).astype(np.float32)
    so = session_options(threads)
    run = {rows: ort.InferenceSession(_model(k, n, [rows], codes, d, c, "MatMulQ4I16"), so,
                                      providers=["CPUExecutionProvider"]) for rows in (1, 11)}
    together = run[11].run(None, {"x": x})[0]
    alone = np.concatenate([run[1].run(None, {"x": x[r:r + 1]})[0] for r in range(11)])
    np.testing.assert_array_equal(together, alone)


def test_pack_roundtrip_and_layout():
    rng = np.random.default_rng(1)
    codes = rng.integers(-8, 8, (64, 8)).astype(np.int8)
    packed = pack_q4_kernel(codes)
    assert packed.shape == (2, 2, 4, 16) and packed.dtype == np.uint8
    q = unpack_q4_kernel(packed).reshape(8, 64).T.astype(np.int16) - 8
    np.testing.assert_array_equal(q, codes)
    # element 4 (k 0, lane 4) sits in word 0's second nibble, element 8 in word 0's third; column 5
    # is the second column of the second group, its first block right after the first column's
    one = np.full((32, 8), -8, np.int8)
    one[4, 5], one[8, 5] = -7, -6
    np.testing.assert_array_equal(pack_q4_kernel(one)[1, 0, 1, :4], [0x10, 0x02, 0, 0])
    assert not pack_q4_kernel(one)[1, 0, 0].any()


def test_scales_are_half_only_when_every_value_is_one_exactly():
    d = np.full((2, 4), 0.01, np.float32)  # 0.01 is no float16
    assert q4_kernel_scales(d, None)[0].dtype == np.float32
    d16 = d.astype(np.float16).astype(np.float32)
    scales, offsets = q4_kernel_scales(d16, None)
    assert scales.dtype == offsets.dtype == np.float16 and scales.shape == (1, 2, 4) and not offsets.any()
    assert q4_kernel_scales(d16, d)[0].dtype == np.float32  # an offset no float16 holds


def test_shape_mismatch_is_an_error_not_a_crash():
    rng = np.random.default_rng(2)
    codes = rng.integers(-8, 8, (64, 8)).astype(np.int8)
    d = np.ones((2, 8), np.float32)
    sess = ort.InferenceSession(_model("K", 8, ["rows"], codes, d, np.zeros((2, 8), np.float32)),
                                session_options(1), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match="MatMulQ4"):
        sess.run(None, {"x": np.zeros((1, 96), np.float32)})  # K 96 against codes for 64


class _Weights(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("offsets", ctypes.c_void_p),
                ("half", ctypes.c_int), ("K", ctypes.c_int64), ("N", ctypes.c_int64)]


def _direct(half: bool, seed: int):
    """(library, weights struct and the arrays it points at, x, float64 reference) for calling the C
    paths directly: this machine's dispatch picks the vectorized ones, the tests compare both."""
    lib = ctypes.CDLL(str(kernels.library()))
    rng = np.random.default_rng(seed)
    k, n, rows = 96, 20, 5
    codes, d, c = _grid(k, n, False, half, rng)
    packed = pack_q4_kernel(codes)
    scales, offsets = q4_kernel_scales(d, c)
    keep = (packed, scales, offsets)
    w = _Weights(packed.ctypes.data, scales.ctypes.data, offsets.ctypes.data, int(half), k, n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    ref = x.astype(np.float64) @ (np.repeat(d, 32, 0) * codes + np.repeat(c, 32, 0)).astype(np.float64)
    return lib, w, keep, x, ref


@pytest.mark.parametrize("half", [True, False])
def test_portable_path_matches_the_vectorized_one(half):
    """The plain-C path (CPUs without AVX2) computes the same product, float16 scales included."""
    lib, w, _keep, x, ref = _direct(half, 3)
    rows, k = x.shape
    xsum = x.reshape(rows, -1, 32).sum(-1).astype(np.float32)
    p = ctypes.c_void_p
    outs = []
    for fn in (lib.mobc_q4_matmul_portable, lib.mobc_q4_matmul):
        y = np.zeros((rows, w.N), np.float32)
        fn.argtypes = [p, p, ctypes.c_int64, ctypes.POINTER(_Weights), p, ctypes.c_int64, ctypes.c_int64]
        fn(x.ctypes.data, xsum.ctypes.data, rows, ctypes.byref(w), y.ctypes.data, 0, w.N // 4)
        outs.append(y)
    for y in outs:
        assert np.abs(y - ref).max() / np.abs(ref).max() < 1e-6


@pytest.mark.parametrize("half", [True, False])
def test_int16_portable_path_matches_the_vectorized_one(half):
    """Both paths compute the same exact integer dot products on the same rounded rows."""
    lib, w, _keep, x, ref = _direct(half, 4)
    rows, k = x.shape
    p = ctypes.c_void_p
    rounded = []
    for quantize in (lib.mobc_q4_quantize_i16_portable, lib.mobc_q4_quantize_i16):
        got = (np.zeros((rows, k), np.int16), np.zeros((rows, k // 32), np.float32), np.zeros((rows, k // 32), np.float32))
        quantize.argtypes = [p, ctypes.c_int64, ctypes.c_int64, p, p, p]
        quantize(x.ctypes.data, rows, k, *(a.ctypes.data for a in got))
        rounded.append(got)
    np.testing.assert_array_equal(rounded[0][0], rounded[1][0])  # the same round-to-nearest-even
    np.testing.assert_array_equal(rounded[0][1], rounded[1][1])
    xq, xscale, xsum = rounded[1]
    np.testing.assert_allclose(xsum, x.reshape(rows, -1, 32).sum(-1), rtol=1e-5)
    assert np.abs(xq).max() == 32767  # each block's largest element lands on the int16 range's end
    outs = []
    for fn in (lib.mobc_q4i16_matmul_portable, lib.mobc_q4i16_matmul):
        y = np.zeros((rows, w.N), np.float32)
        fn.argtypes = [p, p, p, ctypes.c_int64, ctypes.POINTER(_Weights), p, ctypes.c_int64, ctypes.c_int64]
        fn(xq.ctypes.data, xscale.ctypes.data, xsum.ctypes.data, rows, ctypes.byref(w), y.ctypes.data, 0, w.N // 4)
        outs.append(y)
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5 * np.abs(outs[0]).max())
    assert np.abs(outs[1] - ref).max() / np.abs(ref).max() < 1e-4
