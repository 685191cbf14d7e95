"""LoRA adapters at run time: packed adapters, what an artifact was compiled for, binding.

An adapter packed by `mobc adapter pack` (toolchain/lora/pack.py) is an .npz of per-projection
A [in, r] and B [r, out] (PEFT's scaling folded into B). Binding (`write_slots` / `write_rows`)
fills a graph's lora_* inputs in place: adapter s of a call occupies rank columns
[s*max_rank, s*max_rank + r) of every A and B input; lora_rows says which block each row
(token) of the call uses. After mha_to_sha, per-head B inputs get their head's column slice of
B here, at bind time, so the graph never slices. Switching adapters is binding other arrays.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from toolchain.artifact.manifest import Manifest
from toolchain.atomic import atomic_file
from toolchain.errors import MobcError

ADAPTERS_DIR = "adapters"
B_INPUT = re.compile(r"^lora_B\.(.+?)(?:\.head(\d+))?$")


class AdapterError(MobcError):
    """An adapter that does not fit the artifact (rank, target modules, base model, format)."""


@dataclass
class LoraSpec:
    """What an artifact was compiled for: the lora_inputs options from its recipe."""

    targets: list[str]
    max_rank: int
    slots: int

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> LoraSpec:
        """The lora_inputs pass's resolved options, as the compile recorded them per pass."""
        for row in manifest.passes:
            if row["pass"] == "lora_inputs":
                options = row["options"]
                return cls(list(options["targets"]), int(options["max_rank"]), int(options["slots"]))
        raise AdapterError(
            f"artifact {manifest.name!r} was compiled without the lora_inputs pass, so it has no "
            "adapter inputs; add `- lora_inputs: {targets: [q_proj, v_proj], max_rank: 16}` to the "
            "recipe's passes and recompile"
        )


@dataclass
class Adapter:
    """One adapter in graph layout: per projection path, A [in, r] and B [r, out] (scaling folded)."""

    name: str
    rank: int
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def save(self, path: Path) -> None:
        arrays = {}
        for proj, (a, b) in self.weights.items():
            arrays[f"A/{proj}"], arrays[f"B/{proj}"] = a, b
        arrays["__meta__"] = np.array(json.dumps({"name": self.name, "rank": self.rank, **self.meta}))
        with atomic_file(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, **arrays)

    @classmethod
    def load(cls, path: str | Path) -> Adapter:
        path = Path(path)
        if not path.is_file():
            raise AdapterError(f"packed adapter {path} does not exist; make it with `mobc adapter pack ARTIFACT PEFT_DIR`")
        with np.load(path) as z:
            meta = json.loads(str(z["__meta__"]))
            weights = {k[2:]: (z[k], z["B/" + k[2:]]) for k in z.files if k.startswith("A/")}
        return cls(meta.pop("name"), int(meta.pop("rank")), weights, meta)


def resolve_adapter(artifact: Path, ref: str | Path) -> Adapter:
    """An adapter by packed file path or by name under <artifact>/adapters/."""
    p = Path(ref)
    if p.suffix == ".npz" or p.is_file():
        return Adapter.load(p)
    cand = artifact / ADAPTERS_DIR / f"{ref}.npz"
    if cand.is_file():
        return Adapter.load(cand)
    known = sorted(q.stem for q in (artifact / ADAPTERS_DIR).glob("*.npz"))
    raise AdapterError(f"no adapter {ref!r} in {artifact / ADAPTERS_DIR} (packed: {', '.join(known) or 'none'}); "
                       f"run `mobc adapter pack {artifact} PEFT_DIR` first")


def write_slots(arrays: dict[str, np.ndarray], adapters: list[Adapter | None], max_rank: int) -> None:
    """Writes adapter s into rank block s of every lora_A / lora_B array (in place); the rest is zero."""
    for name, arr in arrays.items():
        if not name.startswith(("lora_A.", "lora_B.")):
            continue
        arr[...] = 0.0
        if name.startswith("lora_A."):
            proj, head = name[7:], None
        else:
            m = B_INPUT.match(name)
            assert m is not None
            proj, head = m.group(1), m.group(2)
        for s, ad in enumerate(adapters):
            if ad is None or proj not in ad.weights:
                continue
            a, b = ad.weights[proj]
            r, lo = a.shape[1], s * max_rank
            if name.startswith("lora_A."):
                arr[:, lo : lo + r] = a
            else:
                width = arr.shape[1]
                h = int(head) if head is not None else 0
                arr[lo : lo + r, :] = b[:, h * width : (h + 1) * width]


def write_rows(arrays: dict[str, np.ndarray], row_slots: list[int | None] | int | None, max_rank: int) -> None:
    """lora_rows: row n uses adapter slot row_slots[n] (None: no adapter). An int applies to every row."""
    rows = arrays.get("lora_rows")
    if rows is None:
        return
    n = rows.shape[1]
    if row_slots is None or isinstance(row_slots, int):
        row_slots = [row_slots] * n
    rows[...] = 0.0
    for i, s in enumerate(row_slots[:n]):
        if s is not None:
            rows[0, i, s * max_rank : (s + 1) * max_rank] = 1.0
