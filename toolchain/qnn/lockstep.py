"""Greedy decoding through QNN HTP context binaries in lockstep with the CPU graphs.

The CPU graphs pick every token; the HTP binaries are fed the same tokens (each side with its own
cache), so the per-step argmax agreement measures the binaries, not a divergence that one early
disagreement would snowball into. Used by the compile's `qnn:` gate (a few tokens) and by
`mobc eval qnn` (the long run). For quantized graphs a third lane runs the float graphs on the same
tokens: the CPU simulation and the HTP are two roundings of one quantized model, so a step where the
HTP leaves the CPU's token for the float model's own is kept, as in the per-graph gate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from toolchain.qnn import context as qnn
from toolchain.runtime.cache import KVCache
from toolchain.runtime.greedy import decode_family, family_by_role, run_tokens
from toolchain.runtime.sessions import PART_BUDGET_BYTES, ArtifactSessions


class ContextSessions(ArtifactSessions):
    """ArtifactSessions whose graphs are opened from QNN context models on the HTP backend."""

    def __init__(self, folder: Path, ctx_models: dict[str, Path], options: dict[str, str]):
        super().__init__(folder)
        self.ctx_models = ctx_models
        self.qnn_options = options

    def session(self, name: str) -> Any:
        if name not in self._sessions:
            self._sessions[name] = qnn.session(self.ctx_models[name], "qnn", self.qnn_options)
        return self._sessions[name]


def lockstep_greedy(cpu: ArtifactSessions, htp: ArtifactSessions, ids: list[int], n: int,
                    log: Callable[[str], None] = lambda _m: None,
                    reference: ArtifactSessions | None = None) -> dict[str, Any]:
    """`n` greedy steps after the prompt `ids`, the CPU graphs choosing; `reference` (the float graphs
    of a quantized artifact) is fed the same tokens and says which token the unrounded model picks."""
    fam = decode_family(cpu)
    layout = cpu.layout(fam)
    lanes = [cpu, htp] + ([reference] if reference is not None else [])
    caches = [KVCache(s.layout(fam), s.rope) for s in lanes]  # the float lane's cache is float
    # a short prompt goes through the decode graph token by token: an emulated HTP prefill call
    # costs minutes (measured SmolLM2 w4a16: a decode call ~50 s), and the prefill graph gets its
    # own one-call check in check_quantized
    pre = fam if len(ids) <= 32 else (family_by_role(cpu, "prefill") or fam)
    width = cpu.chain(pre)[0].width
    last = []
    for sess, cache in zip(lanes, caches, strict=True):
        logits = None
        for s in range(0, len(ids), width):
            logits = run_tokens(sess, pre, cache, ids[s : s + width], width)
        last.append(logits[-1])
    agree, kept, diffs, tokens, flips = [], [], [], [], []
    cpu_is_float, htp_is_float = [], []
    t0 = time.perf_counter()
    for i in range(n):
        a, b = int(np.argmax(last[0])), int(np.argmax(last[1]))
        f = int(np.argmax(last[2])) if reference is not None else None
        agree.append(int(a == b))
        kept.append(int(b in (a, f)))
        if f is not None:
            cpu_is_float.append(int(a == f))
            htp_is_float.append(int(b == f))
        if a != b:  # how near a tie the CPU scored the HTP's pick: a flip at 0.01 is not one at 5
            flip = {"step": i, "cpu_gap": float(last[0].max() - last[0][b])}
            if f is not None:
                flip["htp_is_float"] = b == f
            flips.append(flip)
        diffs.append(float(np.abs(last[0] - last[1]).max()))
        tokens.append(a)  # the CPU simulation decides; the HTP (and the float lane) follow
        if (i + 1) % 8 == 0 or i + 1 == n:  # an emulated HTP decode step takes seconds: show it moving
            log(f"lockstep token {i + 1}/{n}: argmax agreement {np.mean(agree) * 100:.1f}%, max |logit diff| "
                f"{max(diffs):.3g}, {(time.perf_counter() - t0) / (i + 1):.1f} s/token")
        if caches[0].free(layout.width) < 1:
            break
        last = [run_tokens(s, fam, c, [a], layout.width)[-1] for s, c in zip(lanes, caches, strict=True)]
    result = {"tokens": len(agree), "argmax_agreement": float(np.mean(agree)), "argmax_kept": float(np.mean(kept)),
              "logits_max_abs": max(diffs), "logits_median_abs": float(np.median(diffs)), "cpu_tokens": tokens,
              "flips": flips}
    if reference is not None:
        result["argmax_vs_float"] = {"cpu": float(np.mean(cpu_is_float)), "htp": float(np.mean(htp_is_float))}
    return result


def lockstep_gate(folder: Path, records: list[dict[str, Any]], spec: qnn.QnnSpec, ids: list[int],
                  log: Callable[[str], None] = lambda _m: None, reference: Path | None = None) -> dict[str, Any]:
    """The compile's short lockstep run through the binaries `emit_qnn` just built (records), on the
    first prompt tokens `ids`; raises QnnMismatchError when fewer than spec.min_lockstep of the steps
    keep the CPU's token (or, with `reference`, the float artifact of a quantized one, its token)."""
    ctx = {r["graph"]: folder / "qnn" / r["context_model"] for r in records if r.get("context_model")}
    cpu = ArtifactSessions(folder)
    fam = decode_family(cpu)
    missing = [s.name for s in cpu.chain(fam) if s.name not in ctx]
    if missing:
        raise qnn.QnnMismatchError(f"qnn lockstep: no context binary for {missing}; the decode graphs were not built")
    htp = ContextSessions(folder, ctx, spec.provider_options())
    t = time.perf_counter()
    floats = ArtifactSessions(reference, max_resident_bytes=PART_BUDGET_BYTES) if reference else None
    result = lockstep_greedy(cpu, htp, ids, spec.lockstep_tokens, log, floats)
    result["prompt_tokens"] = len(ids)
    result["seconds"] = round(time.perf_counter() - t, 1)
    if result["argmax_kept"] < spec.min_lockstep:
        whose = "the CPU's token (or the float graphs')" if floats else "the CPU's token"
        raise qnn.QnnMismatchError(
            f"QNN HTP binaries of {fam!r}: greedy decoding in lockstep with the CPU graphs keeps {whose} "
            f"on {result['argmax_kept']:.0%} of {result['tokens']} steps < qnn.min_lockstep "
            f"{spec.min_lockstep:.0%} (max |logit diff| {result['logits_max_abs']:.3g}). {qnn.gate_hint(spec)}"
        )
    return result
