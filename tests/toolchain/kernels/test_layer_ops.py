"""mobc's fused layer ops run through onnxruntime: QKVCacheAttention equals splitting a fused
projection into heads, rotating queries and keys as onnxruntime's RotaryEmbedding does, and attending
over the cache slots the mask admits; SiluMul equals silu(gate) * up to float32 rounding, tails and
non-finite values included; bad shapes are errors that say what is wrong."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from toolchain import kernels
from toolchain.artifact.layout import MASK_MIN
from toolchain.runtime.sessions import session_options

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler for mobc's CPU kernels")

OPSETS = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1),
          helper.make_opsetid(kernels.DOMAIN, kernels.OPSET)]


def _session(nodes, inputs, outputs, inits=(), threads=1):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
                              [numpy_helper.from_array(a, n) for n, a in inits])
    model = helper.make_model(graph, opset_imports=OPSETS)
    return ort.InferenceSession(model.SerializeToString(), session_options(threads), providers=["CPUExecutionProvider"])


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """halves-layout RoPE of x[..., N, D] with cos, sin [N, D/2] (float64)"""
    half = x.shape[-1] // 2
    lo, hi = x[..., :half], x[..., half:]
    return np.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], -1)


def _case(n, hq, g, d, p, seed=0):
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((1, n, (hq + 2 * g) * d)).astype(np.float32)
    angles = rng.uniform(0, 6.3, (n, d // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    pk = rng.standard_normal((g, 1, d, p)).astype(np.float32)
    pv = rng.standard_normal((g, 1, p, d)).astype(np.float32)
    mask = np.zeros((1, 1, n, p + n), np.float32)
    # the past slots after the last whole chunk of 8 are empty, and poisoned: a read of them spreads NaN
    # (a chunk with an admitted slot is computed whole, so only whole chunks can be skipped)
    history = (p - 1) // 8 * 8
    mask[..., history:p] = MASK_MIN
    pk[..., history:], pv[..., history:, :] = np.nan, np.nan
    for i in range(n):
        mask[0, 0, i, p + i + 1:] = MASK_MIN  # causal among the call's rows
    return {"qkv": qkv, "cos": cos, "sin": sin, "past_key": pk, "past_value": pv, "mask": mask}


def _reference(f, hq, g, d, scale):
    """(out [1, N, Hq D], new_key [G, 1, D, N], new_value [G, 1, N, D]) in float64"""
    qkv = f["qkv"][0].astype(np.float64)
    n = qkv.shape[0]
    heads = qkv.reshape(n, hq + 2 * g, d).transpose(1, 0, 2)  # [heads, N, D]
    q = _rotate(heads[:hq], f["cos"], f["sin"])
    k = _rotate(heads[hq:hq + g], f["cos"], f["sin"])
    v = heads[hq + g:]
    p = f["past_key"].shape[-1]
    admitted = f["mask"][0, 0] > -1.0
    out = np.zeros((n, hq, d))
    for h in range(hq):
        grp = h // (hq // g)
        keys = np.concatenate([f["past_key"][grp, 0].T, k[grp]], 0)  # [P + N, D]
        values = np.concatenate([f["past_value"][grp, 0], v[grp]], 0)
        for i in range(n):
            ok = admitted[i]
            s = keys[ok] @ q[h, i] * scale
            w = np.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ values[ok]
    assert p == keys.shape[0] - n
    return out.reshape(1, n, hq * d), k.transpose(0, 2, 1)[:, None], v[:, None]


QKV_INPUTS = ["qkv", "cos", "sin", "past_key", "past_value", "mask", "scale"]


def _qkv_session(f, threads=1):
    node = helper.make_node("QKVCacheAttention", QKV_INPUTS, ["out", "new_key", "new_value"], domain=kernels.DOMAIN)
    inputs = [(n, list(f[n].shape)) for n in QKV_INPUTS[:-1]]
    return _session([node], inputs, ["out", "new_key", "new_value"], [("scale", np.array([0.25], np.float32))], threads)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,hq,g,d,p", [(1, 9, 3, 64, 40), (3, 4, 2, 16, 21), (8, 6, 1, 8, 13)])
def test_qkv_attention_equals_split_rotate_attend(n, hq, g, d, p, threads):
    f = _case(n, hq, g, d, p)
    got = _qkv_session(f, threads).run(None, {k: f[k] for k in QKV_INPUTS[:-1]})
    want = _reference(f, hq, g, d, 0.25)
    for name, a, b in zip(["out", "new_key", "new_value"], got, want, strict=True):
        assert a.shape == b.shape, name
        assert np.isfinite(a).all(), f"{name}: an empty (masked) cache slot was read"
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)


def test_rotation_is_onnxruntimes_rotary_embedding():
    """The keys come out as com.microsoft RotaryEmbedding (interleaved=0) rotates them, so a graph
    fused by fuse_attention_prologue keeps the rotation its exporter chose."""
    n, g, d = 4, 2, 16
    f = _case(n, 2, g, d, 9, seed=3)
    keys = f["qkv"][0, :, 2 * d:4 * d].reshape(1, n, g, d).transpose(0, 2, 1, 3).copy()  # [1, G, N, D]
    rot = helper.make_node("RotaryEmbedding", ["k", "pos", "cos", "sin"], ["rk"], domain="com.microsoft",
                           interleaved=0)
    ort_keys = _session([rot], [("k", [1, g, n, d]), ("cos", [n, d // 2]), ("sin", [n, d // 2])], ["rk"],
                        [("pos", np.arange(n, dtype=np.int64).reshape(1, n))]).run(
        None, {"k": keys, "cos": f["cos"], "sin": f["sin"]})[0]
    new_key = _qkv_session(f).run(None, {k: f[k] for k in QKV_INPUTS[:-1]})[1]
    np.testing.assert_allclose(new_key[:, 0], ort_keys[0].transpose(0, 2, 1), rtol=1e-6, atol=1e-6)


def test_qkv_attention_rejects_a_projection_that_is_not_whole_heads():
    f = _case(2, 4, 2, 16, 9)
    f["qkv"] = f["qkv"][..., :-3].copy()  # 125 columns: not (Hq + 2G) x 16
    with pytest.raises(Exception, match="QKVCacheAttention: qkv's last axis 125"):
        _qkv_session(f).run(None, {k: f[k] for k in QKV_INPUTS[:-1]})


def _silu_session(shape, threads=1):
    node = helper.make_node("SiluMul", ["x"], ["y"], domain=kernels.DOMAIN)
    return _session([node], [("x", shape)], ["y"], threads=threads)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [[1, 1, 3072], [1, 5, 14], [7, 26]])  # tails of 7 and 5 past whole vectors of 8
def test_silu_mul_equals_silu_gate_times_up(shape, threads):
    rng = np.random.default_rng(len(shape))
    x = (rng.standard_normal(shape) * 4).astype(np.float32)
    x.reshape(-1)[:4] = [-100.0, 100.0, 0.0, -0.0]  # underflowing, saturated, zero gates
    y = _silu_session(shape, threads).run(None, {"x": x})[0]
    f = shape[-1] // 2
    gate, up = x[..., :f].astype(np.float64), x[..., f:].astype(np.float64)
    want = gate / (1 + np.exp(-gate)) * up
    assert y.shape == want.shape
    np.testing.assert_allclose(y, want, rtol=2e-6, atol=1e-30)


def test_silu_mul_keeps_non_finite_values_in_their_row():
    x = np.ones((3, 16), np.float32)
    x[1, 2] = np.nan
    x[2, 8] = np.inf  # up = inf: silu(1) * inf
    y = _silu_session([3, 16]).run(None, {"x": x})[0]
    assert np.isnan(y[1, 2]) and np.isinf(y[2, 0])
    assert np.isfinite(np.delete(y.reshape(-1), [1 * 8 + 2, 2 * 8])).all()


def test_silu_mul_rejects_an_odd_axis():
    with pytest.raises(Exception, match="SiluMul: x must be float with an even last axis"):
        _silu_session([1, 7]).run(None, {"x": np.ones((1, 7), np.float32)})
