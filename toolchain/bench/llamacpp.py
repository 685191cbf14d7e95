"""llama.cpp as the CPU reference point of `mobc bench decode` (optional extra `mobc[llamacpp]`).

Runs greedy AR through llama-cpp-python on the GGUF the target was compiled from and times
only the decode steps (the time from the first generated token to the last), as the bench
does for mobc's policies, so the ratio compares per-token decode speed.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

from toolchain.artifact.manifest import Manifest


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def source_gguf(manifest: Manifest) -> Path | None:
    for f in manifest.source.get("files", []):
        if str(f).endswith(".gguf") and Path(f).is_file():
            return Path(f)
    return None


def bench(gguf: Path, prompts: list[list[int]], n_new: list[int], threads: int | None, context: int) -> dict[str, Any]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=context, n_threads=threads or None, n_batch=128,
                verbose=False, logits_all=False)
    tokens = 0
    seconds = 0.0
    prompt_seconds: list[float] = []
    for ids, n in zip(prompts, n_new, strict=True):  # mobc's token ids: the same prompt for every row
        if n < 2:
            continue
        stamps: list[float] = []
        t0 = time.perf_counter()
        for tok in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) >= n or tok == llm.token_eos():
                break
        if stamps:
            prompt_seconds.append(stamps[0] - t0)
        if len(stamps) > 1:
            tokens += len(stamps) - 1  # decode steps after the first token (which ends the prefill)
            seconds += stamps[-1] - stamps[0]
    return {"gguf": str(gguf), "tokens": tokens, "seconds": seconds,
            "tokens_per_s_cpu": tokens / seconds if seconds else 0.0,
            "prompt_ms_median": 1e3 * sorted(prompt_seconds)[len(prompt_seconds) // 2] if prompt_seconds else None}
