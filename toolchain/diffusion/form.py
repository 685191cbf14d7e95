"""The marker of a masked-diffusion checkpoint: `diffusion.json` beside config.json.

A diffusion LM made by `mobc train diffusion` is an ordinary Hugging Face causal-LM folder
(same architecture, same weights layout), so transformers loads it unchanged. What differs is
how it must be *run*: attention is bidirectional (inside a diffusion block), undecided tokens
are fed as a mask token, and — Dream-style — the logits at position i predict token i+1 (the
AR model's shifted head is kept). Those three facts live in this small JSON file so capture,
verification and the runtime know the model's form without guessing from weights.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MARKER = "diffusion.json"
FORM = "masked-diffusion/1"


@dataclass(frozen=True)
class DiffusionForm:
    mask_token_id: int
    attention: str = "bidirectional"  # inside the block; committed prefix is always visible
    head: str = "shifted"  # logits at position i predict token i+1 (Dream), not token i (LLaDA)
    form: str = FORM
    mask_token: str | None = None  # the token's text, for humans
    base_model: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def write_form(folder: Path, form: DiffusionForm) -> Path:
    path = Path(folder) / MARKER
    path.write_text(json.dumps(form.to_dict(), indent=2) + "\n")
    return path


def read_form(folder: str | Path) -> DiffusionForm | None:
    """The folder's diffusion form, or None for a plain autoregressive checkpoint."""
    path = Path(folder) / MARKER
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if data.get("form") != FORM:
        from toolchain.errors import SourceError

        raise SourceError(f"{path}: unknown diffusion form {data.get('form')!r}; this mobc reads {FORM}")
    known = set(DiffusionForm.__dataclass_fields__)
    return DiffusionForm(**{k: v for k, v in data.items() if k in known})
