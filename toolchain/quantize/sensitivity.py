"""Which tensors dominate the quantization error: a per-layer table from onnxruntime's QDQ debugger.

onnxruntime.quantization.qdq_loss_debug saves every activation of the float and the QDQ graph on
the same (realistic) feeds. Per tensor two SQNRs (dB, higher is better):
- local: the tensor before vs after its own Q/DQ pair (how badly this encoding alone rounds);
- accumulated: float graph vs QDQ graph (everything upstream included).
Rows are grouped by the layer of the producing node (node names carry the module path).
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnxruntime.quantization import CalibrationDataReader
from onnxruntime.quantization.qdq_loss_debug import (
    collect_activations,
    compute_activation_error,
    create_activation_matching,
    modify_model_output_intermediate_tensors,
)

from toolchain.quantize.calibrate import corpus_tokens, family_feeds
from toolchain.runtime.sessions import ArtifactSessions

LAYER = re.compile(r"layers\.(\d+)\.([a-z_]+)")


class _Feeds(CalibrationDataReader):
    def __init__(self, feeds: list[dict[str, np.ndarray]]):
        self.it = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.it, None)


def sensitivity(folder: Path, tokenizer: Any, graph: str = "decode", samples: int = 2) -> list[dict[str, Any]]:
    """One row per (layer, block) with its worst local and accumulated SQNR, worst first."""
    fl = ArtifactSessions(folder)
    feeds = list(family_feeds(fl, graph, corpus_tokens(tokenizer, "heldout", 4096), samples, seed=3))
    names = [i["name"] for i in fl.stages[graph].record["inputs"]]
    feeds = [{k: f[k] for k in names} for f in feeds]
    producer = {o: n.name for n in onnx.load(folder / f"{graph}.onnx", load_external_data=False).graph.node
                for o in n.output}
    with tempfile.TemporaryDirectory(prefix="mobc-sens-") as tmp:
        acts = {}
        for tag, path in (("float", folder / f"{graph}.onnx"), ("qdq", folder / "quantized" / f"{graph}.onnx")):
            aug = Path(tmp) / f"{tag}.onnx"
            modify_model_output_intermediate_tensors(path, aug, save_as_external_data=True)
            acts[tag] = collect_activations(str(aug), _Feeds(feeds))
    errors = compute_activation_error(create_activation_matching(acts["qdq"], acts["float"]))
    groups: dict[str, dict[str, Any]] = {}
    for tensor, err in errors.items():
        node = producer.get(tensor, "")
        m = LAYER.search(node)
        key = f"layers.{m.group(1)}.{m.group(2)}" if m else (node.split("/")[0] or tensor)
        g = groups.setdefault(key, {"block": key, "local_db": np.inf, "local_tensor": "", "accum_db": np.inf,
                                    "accum_tensor": ""})
        local, accum = float(err.get("qdq_err", np.inf)), float(err.get("xmodel_err", np.inf))
        if local < g["local_db"]:
            g["local_db"], g["local_tensor"] = local, f"{tensor} ({node.rpartition('/')[2]})"
        if accum < g["accum_db"]:
            g["accum_db"], g["accum_tensor"] = accum, tensor
    return sorted(groups.values(), key=lambda g: g["local_db"])


def sensitivity_table(rows: list[dict[str, Any]], top: int = 15) -> tuple[list[str], list[list[str]]]:
    head = ["block", "worst local SQNR dB", "tensor", "worst accumulated SQNR dB"]
    return head, [[r["block"], f"{r['local_db']:.1f}", r["local_tensor"], f"{r['accum_db']:.1f}"] for r in rows[:top]]
