"""GraphIndex: each tensor's producer and readers, in graph order."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from toolchain.quantize.graph_index import GraphIndex


def test_the_index_names_each_tensors_producer_and_readers_in_graph_order():
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
             helper.make_node("Add", ["a", "w"], ["b"], name="add"),
             helper.make_node("Mul", ["a", "b"], ["y"], name="mul")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
                              [numpy_helper.from_array(np.ones(2, np.float32), "w")])
    index = GraphIndex(helper.make_model(graph))
    assert index.producer["a"].name == "relu" and "x" not in index.producer
    assert [n.name for n in index.consumers["a"]] == ["add", "mul"]
    assert [n.name for n in index.consumers["w"]] == ["add"]
    assert set(index.inits) == {"w"} and index.outputs == {"y"}
    assert isinstance(index.model, onnx.ModelProto)
