"""`mobc adapter pack`: a PEFT LoRA folder -> the artifact's adapter input tensors.

`pack` reads a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors), checks it
against the artifact (rank within the compiled max_rank, every adapted module has a LoRA input,
same base model), folds PEFT's scaling (alpha/r, or alpha/sqrt(r) for rsLoRA) into B and writes
<artifact>/adapters/<name>.npz, which the runtime binds (toolchain/runtime/adapters.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from toolchain.artifact.manifest import Manifest
from toolchain.runtime.adapters import ADAPTERS_DIR, B_INPUT, Adapter, AdapterError, LoraSpec

ADAPTER_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}$")
_PEFT_KEY = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)(?:\.[\w-]+)?\.weight$")


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
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise AdapterError(f"{cfg_path} is not valid JSON ({exc}); give a folder written by PEFT's "
                           "save_pretrained") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{cfg_path} holds a JSON {type(cfg).__name__}, not PEFT's adapter config object")
    st = folder / "adapter_model.safetensors"
    if st.is_file():
        from safetensors.numpy import load_file

        try:
            tensors = load_file(str(st))
        except Exception as exc:  # safetensors raises its own SafetensorError on a damaged file
            raise AdapterError(f"{st} is not a readable safetensors file ({exc}); save the adapter again with "
                               "PEFT's save_pretrained") from None
    elif (folder / "adapter_model.bin").is_file():
        import torch

        tensors = {k: v.float().numpy() for k, v in torch.load(folder / "adapter_model.bin", map_location="cpu",
                                                                 weights_only=True).items()}
    else:
        raise AdapterError(f"{folder} has no adapter_model.safetensors; save the adapter with PEFT's save_pretrained")
    return cfg, tensors


def _positive(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and 0 < v < float("inf")


def _check_numbers(cfg: dict[str, Any], folder: Path) -> None:
    """r, lora_alpha and their per-module patterns are positive numbers (PEFT never writes anything else)."""
    for key in ("r", "lora_alpha"):
        if key in cfg and not _positive(cfg[key]):
            raise AdapterError(f"{folder}: adapter_config.json has {key} = {cfg[key]!r}; PEFT writes a positive "
                               "number there: save the adapter again with PEFT's save_pretrained")
    for key in ("rank_pattern", "alpha_pattern"):
        patterns = cfg.get(key) or {}
        if not isinstance(patterns, dict) or not all(_positive(v) for v in patterns.values()):
            raise AdapterError(f"{folder}: adapter_config.json {key} must map module names to positive numbers")
        for name in patterns:
            try:
                re.compile(rf"(.*\.)?{name}$")
            except re.error:
                raise AdapterError(f"{folder}: adapter_config.json {key} key {name!r} is not a module pattern") from None


def _check_config(cfg: dict[str, Any], folder: Path) -> None:
    _check_numbers(cfg, folder)
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


def _check_base(cfg: dict[str, Any], manifest: Manifest, folder: Path) -> None:
    """Rejects an adapter trained on another base model, when its base can be identified locally."""
    base = cfg.get("base_model_name_or_path")
    src = manifest.source
    fp = src.get("fingerprint", "")
    if not base:
        return
    if not isinstance(base, str):
        raise AdapterError(f"{folder}: adapter_config.json base_model_name_or_path is {base!r}, not a model "
                           "folder or hub id; save the adapter again with PEFT's save_pretrained")
    bpath = Path(base)
    if "\x00" in base or not bpath.is_dir():
        return  # a hub id we cannot resolve offline: the shape checks below still apply
    from toolchain.compile.source import fingerprint_files

    if fp and bpath.name == fp[:24]:
        return  # mobc's float cache of the artifact's own GGUF source
    files = [p for p in bpath.iterdir() if p.suffix in {".safetensors", ".bin", ".json", ".model"}]
    if fp and files and fingerprint_files([p.resolve() for p in files]) == fp:
        return
    model = manifest.model
    detail = ""
    if (bpath / "config.json").is_file():
        bc = json.loads((bpath / "config.json").read_text())
        bc = bc.get("text_config", bc)
        ours = (model.family, model.n_layers, model.hidden, model.vocab)
        theirs = (bc.get("model_type"), bc.get("num_hidden_layers"), bc.get("hidden_size"), bc.get("vocab_size"))
        detail = f" (adapter base: {theirs[0]}, {theirs[1]} layers, hidden {theirs[2]}; artifact: " \
                 f"{ours[0]}, {ours[1]} layers, hidden {ours[2]})"
    raise AdapterError(
        f"{folder}: base-model mismatch: the adapter was trained on {base}, whose weights differ from the "
        f"artifact's source {src.get('description')}{detail}; an adapter only fits the model it was trained on"
    )


def from_peft(folder: str | Path, manifest: Manifest, name: str | None = None) -> Adapter:
    """Reads and validates a PEFT LoRA folder against an artifact manifest."""
    folder = Path(folder)
    if not folder.is_dir():
        raise AdapterError(f"{folder} is not a folder; give the folder PEFT's save_pretrained wrote")
    spec = LoraSpec.from_manifest(manifest)
    cfg, tensors = _read_peft(folder)
    _check_config(cfg, folder)
    _check_base(cfg, manifest, folder)
    model = manifest.model
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
        if layer >= model.n_layers:
            raise AdapterError(f"{folder}: base-model mismatch: the adapter has layer {layer} but the artifact's "
                               f"model has {model.n_layers} layers")
        if t.ndim != 2 or 0 in t.shape:
            raise AdapterError(f"{folder}: tensor {key!r} has shape {list(t.shape)}; a LoRA factor is a non-empty "
                               "matrix")
        pairs.setdefault(f"layers.{layer}.{block}.{target}", {})[which] = t.astype(np.float32)
    if not pairs:
        raise AdapterError(f"{folder}: no LoRA A/B tensors found in the adapter file")
    weights, rank = {}, 0
    for proj, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{folder}: {proj} has lora_{'A' if 'B' in ab else 'B'} missing")
        a, b = ab["A"].T, ab["B"].T  # PEFT stores Linear weights [out, in]; graphs use [in, out]
        r = a.shape[1]
        if b.shape[0] != r:
            raise AdapterError(f"{folder}: {proj} has lora_A of rank {r} but lora_B of rank {b.shape[0]}")
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


def _check_shapes(weights: dict[str, tuple[np.ndarray, np.ndarray]], manifest: Manifest, folder: Path) -> None:
    ins = {}
    for g in manifest.graphs:
        for i in g.inputs:
            if i.name.startswith("lora_A."):
                ins[i.name[7:]] = i.shape[0]
    outs: dict[str, int] = {}
    for g in manifest.graphs:
        for i in g.inputs:
            m = B_INPUT.match(i.name)
            if m:
                heads = outs.setdefault(m.group(1), 0)
                outs[m.group(1)] = heads + i.shape[1] if m.group(2) is not None else i.shape[1]
        break  # one graph says it all; others have the same per-projection shapes
    for proj, (a, b) in weights.items():
        if proj in ins and (a.shape[0] != ins[proj] or (proj in outs and b.shape[1] != outs[proj])):
            raise AdapterError(
                f"{folder}: base-model mismatch: {proj} is {a.shape[0]}->{b.shape[1]} in the adapter but "
                f"{ins[proj]}->{outs.get(proj)} in the artifact"
            )


def pack(artifact: str | Path, peft_dir: str | Path, name: str | None = None) -> tuple[Path, Adapter]:

    artifact = Path(artifact)
    manifest = Manifest.load(artifact)
    adapter = from_peft(peft_dir, manifest, name)
    if not ADAPTER_NAME.match(adapter.name):  # it names a file: no separators, no leading dot
        given = f"--name {name!r}" if name else f"the folder name {adapter.name!r}"
        raise AdapterError(f"{given}: an adapter name is letters, digits, '.', '_' and '-' (not starting with "
                           "'.'); it names ARTIFACT/adapters/NAME.npz. Pass --name with such a name")
    out = artifact / ADAPTERS_DIR / f"{adapter.name}.npz"
    adapter.save(out)
    return out, adapter


