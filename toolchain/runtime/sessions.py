"""onnxruntime sessions over an artifact folder: one session per graph, families run as chains."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from toolchain.artifacts import ROPE, load_manifest
from toolchain.capture import StepLayout
from toolchain.graphset import run_chain


class _Stage:
    """Just enough of a GraphEntry for run_chain: name, stage order and I/O names."""

    def __init__(self, record: dict[str, Any]):
        self.name = record["name"]
        self.stage = record["stage"]
        self.family = record["family"]
        self.record = record
        self.input_names = [i["name"] for i in record["inputs"]]
        self.output_names = [o["name"] for o in record["outputs"]]


def session_options(threads: int | None = None) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    return so


class ArtifactSessions:
    """Lazily opened sessions for every graph of an artifact, on the CPU EP by default."""

    def __init__(self, folder: str | Path, provider: str = "cpu", threads: int | None = None,
                 provider_options: dict[str, str] | None = None):
        self.folder = Path(folder)
        self.manifest = load_manifest(self.folder)
        self.provider = provider
        self.threads = threads
        self.provider_options = provider_options or {}
        self.stages = {g["name"]: _Stage(g) for g in self.manifest["graphs"]}
        self._sessions: dict[str, ort.InferenceSession] = {}
        with np.load(self.folder / ROPE) as z:
            self.rope = {k: z[k] for k in z.files}

    def layout(self, family: str) -> StepLayout:
        m = self.manifest["model"]
        first = self.chain(family)[0].record
        return StepLayout(
            width=first["width"], context=first["context"], n_layers=m["n_layers"], n_heads=m["n_heads"],
            n_kv=m["n_kv"], head_dim=m["head_dim"], hidden=m["hidden"], vocab=m["vocab"],
            layer_kinds=tuple(m["layer_kinds"]), rope_per_kind=m["rope_per_kind"],
            sliding_window=m.get("sliding_window"),
        )

    def families(self) -> list[str]:
        return list(dict.fromkeys(s.family for s in self.stages.values()))

    def chain(self, family: str) -> list[_Stage]:
        return sorted((s for s in self.stages.values() if s.family == family), key=lambda s: s.stage)

    def session(self, name: str) -> ort.InferenceSession:
        if name not in self._sessions:
            path = str(self.folder / self.stages[name].record["file"])
            if self.provider == "qnn":
                from toolchain import qnn  # optional plugin EP

                self._sessions[name] = qnn.session(path, provider="qnn", options=self.provider_options)
            else:
                self._sessions[name] = ort.InferenceSession(
                    path, session_options(self.threads), providers=["CPUExecutionProvider"]
                )
        return self._sessions[name]

    def run_stage(self, stage: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        sess = self.session(stage.name)
        outs = sess.run(stage.output_names, feeds)
        return dict(zip(stage.output_names, outs, strict=True))

    def run_family(self, family: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return run_chain(self.chain(family), feeds, self.run_stage)


def load_config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())
