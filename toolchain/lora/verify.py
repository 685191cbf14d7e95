"""`mobc adapter verify`: an artifact with a packed adapter bound vs PEFT's own model, and merged.

Per adapter: max |logits| difference on real text between (a) the artifact with the adapter
bound, (b) PEFT's PeftModel over the source model, (c) the merged model (PEFT merge_adapter);
the adapter's effect size (|PEFT - base|, so a diff of 1e-5 means something); greedy tokens of
the artifact vs PEFT's generate; and the artifact with zero adapters vs the base model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from toolchain.compile.verify import real_text
from toolchain.runtime.adapters import resolve_adapter
from toolchain.runtime.model import StepModel
from toolchain.runtime.policies import Sampler, make_policy
from toolchain.runtime.policies.ctg import bind_adapters


def artifact_logits(model: StepModel, ids: Sequence[int]) -> np.ndarray:
    """Logits [len(ids), V] through the artifact's graphs, causal, in widest-graph chunks."""
    model.reset(stats=False)
    widest = max(model.widths.values())
    out = []
    for start in range(0, len(ids), widest):
        chunk = list(ids[start : start + widest])
        out.append(model.forward(chunk))
        model.commit(range(len(chunk)))
    return np.concatenate(out)


@torch.no_grad()
def _torch_logits(model: Any, ids: Sequence[int]) -> np.ndarray:
    return model(torch.tensor([list(ids)])).logits[0].float().numpy()


def _diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def verify_adapters(artifact: Path, names: Sequence[str], loaded: Any, n_tokens: int, n_greedy: int,
                    log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    from peft import PeftModel

    model = StepModel(artifact)
    base = loaded.model
    ids = loaded.tokenizer(real_text()).input_ids[:n_tokens]
    prompt = loaded.tokenizer(model.manifest.recipe["verify"]["prompt"]).input_ids
    base_logits = _torch_logits(base, ids)
    bind_adapters(model, [])
    zero_vs_base = _diff(artifact_logits(model, ids), base_logits)
    rows = []
    for name in names:
        ad = resolve_adapter(artifact, name)
        peft_dir = ad.meta.get("peft_dir")
        if not peft_dir or not Path(peft_dir).is_dir():
            raise FileNotFoundError(f"adapter {name}: its PEFT folder {peft_dir} is gone; verify needs it")
        peft = PeftModel.from_pretrained(base, peft_dir).eval()
        peft_logits = _torch_logits(peft, ids)
        with torch.no_grad():
            ref = peft.generate(torch.tensor([prompt]), max_new_tokens=n_greedy, do_sample=False,
                                eos_token_id=model.eos_ids or None)[0, len(prompt):].tolist()
        peft.merge_adapter()
        merged_logits = _torch_logits(peft, ids)
        peft.unmerge_adapter()
        peft.unload()  # the base model without LoRA layers again, for the next adapter
        bind_adapters(model, [ad], 0)
        art = artifact_logits(model, ids)
        ours = [t for c in make_policy("ar", model).generate(prompt, n_greedy, Sampler()) for t in c]
        row = {"adapter": name, "rank": ad.rank, "artifact_vs_peft": _diff(art, peft_logits),
               "artifact_vs_merged": _diff(art, merged_logits), "peft_vs_merged": _diff(peft_logits, merged_logits),
               "peft_vs_base": _diff(peft_logits, base_logits), "zero_vs_base": zero_vs_base,
               "greedy_identical": ours == ref[: len(ours)], "greedy_artifact": ours, "greedy_peft": ref,
               "greedy_differs_from_base": None}
        rows.append(row)
        log(f"{name}: |artifact - peft| {row['artifact_vs_peft']:.2e}, effect {row['peft_vs_base']:.3f}")
    bind_adapters(model, [])
    base_greedy = [t for c in make_policy("ar", model).generate(prompt, n_greedy, Sampler()) for t in c]
    for row in rows:
        row["greedy_differs_from_base"] = row["greedy_artifact"] != base_greedy
    return {"artifact": model.name, "tokens": len(ids), "base_greedy": base_greedy, "rows": rows}
