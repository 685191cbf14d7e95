"""`mobc bench decode`: every policy on the same prompts in one process, real CPU and predicted phone time.

Per policy: decode tokens/s on this CPU (prompt prefill excluded: it is the same for every
policy), drafts accepted per target verify call, tokens per target call, target calls per
token, predicted phone latency per token (the cost model over every graph call the policy
made, target and draft under their own DRAM budgets) and speedups vs ar. With temperature 0
every policy must reproduce ar's tokens exactly; the bench checks that prompt by prompt.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from toolchain.bench.prompts import encode
from toolchain.cost.model import CostModel, GraphCost
from toolchain.runtime.model import StepModel
from toolchain.runtime.policies import Sampler, make_policy


def step_model(model: Any) -> StepModel:
    """The StepModel behind a draft (a draft head's adapter wraps one)."""
    return getattr(model, "step_model", model)


def warmup(model: StepModel) -> None:
    """Open every session and run each graph once, so no policy pays session creation in its timing."""
    for fam in model.widths:
        model.forward([0], family=fam)
    model.reset()


def family_costs(model: StepModel) -> dict[str, GraphCost]:
    """GraphCost of one call of each family (its stages summed)."""
    from toolchain.cost.onnx_graph import graph_cost

    out: dict[str, GraphCost] = {}
    for fam in model.widths:
        stages = model.sessions.chain(fam)
        total: GraphCost | None = None
        for st in stages:
            c = graph_cost(model.folder / st.file, name=st.name)
            total = c if total is None else total + c
        assert total is not None
        out[fam] = total
    return out


@dataclass
class Predictor:
    """Phone seconds of a model's calls: a cost model placed on the model's whole weights."""

    costs: dict[str, GraphCost]
    model: CostModel
    per_call: dict[str, float] = field(default_factory=dict)
    stage_prices: Any = None  # prices keys of single stages (tree policies); see cost/prices.py

    @classmethod
    def build(cls, sm: StepModel, device: str, dram_budget: float) -> Predictor:
        from toolchain.cost.prices import PhonePrices

        costs = family_costs(sm)
        cm = CostModel(device, dram_budget)
        cm.place(costs[sm.decode_family])  # one residency for every width of this model
        return cls(costs, cm, {f: cm.call_latency(c).total_s for f, c in costs.items()},
                   PhonePrices(sm, device, dram_budget))

    def seconds(self, key: str) -> float:
        if key not in self.per_call:  # `body:<family>`, `stage:<graph>`, ...: calls of part of a family
            self.per_call[key] = self.stage_prices.seconds(key)
        return self.per_call[key]

    def total(self, calls: Counter[str]) -> float:
        return sum(n * self.seconds(f) for f, n in calls.items())


def baseline_labels(baselines: list[Any]) -> list[str]:
    """Row labels of --baseline artifacts: their names, or their folders' names where two share a
    name (two compiles of one recipe, one kept under another folder), so no row replaces another."""
    names = [b.name for b in baselines]
    if len(set(names)) == len(names):
        return names
    folders = [b.folder.name for b in baselines]
    return [f if folders.count(f) == 1 else f"{f}#{i + 1}" for i, f in enumerate(folders)]


# A greedy output may leave ar's where the target's two best logits are closer than graphs of different
# widths round alike (e.g. 3.8e-6 apart on SmolLM2 at 2 threads): the compile's own tolerance between
# a graph and its source (the recipes' max_abs) bounds what counts as such a tie.
TIE_LOGITS = 1e-3


def first_divergence(target: StepModel, ids: list[int], ref: list[int], out: list[int],
                     tol: float = TIE_LOGITS) -> dict[str, Any]:
    """Where a greedy output first leaves ar's, and whether the target's logits there (after the prompt
    and ar's tokens before it) put ar's token and the policy's within `tol` of each other: a float tie,
    not a policy bug. Resets the target."""
    d = next((i for i, (a, b) in enumerate(zip(ref, out, strict=False)) if a != b), None)
    if d is None:  # one output stops early (an end token or the budget): not a tie between two tokens
        return {"position": min(len(ref), len(out)), "gap": None, "tie": False}
    target.reset()
    logits = target.prefill([*ids, *ref[:d]])
    target.reset()
    gap = float(logits[ref[d]] - logits[out[d]])
    return {"position": d, "gap": gap, "tie": abs(gap) <= tol}


def _progress(name: str, p: dict[str, Any]) -> str:
    calls = sum(p["target_calls"].values())
    same = "" if p["identical_to_ar"] else " (float tie)" if (p["divergence"] or {}).get("tie") else " MISMATCH"
    return f"{name} {p['tokens'] / max(p['seconds'], 1e-9):.1f} tok/s, {p['tokens'] / max(calls, 1):.2f} tok/call{same}"


@dataclass
class CallCost:
    """One model's decode-phase calls and their wall time on this CPU, per family, over a whole bench."""
    calls: Counter = field(default_factory=Counter)
    seconds: Counter = field(default_factory=Counter)

    def add(self, calls: Counter, seconds: Counter) -> None:
        self.calls.update(calls)
        self.seconds.update(seconds)


def model_names(target: StepModel, draft: Any, other_drafts: Sequence[Any]) -> dict[str, str]:
    """The bench's model keys (its predictors') -> the artifact names a reader knows them by."""
    names = {"target": target.name}
    if draft is not None:
        names["draft"] = step_model(draft).name
    names.update({f"draft{i}": step_model(d).name for i, d in enumerate(other_drafts)})
    return names


def call_cost_rows(costs: dict[str, CallCost], names: dict[str, str]) -> list[dict[str, Any]]:
    """Measured ms per call of every family each model ran, and each against one target decode call (the
    figure a draft's cost is judged by: a draft call per drafted token against a target step)."""
    def ms(c: CallCost, fam: str) -> float:
        return 1e3 * c.seconds[fam] / c.calls[fam]

    target = costs.get("target")
    step_ms = ms(target, "decode") if target and target.calls["decode"] else None
    return [{"model": names.get(key, key), "key": key, "family": fam, "calls": c.calls[fam], "ms_per_call": ms(c, fam),
             "vs_target_decode": ms(c, fam) / step_ms if step_ms else None}
            for key, c in costs.items() for fam in sorted(c.calls) if c.calls[fam] and fam in c.seconds]


@dataclass
class PolicyResult:
    name: str
    tokens: int = 0
    seconds: float = 0.0  # decode-phase wall time on this CPU
    phone_seconds: float = 0.0
    target_calls: int = 0
    verify_calls: int = 0
    accepted: int = 0
    identical: int = 0  # prompts whose tokens equal ar's (greedy)
    ties: int = 0  # ... of the others: those that left ar's tokens at a float tie (first_divergence)
    prompts: list[dict[str, Any]] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        tps = self.tokens / self.seconds if self.seconds else 0.0
        return {
            "policy": self.name, "tokens": self.tokens, "tokens_per_s_cpu": tps,
            "accepted_per_verify": self.accepted / self.verify_calls if self.verify_calls else None,
            "tokens_per_target_call": self.tokens / self.target_calls if self.target_calls else None,
            "target_calls_per_token": self.target_calls / self.tokens if self.tokens else None,
            "phone_ms_per_token": 1e3 * self.phone_seconds / self.tokens if self.tokens else None,
            "identical_to_ar": self.identical, "ties_with_ar": self.ties,
            "prompt_ms_median": (1e3 * float(np.median(firsts))
                                 if (firsts := [p["prompt_seconds"] for p in self.prompts if p["prompt_seconds"]])
                                 else None),
        }


def bench_decode(target: StepModel, draft: StepModel | None, policies: list[str], prompts: list[str],
                 max_new_tokens: int, gamma: int, temperature: float, device: str,
                 target_dram: float, draft_dram: float, log=print,
                 baselines: list[StepModel] = (), other_drafts: list[Any] = ()) -> dict[str, Any]:
    """`baselines`: other artifacts of the same model (e.g. the float one beside an int4 one), each
    decoded by ar on the same prompt ids, interleaved prompt by prompt with the target's policies;
    their rows are named `ar@<artifact name>` and compared token for token with the target's ar.
    `other_drafts`: more drafts for the same speculative policies (e.g. a draft head beside a
    layer-truncated draft); their rows are named `<policy>@<draft folder name>`."""
    if "ar" not in policies:
        policies = ["ar", *policies]  # the baseline every ratio is read against
    pol = {name: make_policy(name, target, draft, gamma=gamma) for name in policies}
    owner = {name: "target" for name in policies}
    draft_key = {name: "draft" for name in policies}
    for i, d in enumerate(other_drafts):
        for name in policies:
            if name != "ar":
                row = f"{name}@{step_model(d).folder.name}"
                pol[row], owner[row], draft_key[row] = make_policy(name, target, d, gamma=gamma), "target", f"draft{i}"
    labels = baseline_labels(baselines)
    for b, label in zip(baselines, labels, strict=True):
        name = f"ar@{label}"
        pol[name], owner[name] = make_policy("ar", b), name
    for m in (target, draft, *baselines, *other_drafts):
        if m is not None:
            warmup(step_model(m))
    predictors = {"target": Predictor.build(target, device, target_dram)}
    if draft is not None:
        predictors["draft"] = Predictor.build(step_model(draft), device, draft_dram)
    for i, d in enumerate(other_drafts):
        predictors[f"draft{i}"] = Predictor.build(step_model(d), device, draft_dram)
    for b, label in zip(baselines, labels, strict=True):
        predictors[f"ar@{label}"] = Predictor.build(b, device, target_dram)
    tok = target.tokenizer
    widest_verify = target.widths[target.family_for(gamma + 1)] if draft is not None else 1
    results = {name: PolicyResult(name) for name in pol}
    costs: dict[str, CallCost] = {}  # per model (its predictor's key): decode-phase calls and seconds per family
    skipped = 0
    for i, text in enumerate(prompts):
        ids = encode(tok, text)
        # same budget for every policy, and no policy may run out of context
        n_new = min(max_new_tokens, target.context - widest_verify - len(ids) - 1)
        if n_new < 8:
            skipped += 1
            continue
        ref: list[int] | None = None
        for name, p in pol.items():
            sampler = Sampler(temperature, seed=i)
            t = time.perf_counter()
            out: list[int] = []
            first = None  # prompt processing: until the first new token is out (the peers' figure)
            for chunk in p.generate(ids, n_new, sampler):
                first = time.perf_counter() - t if first is None else first
                out.extend(chunk)
            wall = time.perf_counter() - t - p.stats.prefill_seconds
            s = p.stats
            r = results[name]
            phone = s.phone_seconds(predictors[owner[name]], predictors.get(draft_key.get(name, "draft")))
            same = ref is None or out == ref
            if name == "ar":
                ref = out
            costs.setdefault(owner[name], CallCost()).add(s.target_calls, s.target_family_seconds)
            if s.draft_calls:
                costs.setdefault(draft_key.get(name, "draft"), CallCost()).add(s.draft_calls, s.draft_family_seconds)
            r.tokens += len(out)
            r.seconds += wall
            r.phone_seconds += phone
            r.target_calls += s.n_target_calls
            r.verify_calls += len(s.accepted)
            r.accepted += sum(s.accepted)
            r.identical += int(same)
            div = None
            if not same and temperature == 0 and owner[name] == "target":
                div = first_divergence(target, ids, ref, out)
                r.ties += int(div["tie"])
            r.prompts.append({"prompt": i, "prompt_tokens": len(ids), "tokens": len(out), "seconds": wall,
                              "prompt_seconds": first,
                              "phone_seconds": phone, "target_calls": dict(s.target_calls),
                              "draft_calls": dict(s.draft_calls), "accepted": s.accepted,
                              "identical_to_ar": same, "divergence": div, "output": out})
        log(f"prompt {i + 1}/{len(prompts)}: " + ", ".join(_progress(n, results[n].prompts[-1]) for n in pol))
    rows = [r.row() for r in results.values()]
    base = results["ar"]
    for row, r in zip(rows, results.values(), strict=True):
        row["speedup_cpu"] = (r.tokens / r.seconds) / (base.tokens / base.seconds) if r.seconds else None
        row["speedup_phone"] = ((base.phone_seconds / base.tokens) / (r.phone_seconds / r.tokens)
                                if r.phone_seconds else None)
    return {
        "target": target.name, "draft": draft.name if draft else None, "gamma": gamma,
        "temperature": temperature, "device": device, "target_dram_budget": target_dram,
        "draft_dram_budget": draft_dram, "max_new_tokens": max_new_tokens,
        "prompts": len(prompts) - skipped, "skipped_prompts": skipped,
        "phone_ms_per_call": {k: {f: 1e3 * s for f, s in p.per_call.items()} for k, p in predictors.items()},
        "cpu_calls": call_cost_rows(costs, model_names(target, draft, other_drafts)),
        "rows": rows, "details": {n: r.prompts for n, r in results.items()},
    }
