"""What a compile returns and records about its model and tools (shared by the model and head pipelines)."""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from pathlib import Path

from toolchain import __version__
from toolchain.artifact.layout import StepLayout
from toolchain.artifact.manifest import Manifest, ModelInfo
from toolchain.compile.source import LoadedModel
from toolchain.compile.verify import eos_ids


@dataclass
class CompileResult:
    out_dir: Path
    manifest: Manifest
    timings: dict[str, float] = field(default_factory=dict)


def tool_versions() -> dict[str, str]:
    import onnx
    import onnx_ir
    import onnxruntime
    import onnxscript
    import torch
    import transformers

    return {
        "mobc": __version__, "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "onnx": onnx.__version__, "onnx_ir": onnx_ir.__version__,
        "onnxscript": onnxscript.__version__, "onnxruntime": onnxruntime.__version__,
    }


def model_record(loaded: LoadedModel, layout: StepLayout) -> ModelInfo:
    cfg = loaded.config
    return ModelInfo.from_layout(
        layout, family=cfg.model_type, max_position_embeddings=cfg.max_position_embeddings, eos_token_ids=eos_ids(cfg),
        bos_token_id=getattr(cfg, "bos_token_id", None),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        has_chat_template=bool(getattr(loaded.tokenizer, "chat_template", None)),
        diffusion=loaded.diffusion,  # masked-diffusion form (toolchain/diffusion/form.py) or None
    )


