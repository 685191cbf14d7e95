"""Who writes and who reads each tensor of an ONNX graph: the index the QDQ rewrites walk."""

from __future__ import annotations

import onnx


class GraphIndex:
    """A model's initializers by name, each tensor's producing node and its reading nodes (in graph
    order), and the graph's output names. Built once; a rewrite that adds nodes updates it itself."""

    def __init__(self, model: onnx.ModelProto):
        g = model.graph
        self.model = model
        self.inits = {i.name: i for i in g.initializer}
        self.producer = {o: n for n in g.node for o in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in g.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.outputs = {o.name for o in g.output}
