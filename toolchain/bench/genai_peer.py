"""onnxruntime-genai as a CPU reference point of `mobc bench decode` (`--genai DIR`).

DIR is a model folder onnxruntime-genai loads (genai_config.json), e.g. its builder's int4 CPU model
made from the same float checkpoint as the target:
    python -m onnxruntime_genai.models.builder -i <HF folder> -o DIR -p int4 -e cpu
It is fed the prompt token ids mobc decoded from (so both tokenize alike by construction), decodes
greedily with the same number of new tokens, and is timed like mobc's policies: decode steps only
(from the first generated token to the last). Its tokens are compared with mobc's ar output.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from toolchain.errors import ArtifactError


def available() -> bool:
    return importlib.util.find_spec("onnxruntime_genai") is not None


def bench(model_dir: Path, prompts: list[list[int]], n_new: list[int], threads: int | None,
          reference: list[list[int]]) -> dict[str, Any]:
    import onnxruntime_genai as og

    if not (Path(model_dir) / "genai_config.json").is_file():
        raise ArtifactError(f"--genai {model_dir}: no genai_config.json there; build one with "
                            "python -m onnxruntime_genai.models.builder -i <HF folder> -o DIR -p int4 -e cpu")
    config = og.Config(str(model_dir))
    if threads:
        opts = {"intra_op_num_threads": threads}
        config.overlay(json.dumps({"model": {"decoder": {"session_options": opts}}}))
    model = og.Model(config)
    tokens = 0
    seconds = 0.0
    prompt_seconds: list[float] = []
    same = 0
    for ids, n, ref in zip(prompts, n_new, reference, strict=True):
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(ids) + n)
        gen = og.Generator(model, params)
        out: list[int] = []
        stamps: list[float] = []
        t0 = time.perf_counter()
        gen.append_tokens(np.asarray(ids, dtype=np.int32))
        while not gen.is_done() and len(out) < n:
            gen.generate_next_token()
            out.append(int(gen.get_next_tokens()[0]))
            stamps.append(time.perf_counter())
        if stamps:
            prompt_seconds.append(stamps[0] - t0)
        if len(stamps) > 1:
            tokens += len(stamps) - 1
            seconds += stamps[-1] - stamps[0]
        same += int(out == ref)
    return {"model": str(model_dir), "tokens": tokens, "seconds": seconds,
            "tokens_per_s_cpu": tokens / seconds if seconds else 0.0,
            "prompt_seconds_median": float(np.median(prompt_seconds)) if prompt_seconds else None,
            "identical_to_ar": same, "prompts": len(prompts)}
