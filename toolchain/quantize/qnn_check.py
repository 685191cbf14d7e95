"""Quantized graphs on the QNN HTP backend: context binaries, and agreement with the CPU QDQ simulation.

Uses toolchain/qnn/context.py (EP registration, context-binary build, CPU-vs-QNN compare). Quantized graphs
run as real integer kernels (the fp16 flag only for float_residual's float tensors). Two checks:
- per graph, two realistic calls (real text at past 0, and half a context in with a real cache):
  max |HTP - CPU| per output, the worst of the two;
- a greedy run: the CPU QDQ graphs pick every token; the HTP graphs are fed the same tokens
  (lockstep, each with its own cache), so per-step argmax agreement is not blurred by divergence.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from toolchain.qnn import context as qnn
from toolchain.qnn.lockstep import ContextSessions, lockstep_greedy
from toolchain.quantize.calibrate import corpus_tokens, family_feeds
from toolchain.quantize.float_residual import FP16_TENSORS, has_float_tensors
from toolchain.runtime.sessions import ArtifactSessions


def check_quantized(qdir: Path, out: Path | None = None, greedy_tokens: int = 64, soc_model: int = 57,
                    htp_arch: int = 75, prompt: str = "def fibonacci(n):\n",
                    log: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    qnn.require()
    cpu = ArtifactSessions(qdir)
    extra = FP16_TENSORS if has_float_tensors(cpu.manifest.quantization) else {}
    opts = qnn.provider_options(soc_model, htp_arch, False, extra)
    tokenizer_ids = _tokenizer(qdir)
    out = out or qdir / "qnn"
    # binaries the compile built (its `qnn:` section) are listed and hashed in the manifest: checked as
    # they are, never rebuilt in place (a rebuild differs byte for byte and the artifact reads as damaged)
    compiled = {r["graph"]: r for r in (cpu.manifest.qnn or []) if r.get("context_model")
                and (r.get("soc_model"), r.get("htp_arch")) == (soc_model, htp_arch)}
    if out.resolve() != (qdir / "qnn").resolve():
        compiled = {}
    ctx: dict[str, Path] = {}
    graphs: dict[str, Any] = {}
    held = corpus_tokens(tokenizer_ids, "heldout", 2048)
    # the float artifact the quantized one sits in: the reference both the CPU and the HTP approximate
    floats = ArtifactSessions(qdir.parent) if (qdir.parent / "manifest.json").is_file() else None
    for fam in cpu.families():
        # past 0 and half a context in, as the compile's gate (pipeline.gate_calls)
        calls = list(family_feeds(cpu, fam, held, 2, seed=1))
        for st in cpu.chain(fam):
            path = qdir / st.file
            if st.name in compiled:
                rec = compiled[st.name]
                log(f"checking the compile's HTP context binary of {st.name}")
                b = qnn.ContextBinary(out / rec["context_model"], [out / f for f in rec["binaries"]],
                                      rec["build_seconds"])
            else:
                log(f"building the HTP context binary of {st.name}")
                b = qnn.build_context_binary(path, out, soc_model, htp_arch, False, extra, name=st.name)
            ctx[st.name] = b.model
            # a row keeps its token when the CPU scores the HTP's pick within the gate's tie (as `qnn:` does)
            stage_calls = [{k: f[k] for k in st.input_names if k in f} for f in calls]
            refs = ([floats.run_stage(floats.stages[st.name], f) for f in stage_calls]
                    if floats and st.name in floats.stages else [None] * len(stage_calls))
            cmp = qnn.worst_of([qnn.run_and_compare(path, b.model, f, opts, qnn.QnnSpec().top1_tie, r)
                                for f, r in zip(stage_calls, refs, strict=True)])
            worst_name, worst = cmp.worst
            graphs[st.name] = {"context_bytes": b.bytes, "build_seconds": round(b.seconds, 1),
                               "worst_output": worst_name, "worst_max_abs": worst,
                               "logits_max_abs": cmp.max_abs.get("logits"),
                               "argmax_agreement": cmp.argmax_agreement.get("logits"),
                               "argmax_vs_cpu": cmp.argmax_vs_cpu.get("logits"),
                               "argmax_vs_float": cmp.argmax_vs_float.get("logits"),
                               "excess_rel_max": max(cmp.excess_rel.values(), default=None),
                               "cpu_seconds": round(cmp.cpu_seconds, 3),
                               "htp_emulated_seconds": round(cmp.qnn_seconds, 3)}
    t = time.perf_counter()
    htp = ContextSessions(qdir, ctx, opts)
    greedy = lockstep_greedy(cpu, htp, tokenizer_ids(prompt).input_ids, greedy_tokens, log)
    greedy["seconds"] = round(time.perf_counter() - t, 1)
    result = {"soc_model": soc_model, "htp_arch": htp_arch, "graphs": graphs, "greedy": greedy}
    (out / "qnn_check.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def _tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder / "tokenizer")
