"""DiskTensor reads fresh bytes on every access; Spill stores, dedupes and deletes what nothing uses."""

from __future__ import annotations

import os

import numpy as np
import onnx_ir as ir

from toolchain.ir import disk


def test_disk_tensor_reads_the_file_each_time(tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    (tmp_path / "w.bin").write_bytes(b"\0" * 8 + a.tobytes())
    t = disk.DiskTensor("w.bin", 8, a.nbytes, ir.DataType.FLOAT, shape=ir.Shape([3, 4]), name="w",
                        base_dir=tmp_path)
    np.testing.assert_array_equal(t.numpy(), a)
    assert t.tobytes() == a.tobytes()
    # nothing is cached (no memory map kept): a rewrite of the file shows on the next read
    (tmp_path / "w.bin").write_bytes(b"\0" * 8 + (a * 2).tobytes())
    np.testing.assert_array_equal(t.numpy(), a * 2)
    assert t.numpy() is not t.numpy()


def test_spill_dedupes_and_collects_unused_sections(tmp_path):
    spill = disk.Spill(tmp_path)
    spill.section("first")
    big = np.random.default_rng(0).standard_normal((256, 128)).astype(np.float32)
    x = spill.store("x", big)
    y = spill.store("y", big.copy())  # same bytes: same place on disk
    assert (x.location, x.offset) == (y.location, y.offset)
    np.testing.assert_array_equal(y.numpy(), big)
    spill.section("second")
    z = spill.store("z", big * 3)
    assert z.location != x.location
    spill.section("third")
    assert spill.collect([z]) > 0  # nothing points into the first section any more
    assert not (tmp_path / x.location).exists()
    assert (tmp_path / z.location).exists()
    np.testing.assert_array_equal(z.numpy(), big * 3)
    w = spill.store("w", big)  # stored again, not pointing at the deleted file
    np.testing.assert_array_equal(w.numpy(), big)
    assert spill.clear() >= 2 * big.nbytes and not list(tmp_path.iterdir())  # after emit: nothing left


def test_large_arrays_go_to_the_active_spill_only(tmp_path):
    big = np.ones((disk.SPILL_BYTES // 4,), np.float32)
    small = np.ones((8,), np.float32)
    assert not disk.is_on_disk(disk.as_tensor("b", big))  # no spill active: memory
    with disk.spilling(disk.Spill(tmp_path)) as spill:
        assert disk.is_on_disk(disk.as_tensor("b", big))
        assert not disk.is_on_disk(disk.as_tensor("s", small))
        assert disk.active() is spill
    assert disk.active() is None
    scalar = disk.as_tensor("s", np.array(2.0, np.float32))
    assert tuple(scalar.shape) == ()  # a 0-d scalar keeps its rank


def test_spill_large_moves_in_memory_initializers(tmp_path):
    model = ir.Model(ir.Graph([], [], nodes=[], name="g"), ir_version=10)
    for name, arr in {"big": np.ones((disk.SPILL_BYTES,), np.uint8), "small": np.ones(4, np.uint8)}.items():
        model.graph.register_initializer(ir.Value(name=name, shape=ir.Shape(arr.shape),
                                                  type=ir.TensorType(ir.DataType.UINT8),
                                                  const_value=ir.tensor(arr, name=name)))
    assert disk.spill_large(model, disk.Spill(tmp_path)) == 1
    assert disk.is_on_disk(model.graph.initializers["big"].const_value)
    assert not disk.is_on_disk(model.graph.initializers["small"].const_value)


def test_add_initializer_writes_large_weights_straight_to_the_spill(tmp_path):
    """Passes create weights through add_initializer: with a spill active they never sit in memory,
    so a pass rewriting every weight of a model holds one at a time."""
    from toolchain.ir.graph import add_initializer

    graph = ir.Graph([], [], nodes=[], name="g")
    big = np.arange(disk.SPILL_BYTES // 4, dtype=np.float32)
    with disk.spilling(disk.Spill(tmp_path)):
        value = add_initializer(graph, "w", big)
        again = add_initializer(graph, "w", big.copy())  # same name, same bytes: reused
    assert disk.is_on_disk(value.const_value) and again is value
    np.testing.assert_array_equal(value.const_value.numpy(), big)


def _graph_over(weights: dict[str, ir.TensorProtocol]) -> ir.Model:
    """x @ w for each weight, summed: a graph whose every initializer is one of `weights`."""
    x = ir.Value(name="x", shape=ir.Shape([1, 256]), type=ir.TensorType(ir.DataType.FLOAT))
    nodes, outs = [], []
    inits = []
    for name, tensor in weights.items():
        w = ir.Value(name=name, shape=tensor.shape, type=ir.TensorType(ir.DataType.FLOAT), const_value=tensor)
        inits.append(w)
        node = ir.Node("", "MatMul", [x, w], num_outputs=1)
        node.outputs[0].name = f"y_{name}"
        node.outputs[0].shape = ir.Shape([1, 512])
        node.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
        nodes.append(node)
        outs.append(node.outputs[0])
    graph = ir.Graph([x], outs, nodes=nodes, initializers=inits, opset_imports={"": 21})
    return ir.Model(graph, ir_version=10)


def test_emit_frees_each_spilled_tensor_once_written_and_never_the_checkpoint(tmp_path):
    """The scratch shrinks while weights.bin grows (a 8B compile cannot hold both on disk); widths
    that share a spilled tensor still get its bytes; a checkpoint tensor is never touched."""
    import onnxruntime as ort

    from toolchain.compile.emit import write_graphs
    from toolchain.ir.graphset import GraphEntry, GraphSet

    rng = np.random.default_rng(0)
    arrays = {f"w{i}": rng.standard_normal((256, 512)).astype(np.float32) for i in range(4)}
    ckpt = tmp_path / "model.safetensors"
    ckpt.write_bytes(arrays["w3"].tobytes())
    spill = disk.Spill(tmp_path / "scratch")
    spilled = {k: spill.store(k, v) for k, v in arrays.items() if k != "w3"}
    source = disk.DiskTensor(str(ckpt), 0, arrays["w3"].nbytes, ir.DataType.FLOAT, shape=ir.Shape([256, 512]),
                             name="w3")
    gs = GraphSet()
    gs.add(GraphEntry("decode", _graph_over({**spilled, "w3": source}), "decode", "decode", 1, 8))
    gs.add(GraphEntry("prefill", _graph_over(dict(spilled)), "prefill", "prefill", 4, 8))  # shares w0..w2
    scratch = next((tmp_path / "scratch").glob("spill*.bin"))
    blocks_before = os.stat(scratch).st_blocks
    out = tmp_path / "art"
    out.mkdir()
    write_graphs(out, gs, release=spill.release)
    assert os.stat(scratch).st_blocks < blocks_before / 4  # the 1.5 MB of scratch blocks are freed
    assert ckpt.read_bytes() == arrays["w3"].tobytes()  # the user's file is untouched
    x = rng.standard_normal((1, 256)).astype(np.float32)
    for name, keys in (("decode", ["w0", "w1", "w2", "w3"]), ("prefill", ["w0", "w1", "w2"])):
        got = ort.InferenceSession(str(out / f"{name}.onnx")).run(None, {"x": x})
        for k, y in zip(keys, got, strict=True):
            np.testing.assert_allclose(y, x @ arrays[k], rtol=1e-5, atol=1e-4)
    assert spill.release(source) == 0  # outside the spill: refused


def test_collect_frees_dead_tensors_inside_a_file_that_stays(tmp_path):
    """mha_to_sha replaces the export's q/k/v transposes while the rest of their scratch file lives
    on: their blocks are freed, the live neighbour still reads right, and the same bytes stored
    again are written anew (never handed out from the freed place)."""
    spill = disk.Spill(tmp_path)
    spill.section("export")
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((512, 512)).astype(np.float32) for _ in range(2))
    ta, tb = spill.store("a", a), spill.store("b", b)
    path = tmp_path / ta.location
    spill.section("next")  # the export's file is no longer the open one
    blocks = os.stat(path).st_blocks
    assert spill.collect([ta]) >= b.nbytes
    assert os.stat(path).st_blocks < blocks * 0.6
    np.testing.assert_array_equal(ta.numpy(), a)
    again = spill.store("b2", b)
    assert (again.location, again.offset) != (tb.location, tb.offset)
    np.testing.assert_array_equal(again.numpy(), b)


def test_bytes_of_the_checkpoint_are_referenced_not_written(tmp_path):
    """linear_to_conv's conv weight is the checkpoint's Linear weight again: the spill hands out the
    checkpoint's own region instead of writing a copy."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((128, 256)).astype(np.float32)
    (tmp_path / "ckpt.bin").write_bytes(b"\0" * 64 + w.tobytes())
    spill = disk.Spill(tmp_path / "scratch")
    spill.register_source(spill.adopt(tmp_path / "ckpt.bin"), 64, w.nbytes)
    conv = spill.store("conv_w", w.reshape(128, 256, 1, 1))
    assert conv.offset == 64 and conv.location.endswith("ckpt.bin") and spill.bytes_written == 0
    np.testing.assert_array_equal(conv.numpy(), w.reshape(128, 256, 1, 1))
    other = spill.store("t", np.ascontiguousarray(w.T))  # same size, other bytes: written
    assert spill.bytes_written == w.nbytes and other.location.startswith("spill")
    assert spill.release(conv) == 0  # never punches the checkpoint
