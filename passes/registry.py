"""The pass registry: recipes name passes; each name maps to one class in one file of passes/.

A pass class subclasses passes.base.GraphPass (one graph in place) or GraphSetPass (one family
into stages) and is registered by name with `@register`. `build` turns a recipe entry into a
configured instance, naming a bad key and the valid ones; `check_order` checks a recipe's whole
list against the passes' declared `runs_after` / `runs_before` before any work starts.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from passes.base import PassSpec
from toolchain.errors import PassError, RecipeError

PASSES: dict[str, type[PassSpec]] = {}


def register(name: str):
    def wrap(cls: type) -> type:
        if name in PASSES:
            raise RuntimeError(f"pass {name!r} registered twice")
        cls.pass_name = name
        PASSES[name] = cls
        return cls

    return wrap


def build(spec: str | dict[str, Any], index: int = 0) -> Any:
    """`name` or `{name: {options}}` from a recipe -> a configured pass instance."""
    if isinstance(spec, str):
        name, options = spec, {}
    elif isinstance(spec, dict) and len(spec) == 1:
        name, options = next(iter(spec.items()))
        options = options or {}
    else:
        raise RecipeError(f"passes.{index}: write a pass as `name` or `name: {{options}}` (got {spec!r})")
    if name not in PASSES:
        valid = ", ".join(sorted(PASSES)) or "(none registered)"
        raise RecipeError(f"passes.{index}: unknown pass {name!r}; valid passes: {valid}")
    cls = PASSES[name]
    if not isinstance(options, dict):
        raise RecipeError(f"passes.{index}.{name}: options must be a mapping (got {options!r})")
    try:
        config = cls.Config(**options)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                valid = ", ".join(cls.Config.model_fields) or "(no options)"
                problems.append(f"passes.{index}.{name}.{key}: unknown option; valid options: {valid}")
            else:
                problems.append(f"passes.{index}.{name}.{key}: {err['msg']}")
        raise RecipeError("\n".join(problems)) from None
    return cls(config)


def check_order(specs: list) -> list[Any]:
    """Builds every pass of a recipe's list and checks the declared order constraints."""
    built = [build(spec, i) for i, spec in enumerate(specs)]
    position = {}
    for i, p in enumerate(built):
        position.setdefault(p.pass_name, i)
    for i, p in enumerate(built):
        for other in p.runs_after:
            if position.get(other, -1) > i:
                raise PassError(f"passes.{i}: {p.pass_name} must run after {other}; "
                                f"list {other} before {p.pass_name} in the recipe's passes")
        for other in p.runs_before:
            j = position.get(other)
            if j is not None and j < i:
                raise PassError(f"passes.{i}: {p.pass_name} must run before {other}; "
                                f"list {p.pass_name} before {other} in the recipe's passes")
    return built


def argmax_exact_outputs(specs: list) -> set[str]:
    """The outputs a recipe's passes relax to argmax-exact (toolchain/compile/contracts.py)."""
    return {out for p in check_order(specs) for out in p.argmax_exact_outputs}
