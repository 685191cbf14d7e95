"""`mobc bench ctg` and `mobc bench ds2d`: the issue-7 policies against their baselines, same process.

ctg: K styles of each prompt decoded together (one width-K call per step over the shared
prompt cache) vs K sequential width-1 runs of the same styles. Decode tokens/s excludes the
prompt (sequential runs prefill it K times, CTG once: the end-to-end column includes that).
With temperature 0 the bench checks CTG's tokens equal the sequential runs' (shared prefix).

ds2d: greedy AR vs DS2D on the same prompts: decode tokens/s, drafts accepted per round,
tokens per call, and whether DS2D reproduced AR's tokens exactly on every prompt.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from toolchain.runtime.adapters import Adapter
from toolchain.runtime.model import StepModel
from toolchain.runtime.policies import Sampler, make_policy
from toolchain.runtime.policies.ctg import bind_adapters, sequential_styles


def _tok(model: StepModel, text: str) -> list[int]:
    return model.tokenizer(text).input_ids


def phone_per_call(model: StepModel, device: str = "snapdragon-8-gen-3", dram: float = 1.0) -> dict[str, float]:
    """Predicted phone seconds of one call per family (toolchain/cost/model.py; weights resident)."""
    from toolchain.bench.decode import family_costs
    from toolchain.cost.model import CostModel

    costs = family_costs(model)
    cm = CostModel(device, dram)
    cm.place(costs[model.decode_family])
    return {f: cm.call_latency(c).total_s for f, c in costs.items()}


def bench_ctg(model: StepModel, styles: Sequence[Adapter | None], prompts: Sequence[str], max_new_tokens: int,
              log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    k = len(styles)
    rows = []
    for i, text in enumerate(prompts):
        ids = _tok(model, text)
        budget = min(max_new_tokens, (model.context - model.widths[model.family_for(k)] - len(ids)) // k)
        if budget < 4:
            log(f"prompt {i}: {len(ids)} tokens leave no room for {k} styles; skipped")
            continue
        pol = make_policy("ctg", model, styles=list(styles))
        t0 = time.perf_counter()
        list(pol.generate(ids, budget, Sampler()))
        ctg_total = time.perf_counter() - t0
        ctg_decode = pol.stats.target_seconds
        ctg_tokens = sum(len(o) for o in pol.outputs)
        t0 = time.perf_counter()
        model.calls.clear()
        model.seconds.clear()
        seq = sequential_styles(model, ids, styles, budget, Sampler())
        seq_total = time.perf_counter() - t0
        seq_decode = float(model.seconds[model.decode_family])  # width-1 calls: the decode phase
        seq_tokens = sum(len(o) for o in seq)
        # CTG's rows run until every style stops; compare tokens each style actually kept
        identical = sum(1 for a, b in zip(pol.outputs, seq, strict=True) if a == b)
        rows.append({"prompt": i, "prompt_tokens": len(ids), "new_tokens_per_style": budget,
                     "ctg_tokens": ctg_tokens, "ctg_calls": pol.stats.n_target_calls, "ctg_decode_s": ctg_decode,
                     "ctg_total_s": ctg_total, "seq_tokens": seq_tokens, "seq_decode_s": seq_decode,
                     "seq_total_s": seq_total, "identical_styles": identical,
                     "distinct_styles": len({tuple(o) for o in pol.outputs}), "outputs": pol.outputs})
        log(f"prompt {i}: ctg {ctg_tokens / ctg_decode:.1f} tok/s, sequential {seq_tokens / seq_decode:.1f} tok/s, "
            f"{identical}/{k} styles identical")
    bind_adapters(model, [])
    phone = phone_per_call(model)
    fam = model.family_for(k)
    phone_ctg = sum(r["ctg_calls"] for r in rows) * phone[fam]
    phone_seq = sum(r["seq_tokens"] for r in rows) * phone[model.decode_family]  # one width-1 call per token
    tot = {key: sum(r[key] for r in rows) for key in ("ctg_tokens", "ctg_decode_s", "ctg_total_s", "seq_tokens",
                                                      "seq_decode_s", "seq_total_s", "identical_styles")}
    ctg_tps = tot["ctg_tokens"] / max(tot["ctg_decode_s"], 1e-9)
    seq_tps = tot["seq_tokens"] / max(tot["seq_decode_s"], 1e-9)
    return {"artifact": model.name, "k": k, "styles": [s.name if s else "base" for s in styles],
            "prompts": len(rows), "ctg_tokens_per_s": ctg_tps, "sequential_tokens_per_s": seq_tps,
            "ratio_decode": ctg_tps / seq_tps,
            "ratio_end_to_end": (tot["ctg_tokens"] / tot["ctg_total_s"]) / (tot["seq_tokens"] / tot["seq_total_s"]),
            "identical_styles": tot["identical_styles"], "total_styles": k * len(rows),
            "phone_ms_per_token_ctg": 1e3 * phone_ctg / max(tot["ctg_tokens"], 1),
            "phone_ms_per_token_sequential": 1e3 * phone_seq / max(tot["seq_tokens"], 1), "rows": rows}


def bench_ds2d(model: StepModel, forecast: np.ndarray, prompts: Sequence[str], max_new_tokens: int,
               depth: int | None = None, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    rows = []
    for i, text in enumerate(prompts):
        ids = _tok(model, text)
        out: dict[str, Any] = {"prompt": i, "prompt_tokens": len(ids)}
        for name in ("ar", "ds2d"):
            opts = {"forecast": forecast, "depth": depth} if name == "ds2d" else {}
            pol = make_policy(name, model, **opts)
            tokens = [t for chunk in pol.generate(ids, max_new_tokens, Sampler()) for t in chunk]
            out[name] = {"tokens": tokens, "decode_s": pol.stats.target_seconds,
                         "calls": pol.stats.n_target_calls, "accepted": list(pol.stats.accepted)}
        out["identical"] = out["ar"]["tokens"] == out["ds2d"]["tokens"]
        rows.append(out)
        acc = out["ds2d"]["accepted"]
        log(f"prompt {i}: {len(out['ar']['tokens'])} tokens, ds2d {np.mean(acc) if acc else 0:.2f} accepted/round, "
            f"identical {out['identical']}")
    def total(name: str, key: str) -> float:
        return float(sum(r[name][key] for r in rows))

    ar_tok = sum(len(r["ar"]["tokens"]) for r in rows)
    ds_tok = sum(len(r["ds2d"]["tokens"]) for r in rows)
    accepted = [a for r in rows for a in r["ds2d"]["accepted"]]
    phone = phone_per_call(model)
    ds_fam = model.family_for((min(depth or forecast.shape[0], forecast.shape[0]) + 1) ** 2)
    ar_tps = ar_tok / max(total("ar", "decode_s"), 1e-9)
    ds_tps = ds_tok / max(total("ds2d", "decode_s"), 1e-9)
    return {"artifact": model.name, "m": int(forecast.shape[0]), "prompts": len(rows),
            "ar_tokens_per_s": ar_tps, "ds2d_tokens_per_s": ds_tps, "speedup": ds_tps / ar_tps,
            "accepted_per_round": float(np.mean(accepted)) if accepted else 0.0,
            "tokens_per_call": ds_tok / max(total("ds2d", "calls"), 1.0),
            "identical": sum(r["identical"] for r in rows),
            "phone_ms_per_token_ar": 1e3 * total("ar", "calls") * phone[model.decode_family] / max(ar_tok, 1),
            "phone_ms_per_token_ds2d": 1e3 * total("ds2d", "calls") * phone[ds_fam] / max(ds_tok, 1), "rows": rows}
