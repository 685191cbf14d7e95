"""16-bit attention products as Mul + ReduceSum or an 8-bit split (QNN HTP's 16x16 MatMul is imprecise), and the CPU
EP running a QDQ graph's arithmetic exactly (int4 blocks, uint8 x int8); both measured against numpy's QDQ arithmetic."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from toolchain.quantize.htp_precise import precise_products
from toolchain.runtime.sessions import session_options

K, N, B = 128, 48, 32


def _qdq(src: str, dst: str, bound: float, inits: list, bits: int = 16) -> list[onnx.NodeProto]:
    levels = 2**bits - 1
    dtype, zero = (np.uint16, 32768) if bits == 16 else (np.uint8, 128)
    inits += [nh.from_array(np.array(2 * bound / levels, np.float32), f"{dst}_s"),
              nh.from_array(np.array(zero, dtype), f"{dst}_z")]
    return [h.make_node("QuantizeLinear", [src, f"{dst}_s", f"{dst}_z"], [f"{dst}_q"], name=f"{dst}_Q"),
            h.make_node("DequantizeLinear", [f"{dst}_q", f"{dst}_s", f"{dst}_z"], [dst], name=f"{dst}_DQ")]


def linear_model(rows: int, bits: int = 16, seed: int = 0, int8_channels: bool = False,
                 ) -> tuple[onnx.ModelProto, np.ndarray, float]:
    """x [1, rows, K] (QDQ, `bits`) @ a weight [K, N], int4 blocks of 32 (or int8 per channel) -> QDQ
    output; returns the output's step."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, rows, K)).astype(np.float32)
    if int8_channels:
        codes = rng.integers(-127, 128, (K, N)).astype(np.int8)
        scales = rng.uniform(0.0005, 0.002, N).astype(np.float32)
        y = x @ (codes * scales)
        inits = [nh.from_array(scales, "w_scale"), nh.from_array(codes, "w_codes"),
                 nh.from_array(np.zeros(N, np.int8), "w_zero")]
        wdq = h.make_node("DequantizeLinear", ["w_codes", "w_scale", "w_zero"], ["wd"], axis=1)
    else:
        codes = rng.integers(-8, 8, (K, N)).astype(np.int8)
        scales = rng.uniform(0.005, 0.02, (K // B, N)).astype(np.float32)
        y = x @ (codes * np.repeat(scales, B, axis=0))
        inits = [nh.from_array(scales, "w_scale"), h.make_tensor("w_codes", T.INT4, [K, N], codes.flatten().tolist()),
                 h.make_tensor("w_zero", T.INT4, [K // B, N], [0] * (K // B * N))]
        wdq = h.make_node("DequantizeLinear", ["w_codes", "w_scale", "w_zero"], ["wd"], axis=0, block_size=B)
    bound = float(np.abs(y).max()) * 1.1
    nodes = [*_qdq("x", "xd", float(np.abs(x).max()), inits, bits), wdq,
             h.make_node("MatMul", ["xd", "wd"], ["y"], name="proj/MatMul"), *_qdq("y", "out", bound, inits, bits)]
    graph = h.make_graph(nodes, "linear", [h.make_tensor_value_info("x", T.FLOAT, [1, rows, K])],
                         [h.make_tensor_value_info("out", T.FLOAT, [1, rows, N])], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 21)])
    model.ir_version = 10
    return model, x, 2 * bound / (2**bits - 1)


def attention_model(rows: int, seed: int = 0) -> tuple[onnx.ModelProto, dict[str, np.ndarray], float]:
    """GQA scores: q [2, 3, rows, 64] @ k [2, 1, 64, 40] (one kv head per 3 query heads), all uint16."""
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((2, 3, rows, 64)) * 2).astype(np.float32)
    k = (rng.standard_normal((2, 1, 64, 40)) * 2).astype(np.float32)
    y = q @ k
    inits: list = []
    bound = float(np.abs(y).max()) * 1.1
    nodes = [*_qdq("q", "qd", float(np.abs(q).max()), inits), *_qdq("k", "kd", float(np.abs(k).max()), inits),
             h.make_node("MatMul", ["qd", "kd"], ["y"], name="attn/MatMul"), *_qdq("y", "out", bound, inits)]
    graph = h.make_graph(nodes, "scores", [h.make_tensor_value_info("q", T.FLOAT, list(q.shape)),
                                           h.make_tensor_value_info("k", T.FLOAT, list(k.shape))],
                         [h.make_tensor_value_info("out", T.FLOAT, list(y.shape))], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 21)])
    model.ir_version = 10
    return model, {"q": q, "k": k}, 2 * bound / 65535


def cpu(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    return sess.run(["out"], feeds)[0]


def quantized(v: np.ndarray, step: float, bits: int) -> np.ndarray:
    zero, top = 2 ** (bits - 1), 2**bits - 1
    return (np.clip(np.round(v / step) + zero, 0, top) - zero) * step


def exact_linear(model: onnx.ModelProto, x: np.ndarray, bits: int) -> np.ndarray:
    """What the QDQ linear computes in exact arithmetic (numpy float64)."""
    i = {t.name: nh.to_array(t).astype(np.float64) for t in model.graph.initializer}
    scale = i["w_scale"] if i["w_scale"].ndim == 1 else np.repeat(i["w_scale"], B, axis=0)
    x = quantized(x.astype(np.float64), float(i["xd_s"]), bits)
    return quantized(x @ (i["w_codes"] * scale), float(i["out_s"]), bits)


def rewritten(model: onnx.ModelProto, rewrite) -> tuple[onnx.ModelProto, list[dict]]:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    records = rewrite(copy)
    onnx.checker.check_model(copy)
    return copy, records


@pytest.mark.parametrize(("rows", "bits", "int8_channels"), [(1, 16, False), (5, 16, False), (3, 8, True)],
                         ids=["w4a16-decode", "w4a16-rows", "w8a8"])
def test_the_cpu_simulation_of_quantized_products_is_exact(rows, bits, int8_channels):
    model, x, step = linear_model(rows, bits, int8_channels=int8_channels)
    exact = exact_linear(model, x, bits)
    assert np.abs(cpu(model, {"x": x}) - exact).max() <= 1.01 * step  # float32 vs 64 at a rounding tie
    # onnxruntime's default fuses them into its integer kernels (measured here: 223 steps off for int4
    # blocks at 16 bits, MatMulNBits with int8 activations; 11 for uint8 x int8, AVX2's saturating
    # kernels, 138 on a 0/1 x 127 indicator weight)
    default = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    off = np.abs(default.run(["out"], {"x": x})[0] - exact).max()
    if bits == 8 and _int8_dot_products_without_saturation():
        # VNNI's vpdpbusd sums uint8 x int8 products in int32, so the fused kernel is exact here too
        # (measured on an AVX-512 VNNI EPYC: 1.9e-07); CPUs with plain AVX2 saturate in int16 (11 steps)
        assert off <= 1.01 * step
    else:
        assert off > 5 * step


def _int8_dot_products_without_saturation() -> bool:
    """x86 CPUs with VNNI (AVX-512 or AVX-VNNI), whose int8 dot products accumulate in int32."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


def test_constant_weight_linears_are_left_alone():
    model, _, _ = linear_model(1)
    assert rewritten(model, precise_products)[1] == []


@pytest.mark.parametrize("rows", [1, 4])
def test_attention_products_become_mul_reducesum_computing_the_same_function(rows):
    model, feeds, step = attention_model(rows)
    red, records = rewritten(model, precise_products)
    ops = [n.op_type for n in red.graph.node]
    assert "MatMul" not in ops and "ReduceSum" in ops and records[0]["products"] == 2 * 3 * rows * 64 * 40
    # the products carry their own 16-bit encoding: K roundings of half a product step, ~sqrt(K) in practice
    prod_step = 2 * records[0]["product_bound"] / 65535
    assert np.abs(cpu(red, feeds) - cpu(model, feeds)).max() <= step + np.sqrt(64) * prod_step


def over_budget(model: onnx.ModelProto) -> list[dict]:
    return precise_products(model, budget=0)


@pytest.mark.parametrize("rows", [1, 4])
def test_attention_products_over_the_budget_split_their_second_input_computing_the_same_function(rows):
    model, feeds, step = attention_model(rows)
    split, records = rewritten(model, over_budget)
    assert [r["form"] for r in records] == ["split"]
    assert [n.op_type for n in split.graph.node].count("MatMul") == 2
    # B_hi + B_lo hold B's 16-bit values (one step lost only at +128); the low product has its own
    # encoding: one rounding of half its step
    low_step = 2 * records[0]["low_bound"] / 65535
    assert np.abs(cpu(split, feeds) - cpu(model, feeds)).max() <= step + low_step


def _htp_steps(model: onnx.ModelProto, feeds: dict[str, np.ndarray], step: float, tmp: Path) -> float:
    from toolchain.qnn import context as qnn

    tmp.mkdir()
    onnx.save(model, tmp / "m.onnx")
    binary = qnn.build_context_binary(tmp / "m.onnx", tmp, fp16=False)
    cmp = qnn.run_and_compare(tmp / "m.onnx", binary.model, feeds, qnn.provider_options(57, 75, False))
    return cmp.max_abs["out"] / step


@pytest.mark.qnn
def test_htp_computes_attention_products_precisely_only_in_the_rewritten_forms(tmp_path):
    # measured against the CPU EP (exact here): HTP MatMul 207 steps, Mul + ReduceSum 3, split 8
    attn, feeds, step = attention_model(4)
    assert _htp_steps(attn, feeds, step, tmp_path / "matmul") > 60
    assert _htp_steps(rewritten(attn, precise_products)[0], feeds, step, tmp_path / "reduce") < 10
    assert _htp_steps(rewritten(attn, over_budget)[0], feeds, step, tmp_path / "split") < 20
    # a constant int4 block weight is fine as a MatMul (measured 21 steps): the rewrite leaves it
    model, x, step = linear_model(4)
    assert _htp_steps(model, {"x": x}, step, tmp_path / "linear") < 40
