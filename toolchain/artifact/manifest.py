"""manifest.json: the typed record of a compiled artifact; one writer, one reader.

The compiler writes it last (its presence marks a finished artifact); the runtime, `mobc
inspect`, `mobc verify` and the AI Hub jobs read it. Everything the runtime relies on is typed
here: the model's shape (`ModelInfo`, which yields each width's StepLayout), the graphs with
every input and output (`GraphRecord`, a stage of toolchain/artifact/chain.py) and the shared
files. The compile's reports (verification, passes, qnn, quantization, timings) are kept as
the JSON records their stages produce.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from toolchain.artifact import chain, integrity
from toolchain.artifact.integrity import sha256_path
from toolchain.artifact.layout import StepLayout
from toolchain.atomic import atomic_file
from toolchain.errors import ArtifactError

MANIFEST = "manifest.json"
REPORT = "report.md"
WEIGHTS = "weights.bin"
ROPE = "rope.npz"
FORMAT = "mobc-artifact/1"


__all__ = ["sha256_path"]  # re-exported: the compile hashes files through this module

# a compile writes into .NAME.partial-PID and swaps the old artifact out as .NAME.old-PID
# (toolchain/compile/emit.py); only the compiling process itself may load such a folder
STAGING = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old)-(?P<pid>\d+)$")


def _staging_owner(folder: Path) -> int | None:
    for part in Path(os.path.abspath(folder)).parts:
        if m := STAGING.match(part):
            return int(m["pid"])
    return None


def _refuse_staging(folder: Path) -> None:
    pid = _staging_owner(folder)
    if pid is None or pid == os.getpid():
        return
    try:
        os.kill(pid, 0)
        running = True
    except ProcessLookupError:
        running = False
    except PermissionError:
        running = True
    state = (f"a compile still running (pid {pid}) is writing it: wait for that compile, then use its output"
             if running else
             f"its compile (pid {pid}) was interrupted: the next `mobc compile` into that folder removes it")
    raise ArtifactError(f"{folder} is a staging folder, not a finished mobc artifact; {state}")


# manifest dtype names (onnx_ir's, lower case) -> numpy; anything else runs as float32
_NUMPY_DTYPES = {"float": np.float32, "float32": np.float32, "float16": np.float16, "int32": np.int32,
                 "int64": np.int64, "int8": np.int8, "uint8": np.uint8, "uint16": np.uint16, "int16": np.int16}


@dataclass
class IOSpec:
    name: str
    shape: list[int | str]
    dtype: str

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(_NUMPY_DTYPES.get(self.dtype, np.float32))


@dataclass
class GraphRecord:
    """One graph file: a stage of a family's chain (toolchain/artifact/chain.py)."""

    name: str  # file stem, unique in the artifact: decode, decode_part1, decode_lm_head, ...
    file: str
    family: str  # the recipe graph this stage belongs to
    role: str  # decode / prefill / tree / diffusion / custom / lm_head / part
    width: int
    context: int
    stage: int
    inputs: list[IOSpec]
    outputs: list[IOSpec]
    meta: dict[str, Any] = field(default_factory=dict)  # e.g. {"layers": [0, 15]} for a part
    nodes: int = 0
    weight_bytes: int = 0
    onnx_bytes: int = 0
    sha256: str = ""
    # quantized artifacts only
    quantization: dict[str, Any] | None = None
    encodings: str | None = None
    float_weight_bytes: int | None = None

    @property
    def input_names(self) -> list[str]:
        return [i.name for i in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.outputs]

    def input_shape(self, name: str) -> tuple[list[int], str]:
        spec = next(i for i in self.inputs if i.name == name)
        return [int(d) for d in spec.shape], str(spec.numpy_dtype)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GraphRecord:
        d = dict(d)
        d["inputs"] = [IOSpec(**i) for i in d["inputs"]]
        d["outputs"] = [IOSpec(**o) for o in d["outputs"]]
        return cls(**d)


# what a ModelInfo shares with every StepLayout of its artifact (the rest of a layout is its width)
LAYOUT_FIELDS = ("n_layers", "n_heads", "n_kv", "head_dim", "hidden", "vocab", "layer_kinds", "rope_per_kind",
                 "sliding_window")


@dataclass
class ModelInfo:
    """The source model's shape and tokens: what every step graph of the artifact shares."""

    family: str
    n_layers: int
    n_heads: int
    n_kv: int
    head_dim: int
    hidden: int
    vocab: int
    layer_kinds: list[str]
    rope_per_kind: bool
    sliding_window: int | None = None
    max_position_embeddings: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    tie_word_embeddings: bool = False
    has_chat_template: bool = False
    diffusion: dict[str, Any] | None = None  # masked-diffusion form (toolchain/diffusion/form.py)
    draft_head: dict[str, Any] | None = None  # a feature-level draft head (toolchain/compile/head.py)

    def layout(self, width: int, context: int) -> StepLayout:
        shape = {f: getattr(self, f) for f in LAYOUT_FIELDS}
        return StepLayout(width=width, context=context, **{**shape, "layer_kinds": tuple(self.layer_kinds)})

    @classmethod
    def from_layout(cls, layout: StepLayout, **details: Any) -> ModelInfo:
        """The shape every width shares, taken from one of its layouts, plus the model's details."""
        shape = {f: getattr(layout, f) for f in LAYOUT_FIELDS}
        return cls(**{**shape, "layer_kinds": list(layout.layer_kinds)}, **details)


@dataclass
class Manifest:
    name: str
    source: dict[str, Any]  # spec (the recipe's source), description, fingerprint, files
    model: ModelInfo
    graphs: list[GraphRecord]
    weights: dict[str, Any]  # file, bytes, tensors, bytes_saved_by_sharing, sha256
    rope: dict[str, Any]  # file, tables, length
    format: str = FORMAT
    recipe: dict[str, Any] | None = None  # the resolved recipe
    recipe_file: str | None = None
    tools: dict[str, str] | None = None
    passes: list[dict[str, Any]] = field(default_factory=list)  # one row per pass (pass_runner)
    verification: dict[str, Any] | None = None
    qnn: list[dict[str, Any]] | None = None
    qnn_lockstep: dict[str, Any] | None = None  # the qnn: gate's greedy run through the HTP decode binaries
    quantization: dict[str, Any] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    report_sections: list[str] = field(default_factory=list)  # extra markdown for report.md
    inspect_tables: list[dict[str, Any]] = field(default_factory=list)  # extra tables for mobc inspect
    hub: dict[str, Any] | None = None  # AI Hub job records by device slug
    files: dict[str, str] = field(default_factory=dict)  # sha256 of every other file
    sizes: dict[str, int] = field(default_factory=dict)  # bytes of every file in `files` (checked at load)

    # ---- graphs as chains -----------------------------------------------------------------
    def families(self) -> list[str]:
        return chain.families(self.graphs)

    def chain(self, family: str) -> list[GraphRecord]:
        return chain.order(self.graphs, family)

    # ---- json -------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any], where: Path | str = MANIFEST) -> Manifest:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ArtifactError(f"{where} has keys mobc does not know ({', '.join(unknown)}); "
                                "it was written by another mobc version: recompile the recipe")
        try:
            d = dict(d)
            d["model"] = ModelInfo(**d["model"])
            d["graphs"] = [GraphRecord.from_json(g) for g in d["graphs"]]
            return cls(**d)
        except (KeyError, TypeError) as exc:
            raise ArtifactError(f"{where} is not a complete mobc manifest ({exc}); recompile the recipe") from None

    # ---- files ------------------------------------------------------------------------------
    def write(self, folder: Path, known_sha: dict[str, str] | None = None) -> None:
        """Hashes every other file of the folder into `files`, then writes manifest.json last
        (atomically): its presence marks a complete artifact. `known_sha` skips re-hashing
        files known not to have changed."""
        files, sizes = {}, {}
        for p in sorted(folder.rglob("*")):
            if p.is_file() and p.name not in (MANIFEST, REPORT):
                rel = str(p.relative_to(folder))
                # hashed states are remembered, so loading the artifact later does not hash again
                files[rel] = (known_sha or {}).get(rel) or integrity.hash_and_remember(p)
                sizes[rel] = p.stat().st_size
        self.files = files
        self.sizes = sizes
        with atomic_file(folder / MANIFEST) as tmp:
            tmp.write_text(json.dumps(self.to_json(), indent=2, sort_keys=False) + "\n")

    @classmethod
    def load(cls, folder: str | Path, check_files: bool = True) -> Manifest:
        """The artifact's manifest; with check_files (every command that uses the artifact's
        files), also checks every file's size, and its sha256 once per file state
        (toolchain/artifact/integrity.py): a damaged artifact is an ArtifactError naming the file."""
        folder = Path(folder)
        _refuse_staging(folder)
        if not folder.is_dir():
            raise ArtifactError(f"{folder} is not a folder; give an artifact folder written by `mobc compile`")
        path = folder / MANIFEST
        if not path.is_file():
            raise ArtifactError(
                f"{folder} has no {MANIFEST}: it is not a finished mobc artifact (an interrupted compile?); "
                "run `mobc compile RECIPE` again"
            )
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ArtifactError(f"{path} is not valid JSON ({exc}); recompile the recipe") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, dict) else None
            raise ArtifactError(f"{path} has format {got!r}, expected {FORMAT}; recompile")
        manifest = cls.from_json(data, path)
        if check_files:
            integrity.check_files(folder, manifest)
        return manifest

    def changed_files(self, folder: Path) -> list[str]:
        """Names of files whose sha256 no longer matches the manifest (or that are missing); every
        file is hashed again (`mobc verify`), and the verified states are remembered."""
        bad = []
        for rel, digest in self.files.items():
            p = folder / rel
            if not p.is_file() or integrity.hash_and_remember(p) != digest:
                bad.append(rel)
        return bad
