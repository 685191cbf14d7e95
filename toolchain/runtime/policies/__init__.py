"""Decoding policies behind one interface (base.Policy); `make_policy` builds one by name."""

from __future__ import annotations

from toolchain.errors import MobcError
from toolchain.runtime.model import StepModel
from toolchain.runtime.policies.ar import AR
from toolchain.runtime.policies.base import Policy, RunStats
from toolchain.runtime.policies.chain import Chain
from toolchain.runtime.policies.sampling import Sampler, accept_chain

POLICIES: dict[str, type[Policy]] = {"ar": AR, "chain": Chain}


def make_policy(name: str, target: StepModel, draft: StepModel | None = None, gamma: int = 4) -> Policy:
    if name not in POLICIES:
        raise MobcError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    if name == "chain":
        return Chain(target, draft, gamma=gamma)
    return POLICIES[name](target, draft)


__all__ = ["AR", "Chain", "POLICIES", "Policy", "RunStats", "Sampler", "accept_chain", "make_policy"]
