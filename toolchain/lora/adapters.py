"""LoRA adapters for artifacts compiled with the `lora_inputs` pass: pack PEFT folders, bind per row.

`pack` reads a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors), checks it
against the artifact (rank within the compiled max_rank, every adapted module has a LoRA input,
same base model), folds PEFT's scaling (alpha/r, or alpha/sqrt(r) for rsLoRA) into B and writes
<artifact>/adapters/<name>.npz. Switching adapters is then a matter of binding other arrays.

Binding (`write_slots` / `write_rows`) fills a graph's lora_* inputs in place: adapter s of a
call occupies rank columns [s*max_rank, s*max_rank + r) of every A and B input; lora_rows says
which block each row (token) of the call uses. After mha_to_sha, per-head B inputs get their
head's column slice of B here, at bind time, so the graph never slices.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from toolchain.errors import MobcError

ADAPTERS_DIR = "adapters"
_PEFT_KEY = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)(?:\.[\w-]+)?\.weight$")
_B_INPUT = re.compile(r"^lora_B\.(.+?)(?:\.head(\d+))?$")


class AdapterError(MobcError):
    """An adapter that does not fit the artifact (rank, target modules, base model, format)."""


@dataclass
class LoraSpec:
    """What an artifact was compiled for: the lora_inputs options from its recipe."""

    targets: list[str]
    max_rank: int
    slots: int

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> LoraSpec:
        for spec in manifest.get("recipe", {}).get("passes", []):
            if isinstance(spec, dict) and "lora_inputs" in spec:
                from passes.lora_inputs import LoraInputs

                cfg = LoraInputs.Config(**(spec["lora_inputs"] or {}))
                return cls(list(cfg.targets), cfg.max_rank, cfg.slots)
            if spec == "lora_inputs":
                from passes.lora_inputs import LoraInputs

                cfg = LoraInputs.Config()
                return cls(list(cfg.targets), cfg.max_rank, cfg.slots)
        raise AdapterError(
            f"artifact {manifest.get('name')!r} was compiled without the lora_inputs pass, so it has no "
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
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        tmp.rename(path)

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


# ---- reading PEFT folders ---------------------------------------------------------------------
def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module path suffix."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def _read_peft(folder: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    cfg_path = folder / "adapter_config.json"
    if not cfg_path.is_file():
        raise AdapterError(f"{folder} has no adapter_config.json: give a folder written by PEFT's save_pretrained")
    cfg = json.loads(cfg_path.read_text())
    st = folder / "adapter_model.safetensors"
    if st.is_file():
        from safetensors.numpy import load_file

        tensors = load_file(str(st))
    elif (folder / "adapter_model.bin").is_file():
        import torch

        tensors = {k: v.float().numpy() for k, v in torch.load(folder / "adapter_model.bin", map_location="cpu",
                                                                 weights_only=True).items()}
    else:
        raise AdapterError(f"{folder} has no adapter_model.safetensors; save the adapter with PEFT's save_pretrained")
    return cfg, tensors


def _check_config(cfg: dict[str, Any], folder: Path) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{folder}: peft_type {cfg.get('peft_type')!r}; only LoRA adapters become graph inputs")
    if cfg.get("use_dora"):
        raise AdapterError(f"{folder}: DoRA adapters rescale the merged weight per column, which a low-rank input "
                           "branch cannot express; train a plain LoRA (use_dora=False)")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"{folder}: the adapter trains biases (bias={cfg['bias']!r}); lora_inputs binds only "
                           "A and B; train with bias='none'")
    if cfg.get("lora_bias"):
        raise AdapterError(f"{folder}: lora_bias=True adds a bias to lora_B, which the graph's inputs do not carry; "
                           "train with lora_bias=False")
    if cfg.get("trainable_token_indices") or cfg.get("target_parameters") or cfg.get("layer_replication"):
        raise AdapterError(f"{folder}: the adapter also trains token embeddings, raw parameters or replicated "
                           "layers; only LoRA on linear projections becomes graph inputs")
    if cfg.get("alora_invocation_tokens"):
        raise AdapterError(f"{folder}: activated LoRA (alora_invocation_tokens) switches on mid-sequence; "
                           "lora_rows could express it per row, but mobc's runtime does not yet")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"{folder}: modules_to_save {cfg['modules_to_save']} replaces whole modules, which a "
                           "frozen graph cannot take as inputs; train without modules_to_save")


def _check_base(cfg: dict[str, Any], manifest: dict[str, Any], folder: Path) -> None:
    """Rejects an adapter trained on another base model, when its base can be identified locally."""
    base = cfg.get("base_model_name_or_path")
    src = manifest.get("source", {})
    fp = src.get("fingerprint", "")
    if not base:
        return
    bpath = Path(base)
    if not bpath.is_dir():
        return  # a hub id we cannot resolve offline: the shape checks below still apply
    from toolchain.compile.source import _fingerprint

    if fp and bpath.name == fp[:24]:
        return  # mobc's float cache of the artifact's own GGUF source
    files = [p for p in bpath.iterdir() if p.suffix in {".safetensors", ".bin", ".json", ".model"}]
    if fp and files and _fingerprint([p.resolve() for p in files]) == fp:
        return
    model = manifest.get("model", {})
    detail = ""
    if (bpath / "config.json").is_file():
        bc = json.loads((bpath / "config.json").read_text())
        bc = bc.get("text_config", bc)
        ours = (model.get("family"), model.get("n_layers"), model.get("hidden"), model.get("vocab"))
        theirs = (bc.get("model_type"), bc.get("num_hidden_layers"), bc.get("hidden_size"), bc.get("vocab_size"))
        detail = f" (adapter base: {theirs[0]}, {theirs[1]} layers, hidden {theirs[2]}; artifact: " \
                 f"{ours[0]}, {ours[1]} layers, hidden {ours[2]})"
    raise AdapterError(
        f"{folder}: base-model mismatch: the adapter was trained on {base}, whose weights differ from the "
        f"artifact's source {src.get('description')}{detail}; an adapter only fits the model it was trained on"
    )


def from_peft(folder: str | Path, manifest: dict[str, Any], name: str | None = None) -> Adapter:
    """Reads and validates a PEFT LoRA folder against an artifact manifest."""
    folder = Path(folder)
    if not folder.is_dir():
        raise AdapterError(f"{folder} is not a folder; give the folder PEFT's save_pretrained wrote")
    spec = LoraSpec.from_manifest(manifest)
    cfg, tensors = _read_peft(folder)
    _check_config(cfg, folder)
    _check_base(cfg, manifest, folder)
    model = manifest["model"]
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, t in tensors.items():
        m = _PEFT_KEY.search(key)
        if m is None:
            raise AdapterError(f"{folder}: tensor {key!r} adapts a module the artifact has no LoRA input for; "
                               f"lora_inputs covers {', '.join(spec.targets)} in every layer")
        layer, block, target, which = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if target not in spec.targets:
            raise AdapterError(
                f"{folder}: the adapter adapts {target} but the artifact was compiled with LoRA inputs only for "
                f"{', '.join(spec.targets)}; recompile with lora_inputs targets including {target}, or use an "
                "adapter trained on those modules"
            )
        if layer >= model["n_layers"]:
            raise AdapterError(f"{folder}: base-model mismatch: the adapter has layer {layer} but the artifact's "
                               f"model has {model['n_layers']} layers")
        pairs.setdefault(f"layers.{layer}.{block}.{target}", {})[which] = t.astype(np.float32)
    if not pairs:
        raise AdapterError(f"{folder}: no LoRA A/B tensors found in the adapter file")
    weights, rank = {}, 0
    for proj, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{folder}: {proj} has lora_{'A' if 'B' in ab else 'B'} missing")
        a, b = ab["A"].T, ab["B"].T  # PEFT stores Linear weights [out, in]; graphs use [in, out]
        r = a.shape[1]
        if r > spec.max_rank:
            raise AdapterError(
                f"{folder}: {proj} has rank {r} but the artifact was compiled with max_rank {spec.max_rank}; "
                f"recompile with lora_inputs max_rank >= {r}, or train the adapter with r <= {spec.max_rank}"
            )
        module = proj
        r_cfg = _pattern_value(cfg.get("rank_pattern"), module, cfg.get("r", r))
        alpha = _pattern_value(cfg.get("alpha_pattern"), module, cfg.get("lora_alpha", r_cfg))
        scale = alpha / np.sqrt(r) if cfg.get("use_rslora") else alpha / r
        weights[proj] = (np.ascontiguousarray(a), np.ascontiguousarray(b * np.float32(scale)))
        rank = max(rank, r)
    _check_shapes(weights, manifest, folder)
    return Adapter(name or folder.name, rank, weights,
                   {"peft_dir": str(folder.resolve()), "base": cfg.get("base_model_name_or_path"),
                    "targets": sorted({p.rsplit(".", 1)[1] for p in weights})})


def _check_shapes(weights: dict[str, tuple[np.ndarray, np.ndarray]], manifest: dict[str, Any], folder: Path) -> None:
    ins = {}
    for g in manifest["graphs"]:
        for i in g["inputs"]:
            if i["name"].startswith("lora_A."):
                ins[i["name"][7:]] = i["shape"][0]
    outs: dict[str, int] = {}
    for g in manifest["graphs"]:
        for i in g["inputs"]:
            m = _B_INPUT.match(i["name"])
            if m:
                heads = outs.setdefault(m.group(1), 0)
                outs[m.group(1)] = heads + i["shape"][1] if m.group(2) is not None else i["shape"][1]
        break  # one graph says it all; others have the same per-projection shapes
    for proj, (a, b) in weights.items():
        if proj in ins and (a.shape[0] != ins[proj] or (proj in outs and b.shape[1] != outs[proj])):
            raise AdapterError(
                f"{folder}: base-model mismatch: {proj} is {a.shape[0]}->{b.shape[1]} in the adapter but "
                f"{ins[proj]}->{outs.get(proj)} in the artifact"
            )


def pack(artifact: str | Path, peft_dir: str | Path, name: str | None = None) -> tuple[Path, Adapter]:
    from toolchain.artifact.manifest import load_manifest

    artifact = Path(artifact)
    manifest = load_manifest(artifact)
    adapter = from_peft(peft_dir, manifest, name)
    out = artifact / ADAPTERS_DIR / f"{adapter.name}.npz"
    adapter.save(out)
    return out, adapter


# ---- binding ----------------------------------------------------------------------------------
def write_slots(arrays: dict[str, np.ndarray], adapters: list[Adapter | None], max_rank: int) -> None:
    """Writes adapter s into rank block s of every lora_A / lora_B array (in place); the rest is zero."""
    for name, arr in arrays.items():
        if not name.startswith(("lora_A.", "lora_B.")):
            continue
        arr[...] = 0.0
        if name.startswith("lora_A."):
            proj, head = name[7:], None
        else:
            m = _B_INPUT.match(name)
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
