"""The artifact's tokenizer without transformers: `tokenizers` reads the saved tokenizer.json.

transformers' fast tokenizers are this same Rust tokenizer plus Python bookkeeping; the
compile saves them with save_pretrained, whose tokenizer.json carries the normalizer,
pre-tokenizer, model, decoder and the post-processor that adds BOS/EOS. So encoding and
decoding here give the ids and text transformers gives (a test checks it on every shipped
architecture), and `mobc run` starts without importing torch or transformers.

Chat templates are rendered with jinja2 in a sandbox (what transformers does), then encoded
without special tokens, since the template writes them itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as RustTokenizer

from toolchain.errors import ArtifactError


@dataclass(frozen=True)
class Encoding:
    input_ids: list[int]


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...} records."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, folder: str | Path):
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ArtifactError(f"{folder} has no tokenizer.json; recompile the artifact with mobc compile")
        self._tok = RustTokenizer.from_file(str(path))
        config_path = folder / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = folder / "chat_template.jinja"
        self.chat_template: str | None = template.read_text() if template.is_file() else self.config.get("chat_template")
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.pad_token = _token_text(self.config.get("pad_token"))

    def __call__(self, text: str) -> Encoding:
        return Encoding(self.encode(text))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self.convert_tokens_to_ids(self.eos_token) if self.eos_token else None

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """The model's chat template rendered over `messages`, as token ids."""
        if not self.chat_template:
            raise ArtifactError("this model has no chat template; prompt it with plain text")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        text = env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
        )
        return self.encode(text, add_special_tokens=False)
