"""Decoding policies behind one interface (base.Policy); `make_policy` builds one by name."""

from __future__ import annotations

from toolchain.errors import MobcError
from toolchain.runtime.model import StepModel
from toolchain.runtime.policies.ar import AR
from toolchain.runtime.policies.base import Policy, RunStats
from toolchain.runtime.policies.chain import Chain
from toolchain.runtime.policies.sampling import Sampler, accept_chain

POLICIES: dict[str, type[Policy]] = {"ar": AR, "chain": Chain}
# diffusion LMs (toolchain/runtime/policies/diffusion.py, llada.py): LLaDA steps, Fast-dLLM threshold, llada
from toolchain.runtime.policies.diffusion import DiffusionPolicy, FastDLLM  # noqa: E402
from toolchain.runtime.policies.llada import LLaDA  # noqa: E402

POLICIES.update({"dllm": DiffusionPolicy, "fastdllm": FastDLLM, "llada": LLaDA})
# tree and asynchronous policies register themselves here (imported lazily: they pull in more)
LAZY_POLICIES = {"lever": "toolchain.runtime.policies.lever:make", "ahasd": "toolchain.runtime.policies.ahasd:make"}
# LoRA styles and DS2D self-speculation: artifacts compiled with lora_inputs / forecast_inputs
LAZY_POLICIES.update({"ctg": "toolchain.runtime.policies.ctg:make", "ds2d": "toolchain.runtime.policies.ds2d:make"})


def make_policy(name: str, target: StepModel, draft: StepModel | None = None, gamma: int = 4,
                **options) -> Policy:
    """Build a policy by name; `options` go to policies that take them (e.g. lever's cost profile).

    `+lookup` on any drafting policy (chain+lookup, lever+lookup, ahasd+lookup) blends the context's
    own continuation into the draft's proposals (toolchain/runtime/lookup.py)."""
    parts = name.split("+")
    if "lookup" in parts:
        if draft is None:
            raise MobcError(f"policy {name}: +lookup adds proposals to a draft model's; pass --draft too")
        from toolchain.runtime.lookup import LookupDraft

        parts.remove("lookup")
        policy = make_policy("+".join(parts), target, LookupDraft(draft), gamma=gamma, **options)
        policy.name = name
        return policy
    base, _, variant = name.partition("+")  # e.g. lever+prune: a named configuration of a policy
    if base in LAZY_POLICIES:
        import importlib

        module, _, fn = LAZY_POLICIES[base].partition(":")
        return getattr(importlib.import_module(module), fn)(target, draft, gamma=gamma, variant=variant, **options)
    if name not in POLICIES:
        raise MobcError(f"unknown policy {name!r}; choose one of {', '.join([*POLICIES, *LAZY_POLICIES])}")
    if name == "chain":
        return Chain(target, draft, gamma=gamma, extend_at=options.get("extend_at", 0.8))
    return POLICIES[name](target, draft)


__all__ = ["AR", "Chain", "POLICIES", "Policy", "RunStats", "Sampler", "accept_chain", "make_policy"]
