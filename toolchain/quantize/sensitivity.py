"""Which tensors dominate the quantization error: a per-layer table from onnxruntime's QDQ debugger.

onnxruntime.quantization.qdq_loss_debug saves every activation of the float and the QDQ graph on
the same (realistic) feeds. Per tensor two SQNRs (dB, higher is better):
- local: the tensor before vs after its own Q/DQ pair (how badly this encoding alone rounds);
- accumulated: float graph vs QDQ graph (everything upstream included).
Rows are grouped by the layer of the producing node (node names carry the module path).

`kl_ablation` answers the question more directly: the QDQ graph runs in torch (graph_qat.QdqTorch)
and one group of encodings at a time is switched back to float; the drop in logit KL against the
float-activation graph is that group's share of the error (per layer, and per kind of tensor).
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
    names = fl.stages[graph].input_names
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


KIND = re.compile(r"layers\.\d+\.")


def _groups(producers: dict[str, list[str]]) -> dict[str, set[str]]:
    """Encoding keys by layer ("layers.3") and by kind across layers ("self_attn.q_proj/MatMul")."""
    groups: dict[str, set[str]] = {}
    for key, nodes in producers.items():
        for node in nodes:
            m = LAYER.search(node)
            if m:
                groups.setdefault(f"layers.{int(m.group(1)):02d}", set()).add(key)
            kind = KIND.sub("", node)
            kind = re.sub(r"_\d+$", "", kind)  # Mul_1 -> Mul, past_key_7 -> past_key
            kind = kind if "/" in kind else "graph input " + kind
            groups.setdefault(kind, set()).add(key)
    return groups


def kl_ablation(folder: Path, tokenizer: Any, graph: str = "prefill", samples: int = 2,
                log: Any = lambda m: None) -> tuple[float, list[dict[str, Any]]]:
    """(KL of the QDQ graph, one row per group: the KL left with that group in float), most removed first."""
    import onnx
    import torch

    from toolchain.quantize.graph_qat import QdqTorch, mean_kl, torch_feeds

    fl = ArtifactSessions(folder)
    names = fl.stages[graph].input_names
    feeds = [torch_feeds({k: f[k] for k in names})
             for f in family_feeds(fl, graph, corpus_tokens(tokenizer, "heldout", 4096), samples, seed=3)]
    net = QdqTorch(onnx.load(folder / "quantized" / f"{graph}.onnx"))
    with torch.no_grad():
        teachers = [net(f, quant=False)["logits"] for f in feeds]
    base = mean_kl(net, teachers, feeds)
    rows = []
    groups = _groups(net.producers)
    for i, (name, keys) in enumerate(sorted(groups.items())):
        for k in keys:
            net.encodings[k].active = False
        left = mean_kl(net, teachers, feeds)
        for k in keys:
            net.encodings[k].active = True
        rows.append({"group": name, "encodings": len(keys), "kl": left,
                     "removed": (base - left) / base if base > 0 else 0.0})
        if (i + 1) % 10 == 0:
            log(f"{i + 1}/{len(groups)} groups")
    return base, sorted(rows, key=lambda r: -r["removed"])


def ablation_table(rows: list[dict[str, Any]], top: int = 15) -> tuple[list[str], list[list[str]]]:
    head = ["group (in float)", "encodings", "logit KL left", "share of the error removed"]
    return head, [[r["group"], str(r["encodings"]), f"{r['kl']:.4f}", f"{r['removed']:+.0%}"] for r in rows[:top]]
