"""Structural checks of a bundle that need no runtime: the config lists every stage in pipeline
order, and every stage file exists with exactly the inputs and outputs the config gives it; an
EPContext stage (the qnn target) also finds its context binary and keeps its source graph's I/O.
Cheap enough to run after every `mobc bundle genai`; `mobc bundle verify` then runs the bundle.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import onnx

from toolchain.bundle.genai import CONFIG, load_marker
from toolchain.errors import ArtifactError


@dataclass
class StageCheck:
    name: str
    file: str
    kind: str  # small / graph / epcontext
    inputs: int
    outputs: int
    problem: str = ""


def _epcontext_binaries(model: onnx.ModelProto) -> list[str]:
    out = []
    for node in model.graph.node:
        if node.op_type == "EPContext":
            for a in node.attribute:
                if a.name == "ep_cache_context":
                    out.append(a.s.decode())
    return out




def check_structure(bundle: str | Path) -> list[StageCheck]:
    bundle = Path(bundle)
    marker = load_marker(bundle)
    config = json.loads((bundle / CONFIG).read_text())
    pipeline = config["model"]["decoder"]["pipeline"]
    if len(pipeline) != 1:
        raise ArtifactError(f"{bundle}/{CONFIG}: the pipeline must be one ordered object of stages")
    stages = pipeline[0]
    written = {s["name"]: s["kind"] for s in marker["stages"]}  # the writer's order and stage kinds
    rows = []
    if list(stages) != list(written):
        rows.append(StageCheck("pipeline", CONFIG, "order", 0, 0,
                               f"stages listed as {list(stages)}, written as {list(written)}"))
    for name, entry in stages.items():
        path = bundle / entry["filename"]
        if not path.is_file():
            rows.append(StageCheck(name, entry["filename"], "missing", 0, 0, "file missing"))
            continue
        model = onnx.load(str(path), load_external_data=False)
        ins = [i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
        outs = [o.name for o in model.graph.output]
        binaries = _epcontext_binaries(model)
        kind = written.get(name, "unknown")
        problems = []
        if ins != entry["inputs"]:
            problems.append(f"inputs {ins} != config {entry['inputs']}")
        if outs != entry["outputs"]:
            problems.append(f"outputs {outs} != config {entry['outputs']}")
        for b in binaries:
            if not (path.parent / b).is_file():
                problems.append(f"context binary {b} missing")
        if entry.get("run_on_prompt") == entry.get("run_on_token_gen"):
            problems.append("runs on both or neither of prompt and token generation")
        rows.append(StageCheck(name, entry["filename"], kind, len(ins), len(outs), "; ".join(problems)))
    return rows
