"""matmul_nbits on tiny graphs whose weights were put on GGUF grids (Q4_1 linears, Q4_0, a Q8_0 tied
lm_head): every projection becomes MatMulNBits with exactly the source's codes, and the graph
computes what the float graph computes."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from passes import build
from passes.matmul_nbits import pack_codes, unpack_codes
from tests.passes.tiny import graphset_for
from toolchain.compile.pass_runner import run_passes
from toolchain.ir.graph import const_array


def _q4_1(w: np.ndarray, block: int = 32) -> np.ndarray:
    b = w.reshape(-1, block, w.shape[1])
    mn = b.min(1, keepdims=True).astype(np.float16).astype(np.float32)
    d = ((b.max(1, keepdims=True) - mn) / 15).astype(np.float16).astype(np.float32)
    d[d == 0] = 1.0
    return (d * np.clip(np.round((b - mn) / d), 0, 15) + mn).reshape(w.shape)


def _q4_0(w: np.ndarray, block: int = 32) -> np.ndarray:
    b = w.reshape(-1, block, w.shape[1])
    d = (np.abs(b).max(1, keepdims=True) / 8).astype(np.float16).astype(np.float32)
    return (d * np.clip(np.round(b / d), -8, 7)).reshape(w.shape)


def _q8_0(w: np.ndarray, block: int = 32) -> np.ndarray:
    b = w.reshape(-1, block, w.shape[1])
    d = (np.abs(b).max(1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    return (d * np.round(b / d)).reshape(w.shape)


def _on_grids(gs) -> dict[str, str]:
    """Puts every constant MatMul weight on a grid (alternating Q4_1 / Q4_0), the tied embedding on
    Q8_0 (along its hidden axis, as GGUF stores it); returns weight name -> grid."""
    grids = {}
    for entry in gs.entries.values():
        for i, node in enumerate(n for n in entry.model.graph if n.op_type == "MatMul"):
            w = node.inputs[1]
            arr = const_array(w)
            if arr is not None and arr.ndim == 2 and w.is_initializer():
                q = _q4_1(arr) if i % 2 == 0 else _q4_0(arr)
                grids[w.name] = "q4_1" if i % 2 == 0 else "q4_0"
                w.const_value = ir.tensor(q.astype(np.float32), name=w.name)
            elif arr is None and w.producer() is not None and w.producer().op_type == "Transpose":
                e = w.producer().inputs[0]  # tied lm_head: E [V, C], blocks along C
                grids[e.name] = "q8_0"
                e.const_value = ir.tensor(_q8_0(const_array(e).T).T.copy(), name=e.name)
    return grids


def test_pack_roundtrip():
    rng = np.random.default_rng(0)
    for bits, lo, hi in ((4, -8, 7), (8, -128, 127)):
        codes = rng.integers(lo, hi + 1, size=(64, 24)).astype(np.int8)
        packed = pack_codes(codes, bits, 32)
        assert packed.shape == (24, 2, 32 * bits // 8)
        q = unpack_codes(packed, bits).reshape(24, 64).T.astype(np.int16) - (1 << (bits - 1))
        np.testing.assert_array_equal(q, codes)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # untied head; tied (Transpose of the embedding)
def test_grid_weights_become_matmulnbits_and_numerics_hold(arch):
    gs, feeds = graphset_for(arch, (1, 4))
    grids = _on_grids(gs)
    assert {"q4_1", "q4_0"} <= set(grids.values())
    out, rows = run_passes(gs, ["fold_constants", {"matmul_nbits": {"int8": True}}], 1e-4, feeds)
    row = rows[-1]
    assert row["worst"]["diff"] < 1e-4  # the pass runner compared every output with the float graph
    p = build({"matmul_nbits": {"int8": True}})
    for entry in out.entries.values():
        p.ensures(entry.model)
        ops = [n.op_type for n in entry.model.graph]
        # every projection and the tied lm_head: none of their float MatMuls remain
        assert ops.count("MatMulNBits") >= 7 * (3 if arch == "gemma3" else 2) + 1
        bits = {n.attributes["bits"].value for n in entry.model.graph if n.op_type == "MatMulNBits"}
        assert bits == ({4, 8} if "q8_0" in grids.values() else {4})  # Q8_0: the tied lm_head
        assert ops.count("ReduceSum") >= 1  # Q4_1's offset branch
    assert row["weight_bytes_after"] < row["weight_bytes_before"] / 3


def test_exact_codes_not_a_second_rounding():
    """The MatMulNBits weight dequantizes to the source weight bit for bit (Q4_0: w = d*(q-8))."""
    gs, feeds = graphset_for("llama", (4,))
    entry = next(iter(gs.entries.values()))
    node = next(n for n in entry.model.graph if n.op_type == "MatMul" and const_array(n.inputs[1]) is not None)
    w = _q4_0(const_array(node.inputs[1]))
    node.inputs[1].const_value = ir.tensor(w, name=node.inputs[1].name)
    name = node.name
    build("matmul_nbits").call(entry.model)
    nb = next(n for n in entry.model.graph if n.op_type == "MatMulNBits" and n.name.startswith(name.rpartition("/")[0]))
    q = unpack_codes(const_array(nb.inputs[1]), 4).astype(np.float32) - 8  # [O, blocks, 32]
    d = const_array(nb.inputs[2]).reshape(q.shape[0], q.shape[1], 1)
    np.testing.assert_array_equal((d * q).reshape(q.shape[0], -1).T, w)


def test_weights_on_no_grid_stay_float():
    gs, feeds = graphset_for("llama", (4,))
    entry = next(iter(gs.entries.values()))
    assert not build("matmul_nbits").call(entry.model).modified  # random weights: nothing to convert


@pytest.mark.parametrize("bits", [8, 4])
def test_round_bits_puts_off_grid_weights_on_the_nearest_grid_point(bits):
    """A draft head's float weights: rounded once to a symmetric block grid (each weight within half a
    step of its own, the block's largest at its grid's end), then run like any grid weight."""
    from passes.matmul_nbits import round_to_grid

    rng = np.random.default_rng(5)
    w = rng.standard_normal((96, 40)).astype(np.float32)
    w[:32, 3] = 0.0  # an all-zero block: scale 0, codes 0, no division by it
    fit = round_to_grid(w, 32, bits)
    top = (1 << (bits - 1)) - 1
    step = np.repeat(fit.scale, 32, 0)
    assert np.abs(fit.codes).max() == top and fit.offset is None
    assert (np.abs(fit.symmetric() - w) <= step / 2 * (1 + 1e-6)).all()
    assert (fit.symmetric()[:32, 3] == 0).all()
    gs, feeds = graphset_for("llama", (1, 4))
    cfg = {"matmul_nbits": {"int8": True, "accuracy_level": 4, "round_bits": bits}}
    out, rows = run_passes(gs, ["fold_constants", cfg], 1.0, feeds)
    for entry in out.entries.values():
        build(cfg).ensures(entry.model)
        assert not [n for n in entry.model.graph if n.op_type == "MatMul" and const_array(n.inputs[1]) is not None]
        assert {n.attributes["bits"].value for n in entry.model.graph if n.op_type == "MatMulNBits"} == {bits}
    assert 0 < rows[-1]["worst"]["diff"] < 1.0  # a second rounding moves the outputs, within the recipe's bound


def test_checks_run_the_kernels_the_runtime_runs():
    """accuracy_level 4 (int8 activations) is what onnxruntime runs with prepacked weights; the pass
    check must see that change, not the float fallback an unpacked session computes."""
    from toolchain.errors import PassError

    gs, feeds = graphset_for("llama", (4,))
    _on_grids(gs)
    _, rows = run_passes(gs, ["fold_constants", "matmul_nbits"], 1e-4, feeds)
    assert rows[-1]["worst"]["diff"] < 1e-4  # level 0: the float graph's numbers
    gs, feeds = graphset_for("llama", (4,))
    _on_grids(gs)
    with pytest.raises(PassError, match="matmul_nbits"):
        run_passes(gs, ["fold_constants", {"matmul_nbits": {"accuracy_level": 4}}], 1e-4, feeds)


def _level_and_rows(entry) -> list[tuple[int, int]]:
    return [(n.attributes["accuracy_level"].value, int(n.inputs[0].shape[-2]))
            for n in entry.model.graph if n.op_type == "MatMulNBits"]


def test_split_rows_run_the_int8_kernel_at_float_precision():
    """split_rows: a one-row graph's projections feed the int8 kernel (level 4) three int8-exact rows
    per row and stay within float32 rounding of the float graph; a wider graph keeps level 0."""
    gs, feeds = graphset_for("llama", (1, 4))
    _on_grids(gs)
    out, rows = run_passes(gs, ["fold_constants", {"matmul_nbits": {"split_rows": 1}}], 1e-4, feeds)
    assert rows[-1]["worst"]["diff"] < 2e-5  # level 4 alone is ~1e-2 off on these graphs
    by_width = {e.model.graph.inputs[0].shape[-1]: e for e in out.entries.values()}
    assert set(_level_and_rows(by_width[1])) == {(4, 3)}  # int8 kernel, hi/mid/lo rows
    assert {lv for lv, _ in _level_and_rows(by_width[4])} == {0}  # 4 rows: level 0's float path


def test_split_parts_are_on_the_kernels_grid():
    """hi and mid are exactly what the kernel's int8 quantization reproduces (scale = block max/127),
    and hi + mid + lo is x: the kernel rounds nothing but the remainder."""
    import onnxruntime as ort

    from passes.activation_split import blocked_view, split_rows

    rng = np.random.default_rng(1)
    x_np = (rng.standard_normal((1, 2, 64)) * np.where(rng.random(64) < 0.05, 300, 1)).astype(np.float32)
    x_np[0, 1, :32] = 0  # an all-zero block: no NaN
    x = ir.Value(name="x", shape=ir.Shape([1, 2, 64]), type=ir.TensorType(ir.DataType.FLOAT))
    graph = ir.Graph([x], [], nodes=[], opset_imports={"": 21}, name="g")
    anchor = ir.Node("", "Identity", [x], name="anchor")
    graph.append(anchor)
    parts = split_rows(graph, anchor, blocked_view(graph, anchor, x, [1, 2], 64, 32, "t"), [1, 2], 64, "t")
    graph.outputs.append(parts)
    graph.remove(anchor, safe=True)
    sess = ort.InferenceSession(ir.to_proto(ir.Model(graph, ir_version=10)).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    got = sess.run(None, {"x": x_np})[0].reshape(3, 2, 2, 32)  # part, row, block, value
    hi, mid, lo = got
    total = hi.astype(np.float64) + mid + lo  # x, up to the float32 rounding of the two subtractions
    np.testing.assert_allclose(total, x_np.reshape(2, 2, 32), rtol=2.5e-7, atol=1e-12)
    assert np.isfinite(got).all()
    for part in (hi, mid):
        scale = np.abs(part).max(-1, keepdims=True) / 127
        codes = np.divide(part, scale, out=np.zeros_like(part), where=scale > 0)
        np.testing.assert_allclose(codes, np.round(codes), atol=1e-4)  # integer codes on the block's grid
        assert np.abs(np.round(codes)).max() <= 127
    block_max = np.abs(x_np.reshape(2, 2, 32)).max(-1, keepdims=True)
    assert (np.abs(lo) <= block_max / (127 * 508) * 1.01).all()  # |lo| <= s0 / 508 = max|x_b| / 64516


def test_split_rows_sum_the_parts_of_several_rows():
    """A graph of several rows under split_rows: each row's three parts are summed back to its own row."""
    gs, feeds = graphset_for("llama", (4,))
    _on_grids(gs)
    out, rows = run_passes(gs, ["fold_constants", {"matmul_nbits": {"split_rows": 4}}], 1e-4, feeds)
    assert rows[-1]["worst"]["diff"] < 2e-5
    assert set(_level_and_rows(next(iter(out.entries.values())))) == {(4, 12)}


def test_kernel_rows_run_mobcs_exact_int4_op():
    """kernel_rows: a one-row graph's int4 projections (Q4_0 and Q4_1) become mobc's MatMulQ4 with
    the Q4_1 offset inside the op, within float32 rounding of the float graph; a wider graph keeps
    MatMulNBits at level 0."""
    from toolchain import kernels

    if not kernels.available():
        pytest.skip("no C compiler for mobc's CPU kernels")
    gs, feeds = graphset_for("llama", (1, 4))
    int4 = sum(g != "q8_0" for g in _on_grids(gs).values())  # every projection and the untied head
    out, rows = run_passes(gs, ["fold_constants", {"matmul_nbits": {"kernel_rows": 1}}], 1e-4, feeds)
    assert rows[-1]["worst"]["diff"] < 2e-5
    by_width = {e.model.graph.inputs[0].shape[-1]: e for e in out.entries.values()}
    one = [n for n in by_width[1].model.graph]
    assert sum(n.op_type == "MatMulQ4" and n.domain == kernels.DOMAIN for n in one) == int4
    assert not any(n.op_type in ("MatMulNBits", "ReduceSum") for n in one)  # no offset branch left
    assert {lv for lv, _ in _level_and_rows(by_width[4])} == {0}
    assert not any(n.op_type == "MatMulQ4" for n in by_width[4].model.graph)
    build({"matmul_nbits": {"kernel_rows": 1}}).ensures(by_width[1].model)


def test_kernel_activations_int16_run_the_int16_op():
    """kernel_activations: int16 makes the same projections MatMulQ4I16: each activation block rounded
    to int16, so the graph moves by about 1e-4 of its outputs' range where MatMulQ4 moves 1e-7."""
    from toolchain import kernels

    if not kernels.available():
        pytest.skip("no C compiler for mobc's CPU kernels")
    gs, feeds = graphset_for("llama", (1,))
    int4 = sum(g != "q8_0" for g in _on_grids(gs).values())
    spec = {"matmul_nbits": {"kernel_rows": 1, "kernel_activations": "int16"}}
    out, rows = run_passes(gs, ["fold_constants", spec], 1e-2, feeds)
    assert 1e-6 < rows[-1]["worst"]["diff"] < 1e-3
    ops = [n.op_type for n in out.entries["decode"].model.graph if n.domain == kernels.DOMAIN]
    assert ops.count("MatMulQ4I16") == int4 and "MatMulQ4" not in ops
    build(spec).ensures(out.entries["decode"].model)


def test_a_column_count_off_the_kernels_groups_keeps_matmulnbits():
    """MatMulQ4 packs columns in groups of four: a projection of 6 columns stays MatMulNBits."""
    from onnx import TensorProto, helper, numpy_helper

    from toolchain import kernels

    if not kernels.available():
        pytest.skip("no C compiler for mobc's CPU kernels")
    w = _q4_0(np.random.default_rng(0).standard_normal((64, 6)).astype(np.float32))
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="proj/MatMul")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 6])],
                              [numpy_helper.from_array(w, "w")])
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    assert build({"matmul_nbits": {"kernel_rows": 1}})(model).modified
    assert [n.op_type for n in model.graph] == ["MatMulNBits"]
