"""Decoding policies behind one interface (base.Policy); `make_policy` builds one by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from toolchain.errors import MobcError
from toolchain.runtime.model import StepModel
from toolchain.runtime.policies.ar import AR
from toolchain.runtime.policies.base import Policy, RunStats
from toolchain.runtime.policies.chain import EXTEND_AT, EXTEND_ROWS, RUN_MATCH, Chain
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
    own continuation into the draft's proposals (toolchain/runtime/lookup.py). A `:key=value` suffix
    sets a policy option by name, so a bench can put settings side by side in one run (chain:extend=0.5)."""
    spec = name
    name, colon, settings = name.partition(":")
    if colon:
        policy = make_policy(name, target, draft, gamma=gamma, **{**options, **policy_settings(spec, name, settings)})
        policy.name = spec
        return policy
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
        return Chain(target, draft, gamma=gamma, extend_at=options.get("extend_at", EXTEND_AT),
                     extend_rows=options.get("extend_rows", EXTEND_ROWS), run_match=options.get("run_match"))
    return POLICIES[name](target, draft)


class Setting(NamedTuple):
    """A `<policy>:key=value` setting: the policies that take it, the make_policy option it sets, what it
    means, and how its value is read (`parse` raises ValueError for a value outside `form`)."""

    policies: frozenset[str]
    option: str
    meaning: str
    form: str
    parse: Callable[[str], float]


def _probability(value: str) -> float:
    number = float(value)  # "" (no "=") raises too
    if not 0.0 <= number <= 1.0:
        raise ValueError(value)
    return number


def _rows(value: str) -> int:
    number = int(value)
    if number < 2:
        raise ValueError(value)
    return number


def _match(value: str) -> int:
    number = int(value)
    if number == 1 or number < 0:
        raise ValueError(value)
    return number


SETTINGS = {
    "extend": Setting(frozenset({"chain"}), "extend_at", f"draft past gamma while the draft's token probability is "
                      f"at least this (default {EXTEND_AT}; 1 = never: exactly gamma drafts per round)",
                      "a number from 0 to 1 (extend=0.6)", _probability),
    "rows": Setting(frozenset({"chain"}), "extend_rows", f"the most rows a round that drafts past gamma may verify "
                    f"at once (default {EXTEND_ROWS}; the widest compiled graph of at most this many)",
                    "a whole number of rows, at least 2 (rows=32)", _rows),
    "runs": Setting(frozenset({"chain"}), "run_match", "with +lookup: a context match of at least this many tokens "
                    "drafts the text that followed it, the round's remaining drafts at once, with no draft call "
                    f"(default {RUN_MATCH}; 0: never)", "a whole number of tokens, 0 or at least 2 (runs=5)", _match),
}


def policy_settings(spec: str, name: str, settings: str) -> dict[str, float]:
    """Parse `key=value[:key=value...]` for policy `name` into make_policy options, or say what is wrong."""
    base = [p for p in name.split("+") if p != "lookup"][0]
    takes = [k for k, s in SETTINGS.items() if base in s.policies]
    out: dict[str, float] = {}
    for item in settings.split(":"):
        key, _, value = item.partition("=")
        if key not in takes:
            options = ", ".join(f"{k} ({SETTINGS[k].meaning})" for k in takes) or "none"
            raise MobcError(f"policy {spec}: {base} has no setting {key!r}; its settings: {options}")
        setting = SETTINGS[key]
        try:
            out[setting.option] = setting.parse(value)
        except ValueError:
            raise MobcError(f"policy {spec}: {key} needs {setting.form}, not {value!r}") from None
    return out


__all__ = ["AR", "Chain", "POLICIES", "Policy", "RunStats", "Sampler", "accept_chain", "make_policy"]
