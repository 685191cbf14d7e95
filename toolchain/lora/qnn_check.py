"""Real LoRA adapters on an artifact's QNN HTP context binaries, compared with the CPU EP.

An artifact compiled with `lora_inputs` and a `qnn:` section has one context binary per graph
(part) whose lora_A / lora_B / lora_rows inputs are still inputs, so an adapter is bound at run
time, not compiled in. This module proves it on real decoding, call by call:

  - `TeeModel` is a CPU StepModel that runs every call a second time through the HTP binaries
    (the family's whole part chain, on the same cache contents, adapters and masks) and records
    max |HTP - CPU| of the logits and new K/V rows of the real (non-padding) rows, and whether
    each row's argmax agrees. The CPU picks the tokens, so the HTP is never judged on a
    trajectory it caused (no drift from an early flip), and each call's difference is the
    binaries' own.
  - per adapter (and the zero adapter, i.e. the base model): a greedy request, whose prompt runs
    through the widest graph (e.g. ctg, width 8) and whose tokens run through decode (width 1);
  - a CTG run: K styles over one prompt cache, each row of one call under its own adapter slot.

Records go to <artifact>/qnn/adapters_qnn.json; the manifest is left untouched.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from toolchain.artifact.manifest import Manifest
from toolchain.errors import ArtifactError
from toolchain.qnn import context as qnn
from toolchain.qnn.lockstep import ContextSessions
from toolchain.runtime.adapters import Adapter, resolve_adapter
from toolchain.runtime.model import StepModel
from toolchain.runtime.policies.ctg import CTG, sequential_styles
from toolchain.runtime.policies.sampling import Sampler

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
RESULT_FILE = "adapters_qnn.json"


def htp_sessions(artifact: Path) -> ContextSessions:
    """Sessions over the context binaries the compile's qnn stage wrote (manifest["qnn"])."""
    records = Manifest.load(artifact).qnn or []
    built = [r for r in records if r.get("context_model")]
    if not built:
        raise ArtifactError(
            f"{artifact} has no QNN context binaries; compile a recipe with a `qnn:` section "
            "(e.g. recipes/smollm2-135m-lora-qnn.yaml)"
        )
    first = built[0]
    ctx = {r["graph"]: artifact / "qnn" / r["context_model"] for r in built}
    return ContextSessions(
        artifact, ctx, qnn.provider_options(first["soc_model"], first["htp_arch"], first["fp16"])
    )


class TeeModel(StepModel):
    """A CPU StepModel whose every call also runs on the HTP binaries; `log` holds the differences."""

    def __init__(self, folder: Path, htp: ContextSessions):
        super().__init__(folder, io_binding=False)
        self.htp = htp
        self.log: list[dict[str, Any]] = []
        self.cpu_last: list[np.ndarray] = []  # CPU logits of each call's last real row
        self.label = ""

    def forward(
        self,
        tokens: Sequence[int],
        allowed_new: np.ndarray | None = None,
        depths: Sequence[int] | None = None,
        family: str | None = None,
        past_allowed: np.ndarray | None = None,
        first_row: int = 0,
    ) -> np.ndarray:
        family = family or self.family_for(len(tokens))
        logits = super().forward(tokens, allowed_new, depths, family, past_allowed, first_row)
        cpu = self._last[1] if self._last else {}
        feeds = self.cache.step_inputs(
            tokens, self.widths[family], allowed_new, depths, past_allowed=past_allowed, first_row=first_row
        )
        feeds.update(self.extra_inputs(family))
        t = time.perf_counter()
        htp = self.htp.run_family(family, feeds)
        seconds = time.perf_counter() - t
        rows = slice(first_row, first_row + len(tokens))
        got = np.asarray(htp["logits"][0, rows], np.float64)
        kv = 0.0
        for name, ref in cpu.items():  # new K rows are [..., D, N], new V rows [..., N, D]
            if name.startswith("new_key"):
                kv = max(kv, float(np.abs(htp[name][..., rows] - ref[..., rows]).max()))
            elif name.startswith("new_value"):
                kv = max(kv, float(np.abs(htp[name][..., rows, :] - ref[..., rows, :]).max()))
        finite = bool(np.isfinite(got).all())
        self.cpu_last.append(logits[-1])
        self.log.append(
            {
                "label": self.label,
                "family": family,
                "rows": len(tokens),
                "logits_max_abs": float(np.abs(got - logits).max()) if finite else float("inf"),
                "kv_max_abs": kv,
                "argmax_agree": int((got.argmax(-1) == logits.argmax(-1)).sum()),
                "htp_seconds": round(seconds, 2),
            }
        )
        return logits


def _summary(calls: list[dict[str, Any]]) -> dict[str, Any]:
    rows = sum(c["rows"] for c in calls)
    return {
        "calls": len(calls),
        "calls_by_family": {
            f: sum(c["family"] == f for c in calls) for f in dict.fromkeys(c["family"] for c in calls)
        },
        "rows": rows,
        "logits_max_abs": max(c["logits_max_abs"] for c in calls),
        "logits_median_abs": float(np.median([c["logits_max_abs"] for c in calls])),
        "kv_max_abs": max(c["kv_max_abs"] for c in calls),
        "argmax_agreement": sum(c["argmax_agree"] for c in calls) / rows,
        "htp_seconds": round(sum(c["htp_seconds"] for c in calls), 1),
    }


def check_adapters(
    artifact: str | Path,
    adapters: Sequence[str],
    tokens: int = 16,
    ctg_steps: int = 4,
    prompt: str = PROMPT,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Greedy requests with no adapter and with each adapter, and (with >= 1 adapter and a graph of
    width >= 2) a CTG run mixing them per row, each call compared HTP vs CPU. Writes RESULT_FILE."""
    artifact = Path(artifact)
    qnn.require()
    model = TeeModel(artifact, htp_sessions(artifact))
    loaded: list[Adapter | None] = [None] + [resolve_adapter(artifact, a) for a in adapters]
    ids = model.tokenizer(prompt).input_ids
    greedy = Sampler()
    result: dict[str, Any] = {
        "artifact": artifact.name,
        "prompt_tokens": len(ids),
        "requests": [],
        "ctg": None,
    }
    prompt_calls = -(-len(ids) // max(model.widths.values()))  # feed() runs the prompt in the widest graph
    base_last = None
    for ad in loaded:
        model.label = ad.name if ad else "base"
        model.log, model.cpu_last = [], []
        (out,) = sequential_styles(model, ids, [ad], tokens, greedy, shared_prefix=False)
        last = model.cpu_last[prompt_calls - 1]  # the CPU logits of the last prompt token
        base_last = last if base_last is None else base_last
        row = {
            "adapter": model.label,
            "rank": ad.rank if ad else 0,
            "tokens": out,
            "adapter_effect_max_abs": float(np.abs(last - base_last).max()),
            **_summary(model.log),
        }
        result["requests"].append(row)
        log(
            f"{model.label}: {row['calls']} calls, max |logits diff| {row['logits_max_abs']:.4g}, "
            f"argmax {row['argmax_agreement'] * 100:.1f}%, tokens {out}"
        )
    widest = max(model.widths.values())
    named = [a for a in loaded if a is not None]
    if named and widest >= 2 and ctg_steps > 0:
        styles = [([*named, None])[i % (len(named) + 1)] for i in range(widest)]
        model.label, model.log = "ctg", []
        pol = CTG(model, None, styles)
        for _ in pol.generate(ids, ctg_steps, greedy):
            pass
        result["ctg"] = {
            "styles": [s.name if s else "base" for s in styles],
            "outputs": pol.outputs,
            **_summary(model.log),
        }
        log(
            f"ctg K={widest}: {result['ctg']['calls']} calls, max |logits diff| "
            f"{result['ctg']['logits_max_abs']:.4g}, argmax {result['ctg']['argmax_agreement'] * 100:.1f}%"
        )
    (artifact / "qnn" / RESULT_FILE).write_text(json.dumps(result, indent=1) + "\n")
    return result
