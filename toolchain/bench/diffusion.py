"""`mobc bench diffusion`: diffusion decoding policies on the same prompts, one process.

Per configuration: model calls per generated token, CPU tokens/s (prompt prefill excluded),
predicted phone latency per token (the cost model over every call, bench.Predictor), token
agreement with the LLaDA baseline (position by position), and prompts whose tokens equal the
configuration's own rule baseline exactly (llada with speculation off must: the bench checks).
Plus the revision path's overlap and the weight-prefetch prediction (and, for an artifact split
into parts, a measured CPU run of the part streamer with and without prefetch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from toolchain.bench.decode import Predictor
from toolchain.runtime.model import StepModel
from toolchain.runtime.policies.diffusion import DiffusionPolicy, FastDLLM, diffusion_setup
from toolchain.runtime.policies.llada import LLaDA
from toolchain.runtime.policies.sampling import Sampler

# name -> (policy class, options, the rule baseline it is compared with exactly, or None)
CONFIGS: dict[str, tuple[type[DiffusionPolicy], dict[str, Any], str | None]] = {
    "dllm": (DiffusionPolicy, {}, None),  # LLaDA low-confidence remasking, fixed steps: THE baseline
    "fastdllm": (FastDLLM, {}, None),  # Fast-dLLM threshold parallel decoding
    "llada-off": (LLaDA, {"speculate": False}, "fastdllm"),  # must equal fastdllm token for token
    "llada": (LLaDA, {}, None),  # multi-block speculation
    "llada+rev": (LLaDA, {"revise": True}, None),  # + dual-path revision on a CPU thread
    "llada-steps": (LLaDA, {"rule": "steps"}, None),  # speculation over the LLaDA rule
    "llada-steps-off": (LLaDA, {"rule": "steps", "speculate": False}, "dllm"),
}
DEFAULT = "dllm,fastdllm,llada-off,llada,llada+rev,llada-steps,llada-steps-off"


def family_cost(model: StepModel, fam: str):
    """GraphCost of one call of a family, its parts summed (width from the manifest: a later part
    has no input_ids to read it from)."""
    from toolchain.cost.onnx_graph import graph_cost

    stages = model.sessions.chain(fam)
    width = stages[0].width
    total = None
    for st in stages:
        c = graph_cost(model.folder / st.file, width=width, name=st.name)
        total = c if total is None else total + c
    return total


def diffusion_predictor(model: StepModel, device: str, dram: float) -> Predictor:
    from toolchain.cost.model import CostModel

    fam = diffusion_setup(model)[0]
    costs = {fam: family_cost(model, fam)}
    cm = CostModel(device, dram)
    cm.place(costs[fam])
    return Predictor(costs, cm, {fam: cm.call_latency(costs[fam]).total_s})


@dataclass
class Row:
    name: str
    tokens: int = 0
    calls: int = 0
    seconds: float = 0.0
    phone_s: float = 0.0
    agree: int = 0  # tokens equal to the LLaDA baseline at the same position
    exact: int = 0  # prompts equal to the rule baseline
    prompts: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def row(self, n_prompts: int, has_rule_base: bool) -> dict[str, Any]:
        return {"policy": self.name, "tokens": self.tokens, "calls": self.calls,
                "calls_per_token": self.calls / self.tokens if self.tokens else None,
                "tokens_per_s_cpu": self.tokens / self.seconds if self.seconds else None,
                "phone_ms_per_token": 1e3 * self.phone_s / self.tokens if self.tokens else None,
                "agreement_with_dllm": self.agree / self.tokens if self.tokens else None,
                "equals_rule_baseline": f"{self.exact}/{n_prompts}" if has_rule_base else None, **self.extra}


def bench(model: StepModel, configs: list[str], prompts: list[str], max_new_tokens: int, block: int,
          steps: int, threshold: float, device: str, dram: float, log=print) -> dict[str, Any]:
    common = {"block": block, "steps": steps, "threshold": threshold}
    names = list(dict.fromkeys(["dllm", *configs]))
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        from toolchain.errors import MobcError

        raise MobcError(f"unknown diffusion configuration(s) {unknown}; choose from {', '.join(CONFIGS)}")
    pols = {n: CONFIGS[n][0](model, None, **{**common, **CONFIGS[n][1]}) for n in names}
    predictor = diffusion_predictor(model, device, dram)
    rows = {n: Row(n) for n in names}
    tok = model.tokenizer
    for i, text in enumerate(prompts):
        ids = tok(text).input_ids
        outs: dict[str, list[int]] = {}
        for n, pol in pols.items():
            t = time.perf_counter()
            out = [x for chunk in pol.generate(ids, max_new_tokens, Sampler()) for x in chunk]
            wall = time.perf_counter() - t - pol.stats.prefill_seconds
            outs[n] = out
            r = rows[n]
            calls = pol.stats.n_target_calls
            r.tokens += len(out)
            r.calls += calls
            r.seconds += wall
            r.phone_s += pol.stats.phone_seconds(predictor)
            ref = outs["dllm"]
            r.agree += sum(a == b for a, b in zip(out, ref, strict=False))
            base = CONFIGS[n][2]
            r.exact += int(base is not None and outs.get(base) == out)
            r.prompts.append({"prompt": i, "prompt_tokens": len(ids), "tokens": len(out), "calls": calls,
                              "seconds": wall, **pol.extra_stats(), "output": out})
        log(f"prompt {i + 1}/{len(prompts)}: " + ", ".join(
            f"{n} {rows[n].prompts[-1]['calls']} calls" for n in names))
    for n, pol in pols.items():
        if isinstance(pol, LLaDA):
            ps = rows[n].prompts
            sums = {k: sum(p[k] for p in ps) for k in ("spec_decided", "spec_kept", "spec_remasked",
                                                       "provisional", "revised")}
            if pol.opts.speculate:
                rows[n].extra.update({k: sums[k] for k in ("spec_decided", "spec_kept", "spec_remasked")})
            if pol.opts.revise:
                rev = [p["revision"] for p in ps if p["revision"]]
                busy = sum(r["revision_s"] for r in rev)
                both = sum(r["overlapped_s"] for r in rev)
                rows[n].extra.update({"provisional": sums["provisional"], "revised": sums["revised"],
                                      "revision_s": busy, "revision_overlap": both / busy if busy else None})
            pol.close()
    fam, width, _ = diffusion_setup(model)
    return {"artifact": model.name, "family": fam, "width": width, "block": block or width, "steps": steps,
            "threshold": threshold, "device": device, "dram_budget": dram, "max_new_tokens": max_new_tokens,
            "prompts": len(prompts), "phone_ms_per_call": 1e3 * predictor.per_call[fam],
            "rows": [rows[n].row(len(prompts), CONFIGS[n][2] is not None) for n in names],
            "details": {n: r.prompts for n, r in rows.items()}}


def prefetch_section(model: StepModel, device: str, budgets: list[float], calls: int = 6) -> dict[str, Any]:
    """Predicted phone effect of weight prefetch and, for a split artifact, a measured CPU run."""
    from toolchain.runtime.prefetch import PartStreamer, predict

    fam, width, mask_id = diffusion_setup(model)
    cost = family_cost(model, fam)
    stages = model.sessions.chain(fam)
    n_parts = len(stages) if len(stages) > 1 else 4
    out: dict[str, Any] = {"family": fam, "parts": n_parts, "split_artifact": len(stages) > 1,
                           "predicted": [predict(cost, device, b, n_parts) for b in budgets]}
    if len(stages) > 1:
        model.reset()
        feeds = model.cache.step_inputs([mask_id] * width, width, depths=range(width))
        measured = []
        for resident, prefetch in ((len(stages), False), (1, False), (1, True)):
            ps = PartStreamer(model.folder, fam, resident=resident, prefetch=prefetch, threads=model.sessions.threads)
            ps.run(feeds)  # warm: the first call loads every part either way
            ps.stats.__init__()
            for _ in range(calls):
                ps.run(feeds)
            s = ps.stats
            ps.close()
            measured.append({"resident_parts": resident, "prefetch": prefetch,
                             "ms_per_call": 1e3 * s.seconds / s.calls, "load_ms_per_call": 1e3 * s.load_s / s.calls,
                             "wait_ms_per_call": 1e3 * s.wait_s / s.calls})
        out["measured_cpu"] = measured
    return out
