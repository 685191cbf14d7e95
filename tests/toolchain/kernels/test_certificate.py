"""mobc.cpu CertifyArgmax against a numpy statement of the certificate (passes/certified_lm_head.py):
the S + 1 best first-pass logits ranked by value then lower index, the K best rescored on the float
table, each row either certified (its candidates' exact logits written into the first pass's) or
given its float logits over the whole vocabulary."""

from __future__ import annotations

import ctypes

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from toolchain import kernels
from toolchain.runtime.sessions import session_options

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler for mobc's CPU kernels")

NAMES = ("approx", "x", "table", "token_bound", "worst_bound", "settings")


def _session() -> ort.InferenceSession:
    node = helper.make_node("CertifyArgmax", list(NAMES), ["logits"], domain=kernels.DOMAIN)
    graph = helper.make_graph([node], "certify", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in NAMES],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(kernels.DOMAIN, kernels.OPSET)])
    return ort.InferenceSession(model.SerializeToString(), session_options(2), providers=["CPUExecutionProvider"])


def _reference(approx, x, table, token_bound, worst, k, s, pad):
    """Per row: (certified, the expected logits)."""
    rows = []
    for a, xr in zip(approx, x, strict=True):
        order = sorted(range(len(a)), key=lambda j: (-a[j], j))[: s + 1]
        exact = table[order[:k]].astype(np.float64) @ xr
        amax = np.abs(xr.reshape(len(worst), -1)).max(1)
        screened = [a[j] + token_bound[j] @ amax for j in order[k:s]]
        rival = max(max(screened), a[order[s]] + worst @ amax) + pad
        if rival < exact.max():
            y = a.copy()
            y[order[:k]] = exact
            rows.append((True, y))
        else:
            rows.append((False, table.astype(np.float64) @ xr))
    return rows


def _case(rng, rows=4, vocab=300, width=64, noise=0.02):
    table = rng.standard_normal((vocab, width)).astype(np.float32) * 0.3
    x = rng.standard_normal((rows, width)).astype(np.float32)
    exact = x @ table.T
    approx = (exact + rng.uniform(-noise, noise, exact.shape)).astype(np.float32)
    nb = 2
    amax_min = np.abs(x.reshape(rows, nb, -1)).max(2).sum(1).min()
    token_bound = np.full((vocab, nb), noise / amax_min, np.float32)  # a bound that holds for every token
    token_bound[: vocab // 2] *= 0.5  # and differs between tokens, so the screened ones' own bounds matter
    return approx, x, table, token_bound, token_bound.max(0)


def _run(sess, approx, x, table, token_bound, worst, k, s, pad):
    feeds = dict(zip(NAMES, (approx, x, table, token_bound, worst, np.array([k, s, pad], np.float32)), strict=True))
    return sess.run(None, feeds)[0]


def test_each_row_is_certified_or_float_as_the_reference_says():
    rng = np.random.default_rng(0)
    sess = _session()
    seen = set()
    for pad in (1e-3, 0.3, 0.6, 1.0, 1e9):  # from every row certified to none
        approx, x, table, token_bound, worst = _case(rng, rows=6)
        got = _run(sess, approx, x, table, token_bound, worst, 8, 40, pad)
        for row, (certified, want) in enumerate(_reference(approx, x, table, token_bound, worst, 8, 40, pad)):
            seen.add(certified)
            np.testing.assert_allclose(got[row], want, rtol=0, atol=1e-5)
            if certified:  # off the candidates the first pass's values, bit for bit
                assert np.sum(got[row] != approx[row]) <= 8
            assert got[row].argmax() == (x[row] @ table.T).argmax()
    assert seen == {True, False}


def test_equal_approximations_rank_the_lower_index_first():
    """A row of equal first-pass logits: the candidates are tokens 0..K-1 (ONNX TopK's order), so the
    exact logits land there; a heap that kept the later ones would write them at the end."""
    rng = np.random.default_rng(1)
    sess = _session()
    approx, x, table, token_bound, worst = _case(rng, rows=1)
    table[0] = x[0] * 5.0  # token 0 the clear winner, well beyond every bound
    approx[:] = 0.0
    got = _run(sess, approx, x, table, token_bound, worst, 4, 20, 1e-3)[0]
    np.testing.assert_allclose(got[:4], table[:4] @ x[0], rtol=1e-5)
    assert (got[4:] == 0.0).all()


def test_a_row_holding_a_nan_gets_its_float_logits_and_the_others_do_not():
    rng = np.random.default_rng(2)
    sess = _session()
    approx, x, table, token_bound, worst = _case(rng, rows=3)
    approx[1, 17] = np.nan
    got = _run(sess, approx, x, table, token_bound, worst, 8, 40, 1e-3)
    np.testing.assert_allclose(got[1], x[1] @ table.T, rtol=0, atol=1e-5)
    for row in (0, 2):
        assert np.sum(got[row] != approx[row]) <= 8


@pytest.mark.parametrize("settings", [(8, 8, 0.0), (0, 10, 0.0), (8, 300, 0.0), (2.5, 10, 0.0)])
def test_settings_out_of_range_are_refused_with_the_rule(settings):
    rng = np.random.default_rng(3)
    approx, x, table, token_bound, worst = _case(rng, rows=1)
    with pytest.raises(Exception, match=r"settings must be \(K, S, pad\) with 1 <= K < S < V = 300"):
        _run(_session(), approx, x, table, token_bound, worst, *settings)


def test_a_token_past_the_screened_ones_is_covered_by_the_widest_bound():
    """The true winner ranks last in the first pass, which is that far off only on it (its bound is
    wide): the tokens past rank S share the widest bound, so the row cannot be certified and gets
    its float logits, whose argmax is that token."""
    rng = np.random.default_rng(4)
    sess = _session()
    approx, x, table, token_bound, worst = _case(rng, rows=1)
    winner = 250
    table[winner] = x[0] * 2.0
    approx[0, winner] = approx[0].min() - 1.0  # the first pass ranks it last
    token_bound[:] = 1e-6
    token_bound[winner] = 1e3
    got = _run(sess, approx, x, table, token_bound, token_bound.max(0), 4, 20, 1e-3)[0]
    assert got.argmax() == winner
    np.testing.assert_allclose(got, table @ x[0], rtol=1e-5, atol=1e-5)


class _Certificate(ctypes.Structure):
    _fields_ = [("table", ctypes.c_void_p), ("token_bound", ctypes.c_void_p), ("worst_bound", ctypes.c_void_p),
                ("V", ctypes.c_int64), ("C", ctypes.c_int64), ("nb", ctypes.c_int64), ("K", ctypes.c_int64),
                ("S", ctypes.c_int64), ("pad", ctypes.c_float)]


def test_the_plain_c_path_decides_as_the_vectorized_one():
    """What a CPU without AVX2 runs (the scan and the dots in plain C) against what this one runs:
    the same rows certified, the same candidates rescored, logits within float32 rounding."""
    lib = ctypes.CDLL(str(kernels.library()))
    paths = [getattr(lib, name) for name in ("mobc_certify_row", "mobc_certify_row_portable")]
    for fn in paths:
        fn.argtypes, fn.restype = [ctypes.POINTER(_Certificate)] + [ctypes.c_void_p] * 4, ctypes.c_int
    rng = np.random.default_rng(5)
    k, s = 8, 40
    decided = set()
    for pad in (1e-3, 0.5, 1e9):
        approx, x, table, token_bound, worst = _case(rng, rows=5)
        approx[4, 3] = np.nan  # a NaN row: refused by both
        spec = _Certificate(table.ctypes.data, token_bound.ctypes.data, worst.ctypes.data, table.shape[0],
                            table.shape[1], worst.size, k, s, pad)
        scratch = np.zeros((s + 1) * 8 + k * 4, np.uint8)
        for row in range(len(x)):
            got = []
            for fn in paths:
                y = np.empty_like(approx[row])
                ok = fn(ctypes.byref(spec), x[row].ctypes.data, approx[row].ctypes.data, y.ctypes.data, scratch.ctypes.data)
                got.append((ok, y))
            (ok_v, y_v), (ok_p, y_p) = got
            assert ok_v == ok_p, (pad, row)
            decided.add(ok_v)
            changed = np.flatnonzero(~((y_v == approx[row]) | np.isnan(approx[row])))
            assert np.array_equal(changed, np.flatnonzero(~((y_p == approx[row]) | np.isnan(approx[row]))))
            np.testing.assert_allclose(y_p, y_v, rtol=1e-6, atol=1e-6)
    assert decided == {0, 1}
