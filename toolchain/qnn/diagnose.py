"""Why the QNN HTP backend rejected a graph, in words a user can act on.

Two kinds of rejection reach us:
  - node validation: the EP logs `Unsupported nodes in QNN EP: { name: X, type: Y }` (and, with CPU
    fallback disabled, fails the session). The log names the nodes; we map op types to the pass
    that removes them.
  - finalize: the HTP graph compiler fails the whole graph with a QNN error code and no node name
    (e.g. QNN_COMMON_ERROR_MEM_ALLOC). We then lint the graph for patterns measured to break it
    (see `htp_findings`) and name those nodes.
The EP writes its log to the process's stderr (C++), so it is captured at the file-descriptor level.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import onnx_ir as ir

log = logging.getLogger(__name__)

# Lines the EP prints on every session on x86 that say nothing about the graph.
_NOISE = ("File mapped weights", "EPContext encryption config", "LIBNATIVE", "GetProducerInfo")
_UNSUPPORTED = re.compile(r"\{ name: ([^,]+), type: ([^ }]+) \}")

# op type -> what to do about it when the HTP backend rejects it
FIXES: dict[str, str] = {
    "GatherND": "export with a float additive attention mask (integer masks produce GatherND), "
    "or replace GatherND by Gather/Slice with a pass",
    "NonZero": "data-dependent shapes cannot run on HTP: make the index static (fold_constants)",
    "Where": "build masks outside the graph (the step graph takes a float additive mask)",
}


@contextlib.contextmanager
def captured_stderr() -> Iterator[Callable[[], str]]:
    """Redirects fd 2 to a temp file; yields a function returning what was written so far."""
    sys.stderr.flush()
    saved = os.dup(2)
    tmp = tempfile.TemporaryFile(mode="w+b")
    os.dup2(tmp.fileno(), 2)

    def text() -> str:
        tmp.flush()
        tmp.seek(0)
        return tmp.read().decode(errors="replace")

    try:
        yield text
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        for line in text().splitlines():
            if line.strip() and not any(n in line for n in _NOISE):
                log.debug("qnn-ep: %s", line)
        tmp.close()


def unsupported_nodes(log_text: str) -> list[tuple[str, str]]:
    """(node name, op type) pairs the EP reported as unsupported, in order, without repeats."""
    return list(dict.fromkeys(_UNSUPPORTED.findall(log_text)))


@dataclass(frozen=True)
class Finding:
    node: str
    op_type: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.op_type} node {self.node!r}: {self.problem}; fix: {self.fix}"


def _const_scalar(value: ir.Value | None) -> float | None:
    if value is None or value.const_value is None:
        return None
    arr = value.const_value.numpy()
    return float(arr.reshape(-1)[0]) if arr.size == 1 else None


def htp_findings(model: ir.Model) -> list[Finding]:
    """Patterns measured to make HTP finalize fail (onnxruntime-qnn 2.7, QAIRT 2.40, soc 57/v75).

    RMSNorm written as Pow(x, 2) -> ReduceMean -> ... -> Mul(x, rsqrt) -> Mul(weight) fails with
    QNN_COMMON_ERROR_MEM_ALLOC even on a 64-wide toy graph, with or without fp16; the same chain
    with Mul(x, x) finalizes (fp16 mode then overflows for |x| > 255 unless the input is scaled).
    """
    found = []
    for node in model.graph.all_nodes():
        if node.op_type == "Pow" and _const_scalar(node.inputs[1]) == 2.0:
            if any(use.op_type == "ReduceMean" for use, _ in node.outputs[0].uses()):
                found.append(
                    Finding(
                        node.name or "?",
                        "Pow",
                        "RMSNorm squares with Pow(x, 2), which fails HTP finalize (MEM_ALLOC)",
                        "add the `scale_rmsnorm` pass (squares with Mul on a scaled input, exact)",
                    )
                )
    return found


def quantized_matmul_findings(onnx_path: Path) -> dict[str, Finding]:
    """QDQ MatMuls HTP rejects, by node name: block-quantized weights meeting an 8-bit activation.

    Measured (tiny model, onnxruntime-qnn 2.40): the same MatMul runs with uint16 activations.
    """
    import onnx

    try:
        model = onnx.load(onnx_path, load_external_data=False)
    except Exception as exc:  # a lint failure must not hide the backend's error
        log.debug("cannot read %s: %s", onnx_path, exc)
        return {}
    producer = {o: n for n in model.graph.node for o in n.output}
    dtype = {i.name: i.data_type for i in model.graph.initializer}
    eight_bit = {onnx.TensorProto.UINT8, onnx.TensorProto.INT8}
    out = {}
    for node in model.graph.node:
        if node.op_type != "MatMul" or len(node.input) < 2:
            continue
        x, w = producer.get(node.input[0]), producer.get(node.input[1])
        if not (x and w and x.op_type == w.op_type == "DequantizeLinear" and len(x.input) > 2):
            continue
        block = next((onnx.helper.get_attribute_value(a) for a in w.attribute if a.name == "block_size"), None)
        if block and dtype.get(x.input[2]) in eight_bit:
            out[node.name] = Finding(
                node.name,
                "MatMul",
                f"block-quantized weights (block_size {block}) meet an 8-bit activation; HTP runs block-wise "
                "weights only with 16-bit activations (measured: the same MatMul runs with uint16)",
                "use `activations: int16` for these nodes (a recipe override such as "
                "`\"*proj*\": {activations: int16}`) or `granularity: per_channel`",
            )
    return out


def explain_failure(onnx_path: Path, error: str, log_text: str, limit: int = 8) -> str:
    """A user-facing message for a failed QNN session over onnx_path."""
    first = error.strip().splitlines()[0] if error.strip() else "unknown error"
    bad = unsupported_nodes(log_text)
    if bad:
        lines = [f"QNN HTP does not support {len(bad)} node(s) of {onnx_path.name}:"]
        known = quantized_matmul_findings(onnx_path) if any(op == "MatMul" for _, op in bad) else {}
        for node, op in bad[:limit]:
            f = known.get(node)
            reason = f"{f.problem}; fix: {f.fix}" if f else FIXES.get(op, "replace it with ops HTP supports (a pass)")
            lines.append(f"  {op} {node!r}: {reason}")
        if len(bad) > limit:
            lines.append(f"  ... and {len(bad) - limit} more")
        return "\n".join(lines)
    if "finalize" in error.lower():
        code = re.search(r"QNN_[A-Z_]+", error)
        head = f"QNN HTP failed to finalize {onnx_path.name} ({code.group(0) if code else first})"
        try:
            findings = htp_findings(ir.load(onnx_path))
        except Exception as exc:  # a lint failure must not hide the backend's error
            log.debug("htp lint failed: %s", exc)
            findings = []
        if findings:
            # one line per distinct problem, naming the first nodes: 61 identical lines help nobody
            groups: dict[tuple[str, str, str], list[str]] = {}
            for f in findings:
                groups.setdefault((f.op_type, f.problem, f.fix), []).append(f.node)
            lines = [f"{head}; {len(findings)} node(s) match patterns known to break HTP:"]
            for (op, problem, fix), nodes in groups.items():
                shown = ", ".join(repr(n) for n in nodes[:3]) + (f" and {len(nodes) - 3} more" if len(nodes) > 3 else "")
                lines.append(f"  {len(nodes)} {op} node(s) ({shown}): {problem}; fix: {fix}")
            return "\n".join(lines)
        return (
            f"{head}. No known-bad pattern found; if the graph is large, split it with `split_parts` "
            "(HTP has a per-graph memory limit). Rerun with --debug for the EP log"
        )
    errors = [ln for ln in log_text.splitlines() if "[E:" in ln and not any(n in ln for n in _NOISE)]
    detail = ("; EP log: " + " | ".join(e.split("] ", 1)[-1] for e in errors[:3])) if errors else ""
    return f"QNN HTP session for {onnx_path.name} failed: {first}{detail}"
