"""QNN HTP context binaries for a diffusion artifact's block graph (every part), on real inputs.

Uses toolchain/qnn/context.py (build_context_binary + compare against the CPU EP). The feeds are a real
denoising call, not random tensors: a prompt prefilled through the block graph, then a block
that is half mask tokens under the bidirectional block mask; each part gets the residual stream
its predecessor really produced, so the fp16 HTP sees the activation ranges it will see in use.
Records go to <artifact>/qnn/diffusion_qnn.json (the artifact's manifest is left untouched).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from toolchain.runtime.model import StepModel
from toolchain.runtime.policies.diffusion import diffusion_setup

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def block_feeds(model: StepModel) -> dict[str, dict[str, np.ndarray]]:
    """Per graph (part) name: the inputs of one real denoising call."""
    fam, width, mask_id = diffusion_setup(model)
    ids = model.tokenizer(PROMPT).input_ids
    model.reset()
    for s in range(0, len(ids), width):
        chunk = ids[s : s + width]
        model.forward(chunk, allowed_new=np.ones((len(chunk),) * 2, bool), depths=range(len(chunk)), family=fam)
        model.commit(range(len(chunk)))
    rng = np.random.default_rng(0)
    block = [mask_id if rng.random() < 0.5 else int(t) for t in rng.integers(100, 5000, width)]
    values = dict(model.cache.step_inputs(block, width, allowed_new=np.ones((width, width), bool),
                                          depths=range(width)))
    feeds = {}
    for stage in model.sessions.chain(fam):
        feeds[stage.name] = {k: values[k] for k in stage.input_names}
        values.update(model.sessions.run_stage(stage, feeds[stage.name]))
    return feeds


def build(artifact: str | Path, soc_model: int = 57, htp_arch: int = 75) -> list[dict[str, Any]]:
    from toolchain.qnn import context as qnn

    artifact = Path(artifact)
    model = StepModel(artifact, io_binding=False)
    fam = diffusion_setup(model)[0]
    feeds = block_feeds(model)
    files = {st.name: artifact / st.file for st in model.sessions.chain(fam)}
    spec = qnn.QnnSpec(soc_model=soc_model, htp_arch=htp_arch, fp16=True, verify=True)
    records = qnn.emit_qnn(files, artifact / "qnn", spec, feeds=lambda name: feeds[name])
    (artifact / "qnn" / "diffusion_qnn.json").write_text(json.dumps(records, indent=1))
    return records


if __name__ == "__main__":
    import sys

    for r in build(sys.argv[1]):
        v = r.get("verify", {})
        print(r["graph"], r["status"], f"{r.get('bytes', 0) / 1e6:.1f} MB", f"{r.get('build_seconds')} s build",
              f"worst |qnn-cpu| {v.get('worst_max_abs')} ({v.get('worst_output')})",
              f"argmax agreement {v.get('argmax_agreement')}", f"emulated {v.get('htp_emulated_seconds')} s")
