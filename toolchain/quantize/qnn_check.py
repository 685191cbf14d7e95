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
from toolchain.runtime.sessions import PART_BUDGET_BYTES, ArtifactSessions, stage_feeds


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
    has_floats = (qdir.parent / "manifest.json").is_file()
    calls = gate_calls(cpu, held)  # past 0 and half a context in, as the compile's gate
    refs = float_outputs(qdir.parent, calls) if has_floats else {}
    for fam in cpu.families():
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
            stage_refs = refs.get(st.name) or [None] * len(calls[st.name])
            cmp = qnn.worst_of([qnn.run_and_compare(path, b.model, f, opts, qnn.QnnSpec().top1_tie, r)
                                for f, r in zip(calls[st.name], stage_refs, strict=True)])
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
    floats = ArtifactSessions(qdir.parent, max_resident_bytes=PART_BUDGET_BYTES) if has_floats else None
    greedy = lockstep_greedy(cpu, htp, tokenizer_ids(prompt).input_ids, greedy_tokens, log, floats)
    greedy["seconds"] = round(time.perf_counter() - t, 1)
    result = {"soc_model": soc_model, "htp_arch": htp_arch, "graphs": graphs, "greedy": greedy}
    (out / "qnn_check.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def gate_calls(sessions: ArtifactSessions, tokens: list[int]) -> dict[str, list[dict[str, Any]]]:
    """Per stage graph, the two calls the qnn: gate checks a quantized graph on: at past 0 (the text's
    first tokens, which carry the massive activations) and about half a context in, with a real
    cache behind it (where a decode step runs). A gate on the first call alone passed a W4A8 decode
    binary whose K/V were 16 steps off the CPU's on every call with a cache (the attention mask's Add)."""
    per_family = {fam: list(family_feeds(sessions, fam, tokens, 2, seed=1)) for fam in sessions.families()}
    plans = [stage_feeds(sessions, {fam: calls[i] for fam, calls in per_family.items()}) for i in range(2)]
    return {name: [plan[name] for plan in plans] for name in plans[0]}


def float_outputs(folder: Path, calls: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Each quantized stage graph's float original (the artifact at `folder`) run on the same calls:
    the reference the gate measures the HTP and the CPU simulation against."""
    floats = ArtifactSessions(folder, max_resident_bytes=PART_BUDGET_BYTES)
    return {name: [floats.run_stage(floats.stages[name], {k: f[k] for k in floats.stages[name].input_names})
                   for f in fs] for name, fs in calls.items() if name in floats.stages}


def _tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder / "tokenizer")
