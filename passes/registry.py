"""The pass registry: recipes name passes; each name maps to one class in one file of passes/.

A pass class subclasses an onnx_ir pass (InPlacePass or FunctionalPass), takes its pydantic
config in __init__ and declares:
  - `Config`: a pydantic model (extra="forbid") of its options,
  - `ensures(model)`: raises AssertionError when the invariant the pass promises does not hold
    (tests call it; the pipeline calls it after the pass runs),
  - optionally `graph_level = True` when it turns one graph into several (see toolchain/ir/graphset.py);
    such a pass implements `apply(graphset, family) -> GraphSet` instead of `call(model)`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from toolchain.errors import RecipeError

PASSES: dict[str, type] = {}


class PassConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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
