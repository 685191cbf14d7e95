"""`mobc bench lever`: tree and asynchronous policies beside ar and chain, in one process.

Produces, from one run over the same prompts:
- the decode table (as `mobc bench decode`): CPU tok/s, tokens per target call, predicted
  phone ms/token and speedups vs ar and vs chain, greedy equality with ar per prompt;
- the ablation table: gain/cost trees only, + predictor pruning, + logits on the accepted path;
- the DRAM-budget sweep: 0%, 50%, 100% of the target's layers resident (lever re-runs because
  its decisions read the cost model; ar, chain and ahasd are re-priced from their recorded calls);
- a PNG of expected tokens per cycle vs tree size (the builder's calibrated estimate, averaged
  over cycles) with the tokens observed per cycle at each chosen width.

Phone time is priced per call key by cost/prices.PhonePrices (families, `body:`, `stage:`,
`head:`/`tail:` keys), target and draft under their own DRAM budgets; ahasd's phone time is a
replay of its observed dependency order on two concurrent units (AhasdStats.phone_seconds).
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from toolchain.bench.decode import first_divergence, step_model
from toolchain.cost.prices import PhonePrices
from toolchain.runtime.model import StepModel
from toolchain.runtime.policies import Sampler, make_policy
from toolchain.runtime.policies.ahasd import AhasdStats
from toolchain.runtime.policies.base import RunStats
from toolchain.runtime.policies.lever import LeverStats


@dataclass
class Run:
    name: str
    outputs: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0
    tokens: int = 0
    identical: int = 0
    ties: int = 0  # outputs that left ar's at a float tie (toolchain/bench/decode.py first_divergence)
    divergence: dict[int, dict[str, Any]] = field(default_factory=dict)  # prompt -> where it left ar's
    phone_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    stats: list[RunStats] = field(default_factory=list)  # per prompt: calls, acceptance; re-priced by the sweep

    @property
    def accepted(self) -> list[int]:
        """Drafts accepted per verify call, over every prompt."""
        return [k for s in self.stats for k in s.accepted]

    @property
    def target_calls(self) -> int:
        return sum(s.n_target_calls for s in self.stats)

    def reprice(self, target: PhonePrices, draft: PhonePrices) -> float:
        """Phone seconds of the recorded runs under other prices (another DRAM budget)."""
        return sum(s.phone_seconds(target, draft) for s in self.stats)


class LeverBench:
    def __init__(self, target: StepModel, draft: StepModel, prompts: list[list[int]], max_new_tokens: int,
                 gamma: int, device: str, target_dram: float, draft_dram: float, log: Callable[[str], None] = print):
        self.target, self.draft, self.prompts = target, draft, prompts
        self.max_new, self.gamma, self.device = max_new_tokens, gamma, device
        self.target_dram, self.draft_dram = target_dram, draft_dram
        self.log = log
        self.d_price = PhonePrices(step_model(draft), device, draft_dram)  # a head: the graphs inside its adapter
        self.t_prices = {target_dram: PhonePrices(target, device, target_dram)}
        self.ref: list[list[int]] | None = None
        self.runs: dict[str, Run] = {}

    def t_price(self, dram: float) -> PhonePrices:
        if dram not in self.t_prices:
            self.t_prices[dram] = PhonePrices(self.target, self.device, dram)
        return self.t_prices[dram]

    def run(self, name: str, dram: float | None = None, label: str | None = None) -> Run:
        dram = self.target_dram if dram is None else dram
        label = label or name
        if label in self.runs:
            return self.runs[label]
        pol = make_policy(name, self.target, self.draft, gamma=self.gamma, device=self.device,
                          target_dram=dram, draft_dram=self.draft_dram)
        sig = self._signature(pol)
        same = None if sig is None else next((r for r in self.runs.values() if r.extra.get("signature") == sig), None)
        if same is not None:  # e.g. lever whose cost model chose full logits == lever+full: no need to re-run
            self.runs[label] = same
            self.log(f"{label}: same decisions as {same.name}, reusing its run")
            return same
        r = Run(label)
        r.extra["signature"] = sig
        tp = self.t_price(dram)
        t0 = time.perf_counter()
        for i, ids in enumerate(self.prompts):
            t = time.perf_counter()
            out = [x for chunk in pol.generate(ids, self.max_new, Sampler(0.0, seed=i)) for x in chunk]
            r.seconds += time.perf_counter() - t - pol.stats.prefill_seconds
            r.outputs.append(out)
            r.tokens += len(out)
            r.stats.append(copy.deepcopy(pol.stats))
            r.phone_seconds += pol.stats.phone_seconds(tp, self.d_price)
            st = pol.stats
            if isinstance(st, AhasdStats):
                r.extra.setdefault("overlap", []).append(st.overlap)
                r.extra.setdefault("pauses", []).append(st.pauses)
            if isinstance(st, LeverStats):
                for k in ("tree_nodes", "expected_tokens", "curves", "draft_calls_per_cycle"):
                    r.extra.setdefault(k, []).extend(getattr(st, k))
                r.extra.setdefault("widths", Counter()).update(st.widths)
                r.extra["logits_rows"] = r.extra.get("logits_rows", 0) + st.logits_rows
                r.extra["logits_rows_full"] = r.extra.get("logits_rows_full", 0) + st.logits_rows_full
                if st.prune is not None:
                    before = r.extra.get("prune", {})
                    r.extra["prune"] = {k: before.get(k, 0) + v for k, v in vars(st.prune).items()}
                    r.extra["tail_key"] = st.prune_key
        if name == "ar" and self.ref is None:
            self.ref = r.outputs
        if self.ref is not None:
            r.identical = sum(int(a == b) for a, b in zip(r.outputs, self.ref, strict=True))
            r.divergence = {i: first_divergence(self.target, ids, ref, out)
                            for i, (ids, ref, out) in enumerate(zip(self.prompts, self.ref, r.outputs, strict=True))
                            if out != ref}
            r.ties = sum(int(d["tie"]) for d in r.divergence.values())
        self.log(f"{label}: {r.tokens} tokens in {time.perf_counter() - t0:.0f} s")
        self.runs[label] = r
        return r

    def _signature(self, pol) -> str | None:
        if not isinstance(pol.stats, LeverStats):
            return None
        v = pol.verifier
        import dataclasses

        cfg = dataclasses.replace(pol.config, logits="")  # what logits mode did is in the verifier's modes
        modes = {w: v.modes.get(w, v.logits) for w in v.widths}
        return repr((cfg, sorted(modes.items()), type(v).__name__,
                     getattr(v, "spec", None) and v.spec.threshold, round(pol.t_prices.seconds(pol.target.decode_family), 9)))

    # ---- tables -------------------------------------------------------------------------------
    def row(self, r: Run, base: Run, chain: Run | None) -> dict[str, Any]:
        calls = r.target_calls
        verify = len(r.accepted)
        out = {
            "policy": r.name, "tokens": r.tokens, "tokens_per_s_cpu": r.tokens / r.seconds if r.seconds else None,
            "accepted_per_verify": sum(r.accepted) / verify if verify else None,
            "tokens_per_cycle": r.tokens / verify if verify else None,
            "target_calls_per_token": calls / r.tokens if r.tokens else None,
            "phone_ms_per_token": 1e3 * r.phone_seconds / r.tokens,
            "speedup_cpu": (r.tokens / r.seconds) / (base.tokens / base.seconds) if r.seconds else None,
            "speedup_phone": (base.phone_seconds / base.tokens) / (r.phone_seconds / r.tokens),
            "speedup_phone_vs_chain": ((chain.phone_seconds / chain.tokens) / (r.phone_seconds / r.tokens)
                                       if chain else None),
            "identical_to_ar": r.identical, "ties_with_ar": r.ties, "prompts": len(r.outputs),
            "divergence": r.divergence,
        }
        if "overlap" in r.extra:
            out["overlap"] = float(np.mean(r.extra["overlap"]))
        if "tree_nodes" in r.extra:
            out["mean_tree_nodes"] = float(np.mean(r.extra["tree_nodes"])) if r.extra["tree_nodes"] else None
            out["widths"] = dict(sorted(r.extra["widths"].items()))
            head_flops = self.t_price(self.target_dram).flops(f"stage:{self._row_head()}")
            saved = r.extra["logits_rows_full"] - r.extra["logits_rows"]
            out["lm_head_gflops_saved"] = saved * head_flops / 1e9
            out["lm_head_rows"] = f"{r.extra['logits_rows']}/{r.extra['logits_rows_full']}"
        if "prune" in r.extra:
            p = r.extra["prune"]
            out["pruned_nodes"] = f"{p['nodes'] - p['kept']}/{p['nodes']}"
            out["tail_rows_saved"] = p["tail_rows_saved"]
            per_row = self.t_price(self.target_dram).cost(r.extra["tail_key"]).flops_per_token
            out["verify_gflops_saved"] = p["tail_rows_saved"] * per_row / 1e9
        return out

    def _row_head(self) -> str:
        chain = self.target.sessions.chain(self.target.decode_family)
        return next((s.name for s in chain if s.role == "lm_head"), chain[-1].name)

    def table(self, names: list[str]) -> list[dict[str, Any]]:
        base = self.run("ar")
        for n in names:
            self.run(n)
        chain = self.runs.get("chain")  # after the runs: the table may be the one that runs chain
        return [{**self.row(self.runs[n], base, chain), "policy": n} for n in names]

    def sweep(self, budgets: list[float], lever_name: str) -> list[dict[str, Any]]:
        """Per budget: phone ms/token of ar/chain/ahasd (re-priced) and lever (re-run), speedups."""
        rows = []
        for b in budgets:
            tp = self.t_price(b)
            row: dict[str, Any] = {"target_dram": b}
            per = {}
            for name in ("ar", "chain", "ahasd"):
                r = self.runs.get(name)
                if r is not None:
                    per[name] = r.reprice(tp, self.d_price) / r.tokens
            lv = self.run(lever_name, dram=b, label=f"{lever_name}@{b:g}") if b != self.target_dram \
                else self.runs[lever_name]
            per[lever_name] = lv.phone_seconds / lv.tokens
            for k, v in per.items():
                row[f"{k}_ms"] = 1e3 * v
            row["lever_vs_ar"] = per["ar"] / per[lever_name]
            if "chain" in per:
                row["lever_vs_chain"] = per["chain"] / per[lever_name]
                row["chain_vs_ar"] = per["ar"] / per["chain"]
            row["lever_identical"] = lv.identical
            rows.append(row)
        return rows

    def plot(self, lever_name: str, path: Path) -> Path:
        from toolchain.bench.png import line_chart

        r = self.runs[lever_name]
        curves = r.extra.get("curves") or [np.ones(1)]
        n = max(len(c) for c in curves)
        padded = np.array([np.concatenate([c, np.full(n - len(c), c[-1])]) for c in curves])
        mean = padded.mean(0)
        series = {"expected tokens/cycle (calibrated gains)": (list(range(1, n + 1)), list(mean))}
        widths = sorted(r.extra["widths"])
        obs_x, obs_y = [], []
        nodes = np.array(r.extra["tree_nodes"])
        acc = np.array(r.accepted[: len(nodes)]) + 1
        for lo, hi in zip([0, *widths], widths, strict=False):
            sel = (nodes > lo) & (nodes <= hi)
            if sel.any():
                obs_x.append(float(nodes[sel].mean()))
                obs_y.append(float(acc[sel].mean()))
        if obs_x:
            series["observed tokens/cycle"] = (obs_x, obs_y)
        path.parent.mkdir(parents=True, exist_ok=True)
        return line_chart(path, series, f"{self.target.name} {lever_name} on {self.device}",
                          "tree size (nodes)", "tokens per cycle", marks=widths)
