"""Export: the captured step graph -> an onnx_ir model with stable, meaningful names.

torch.onnx.export (dynamo) names initializers after the parameters (model.layers.3.self_attn.q_proj.weight);
node names are rewritten here from the module scope the exporter records, so every node carries
its layer index and projection (e.g. `layers.3.self_attn.q_proj/MatMul`).
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections import Counter
from typing import Any, Protocol

import numpy as np
import onnx_ir as ir
import torch
from onnxscript import optimizer

from toolchain.artifact.layout import StepLayout
from toolchain.compile.capture import StepGraph, example_inputs
from toolchain.compile.streamed import meta_model
from toolchain.compile.weight_store import WeightStore
from toolchain.errors import MobcError
from toolchain.ir import disk

OPSET = 21


class ExportError(MobcError):
    pass


def _scope_name(node: ir.Node) -> str:
    scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes")
    if not scopes:
        return ""
    try:
        import ast

        parts = ast.literal_eval(scopes)
    except (ValueError, SyntaxError):
        return ""
    # ['', 'model.model.layers.0', 'model.model.layers.0.input_layernorm', 'pow_1']: the last entry is
    # the fx node, the one before it the deepest module
    path = [p for p in parts[:-1] if p]
    if not path:
        return ""
    name = path[-1]
    for prefix in ("model.model.", "model."):
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    return name


def name_nodes(model: ir.Model) -> None:
    """Deterministic names: '<module path>/<op>' with a counter for repeats.

    The exporter's metadata (stack traces with absolute paths, fx node text) is dropped: it
    bloats the file and would make the bytes depend on where mobc is installed.
    """
    seen: Counter[str] = Counter()
    for node in model.graph:
        base = f"{_scope_name(node) or 'graph'}/{node.op_type}"
        idx = seen[base]
        seen[base] += 1
        node.name = base if idx == 0 else f"{base}_{idx}"
        node.metadata_props.clear()


def name_initializers(model: ir.Model) -> None:
    """Parameter names without the wrapper prefix ('layers.0.self_attn.q_proj.weight'); constants
    the exporter folded (e.g. transposed Linear weights, 'val_16') are named after their consumer."""
    taken = set(model.graph.initializers)
    for value in list(model.graph.initializers.values()):
        name = value.name or ""
        new = None
        for prefix in ("model.model.", "model."):
            if name.startswith(prefix):
                new = name[len(prefix):]
                break
        else:
            users = value.uses()
            if name.startswith("val_") and len(users) == 1:
                module = users[0].node.name.rsplit("/", 1)[0]
                is_weight = users[0].node.op_type in ("MatMul", "Gemm") and len(value.shape or ()) == 2
                new = f"{module}.weight" if is_weight else f"{module}.const"
        if new and new not in taken:
            taken.discard(name)
            taken.add(new)
            value.name = new


class Weights(Protocol):
    """Where an export's initializers get their data: Hugging Face name -> graph tensor."""

    def tensor(self, hf_name: str, ir_name: str) -> ir.TensorProtocol | None: ...


class ModuleWeights:
    """The parameters and buffers of an in-memory torch model (tests, small models)."""

    def __init__(self, model: Any):
        self.named = {**dict(model.named_buffers()), **dict(model.named_parameters(remove_duplicate=False))}

    def tensor(self, hf_name: str, ir_name: str) -> ir.TensorProtocol | None:
        t = self.named.get(hf_name)
        if t is None:
            return None
        return disk.as_tensor(ir_name, t.detach().float().numpy() if t.is_floating_point() else t.numpy())


class StoredWeights:
    """Parameters from the checkpoint's files (no copy for fp32), buffers from the skeleton model."""

    def __init__(self, store: WeightStore, skeleton: Any, spill: disk.Spill):
        self.store, self.spill = store, spill
        self.buffers = dict(skeleton.named_buffers())
        store.offer_to(spill)

    def tensor(self, hf_name: str, ir_name: str) -> ir.TensorProtocol | None:
        if hf_name in self.store:
            return self.store.graph_tensor(hf_name, ir_name, self.spill)
        b = self.buffers.get(hf_name)
        return None if b is None else disk.as_tensor(ir_name, b.detach().numpy())


def export_step_graph(model: Any, layout: StepLayout, graph_name: str = "step",
                      weights: Weights | None = None) -> ir.Model:
    """Exports the HF model as a step graph of the given layout (float32).

    The exporter traces a copy of the model on the meta device, so tracing costs no weight
    memory whatever the model's size; the graph's initializers are then bound by name to
    `weights` (default: `model`'s own tensors). Large tensors the export creates (transposed
    Linear weights) go through `disk.as_tensor`, i.e. to the active spill when there is one.
    """
    weights = weights or ModuleWeights(model)
    config = model.config
    config._attn_implementation = "eager"
    wrapper = StepGraph(meta_model(config), layout).eval()
    args = tuple(t.to("meta") for t in example_inputs(layout))
    in_names = [n for n, _, _ in layout.inputs()]
    out_names = [n for n, _, _ in layout.outputs()]
    sink = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), torch.no_grad():
            warnings.simplefilter("ignore")
            logging.getLogger("torch.onnx").setLevel(logging.ERROR)
            program = torch.onnx.export(
                wrapper,
                args,
                input_names=in_names,
                output_names=out_names,
                opset_version=OPSET,
                dynamo=True,
                optimize=False,  # the optimizer cannot fold meta tensors; it runs after binding
                verify=False,
                report=False,
            )
    except Exception as exc:  # exporter errors are long; keep the first line for the user
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(
            f"torch.onnx.export failed for graph {graph_name!r} ({type(exc).__name__}: {first}); "
            "rerun with --debug for the full exporter log"
        ) from exc
    finally:
        config._attn_implementation = "eager"
    onnx_model = program.model
    bind_weights(onnx_model, weights, graph_name)
    fold_weight_transposes(onnx_model)
    optimizer.optimize(onnx_model)
    spill = disk.active()
    if spill is not None:
        disk.spill_large(onnx_model, spill)  # anything large the optimizer folded in memory
    onnx_model.graph.name = graph_name
    name_nodes(onnx_model)
    name_initializers(onnx_model)
    _check_io(onnx_model, in_names, out_names)
    return onnx_model


def bind_weights(model: ir.Model, weights: Weights, graph_name: str) -> None:
    """Gives every initializer of the meta-traced graph its data, by the parameter's HF name."""
    unbound = []
    for value in model.graph.initializers.values():
        name = value.name or ""
        hf_name = name[len("model."):] if name.startswith("model.") else name  # StepGraph.model.<hf name>
        tensor = weights.tensor(hf_name, name)
        if tensor is None:
            if value.const_value is not None and not _is_meta(value.const_value):
                continue  # a constant the exporter made from Python numbers
            unbound.append(name)
            continue
        if tuple(tensor.shape) != tuple(value.shape or ()):
            raise ExportError(f"graph {graph_name!r}: weight {hf_name} has shape {tuple(tensor.shape)}, "
                              f"the model expects {tuple(value.shape or ())}; the checkpoint does not match its config")
        value.const_value = tensor
    if unbound:
        raise ExportError(f"graph {graph_name!r}: no weights for {unbound[:4]}; the checkpoint lacks them")


def _is_meta(tensor: Any) -> bool:
    raw = getattr(tensor, "raw", None)
    return isinstance(raw, torch.Tensor) and raw.device.type == "meta"


def fold_weight_transposes(model: ir.Model) -> None:
    """Transpose(initializer) -> the transposed initializer, one tensor at a time.

    torch exports Linear as MatMul(x, Transpose(W)); folding those here (instead of in the
    optimizer, which would hold every folded weight in memory at once) lets the large results go
    to the spill as they are made.
    """
    for node in list(model.graph):
        if node.op_type != "Transpose" or not node.inputs[0] or not node.inputs[0].is_initializer():
            continue
        source = node.inputs[0]
        if len(source.uses()) > 1:
            continue  # a tied embedding (Gather + lm_head): folding would store the weight twice
        perm = node.attributes.get_ints("perm", None)
        arr = source.const_value.numpy()
        folded = np.transpose(arr, perm) if perm is not None else arr.T
        name = f"val_T_{source.name}"
        value = ir.Value(name=name, shape=ir.Shape(folded.shape), type=ir.TensorType(source.dtype),
                         const_value=disk.as_tensor(name, folded))
        model.graph.register_initializer(value)
        ir.convenience.replace_all_uses_with(node.outputs[0], value)
        model.graph.remove(node, safe=True)
        del model.graph.initializers[source.name]


def _check_io(model: ir.Model, in_names: list[str], out_names: list[str]) -> None:
    got_in = [v.name for v in model.graph.inputs]
    got_out = [v.name for v in model.graph.outputs]
    if got_in != in_names or got_out != out_names:
        raise ExportError(
            f"exported graph I/O does not follow the step-graph convention: inputs {got_in[:6]}..., "
            f"outputs {got_out[:4]}...; this is a mobc bug, please report it"
        )
