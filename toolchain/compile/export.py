"""Export: the captured step graph -> an onnx_ir model with stable, meaningful names.

torch.onnx.export (dynamo) names initializers after the parameters (model.layers.3.self_attn.q_proj.weight);
node names are rewritten here from the module scope the exporter records, so every node carries
its layer index and projection (e.g. `layers.3.self_attn.q_proj/MatMul`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import shutil
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import onnx_ir as ir
import torch

from toolchain.artifact.layout import StepLayout
from toolchain.compile.capture import StepGraph, example_inputs
from toolchain.errors import MobcError

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


def export_step_graph(model: Any, layout: StepLayout, graph_name: str = "step") -> ir.Model:
    """Exports the HF model as a step graph of the given layout (float32)."""
    wrapper = StepGraph(model, layout).eval()
    args = tuple(example_inputs(layout))
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
                external_data=True,
                optimize=True,
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
        model.config._attn_implementation = "eager"
    onnx_model = program.model
    onnx_model.graph.name = graph_name
    name_nodes(onnx_model)
    name_initializers(onnx_model)
    _check_io(onnx_model, in_names, out_names)
    return onnx_model


def _check_io(model: ir.Model, in_names: list[str], out_names: list[str]) -> None:
    got_in = [v.name for v in model.graph.inputs]
    got_out = [v.name for v in model.graph.outputs]
    if got_in != in_names or got_out != out_names:
        raise ExportError(
            f"exported graph I/O does not follow the step-graph convention: inputs {got_in[:6]}..., "
            f"outputs {got_out[:4]}...; this is a mobc bug, please report it"
        )


def _export_key(fingerprint: str, layout: StepLayout, graph_name: str) -> str:
    """Content hash of everything an export depends on: weights, shapes, tool and mobc code."""
    import onnxscript
    import transformers

    from toolchain.compile import capture

    h = hashlib.sha256()
    for part in (fingerprint, repr(layout), graph_name, torch.__version__, transformers.__version__,
                 onnxscript.__version__, Path(capture.__file__).read_text(), Path(__file__).read_text()):
        h.update(part.encode())
    return h.hexdigest()[:32]


def export_cached(model: Any, layout: StepLayout, fingerprint: str, graph_name: str = "step") -> ir.Model:
    """export_step_graph, memoized on disk under $MOBC_CACHE/exports by content hash.

    Re-running a recipe after changing a pass, the quantization or verification settings skips the
    20-90 s exports. MOBC_NO_CACHE=1 turns it off.
    """
    from toolchain.compile.source import cache_root

    if os.environ.get("MOBC_NO_CACHE"):
        return export_step_graph(model, layout, graph_name)
    folder = cache_root() / "exports" / _export_key(fingerprint, layout, graph_name)
    if (folder / "graph.onnx").is_file():
        return ir.load(folder / "graph.onnx")
    onnx_model = export_step_graph(model, layout, graph_name)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        ir.save(onnx_model, tmp / "graph.onnx", external_data="graph.data")
        tmp.rename(folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # a cache we cannot write is only slower
    return onnx_model
