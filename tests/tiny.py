"""Tiny models of every supported architecture, built from configs (no downloads), plus a real tokenizer."""

from __future__ import annotations

import math
import os
from functools import lru_cache
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def tiny_config(family: str):
    if family == "llama":
        return LlamaConfig(**COMMON, num_hidden_layers=2, num_key_value_heads=2)
    if family == "qwen2":
        return Qwen2Config(**COMMON, num_hidden_layers=2, num_key_value_heads=2)
    if family == "qwen3":
        return Qwen3Config(**COMMON, num_hidden_layers=2, num_key_value_heads=2, head_dim=16)
    if family == "gemma3":
        return Gemma3TextConfig(**COMMON, num_hidden_layers=3, num_key_value_heads=1, head_dim=32,
                                sliding_window=8, layer_types=["sliding_attention", "sliding_attention",
                                                               "full_attention"],
                                query_pre_attn_scalar=32)
    raise ValueError(family)


FAMILIES = ["llama", "qwen2", "qwen3", "gemma3"]


def tiny_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family), attn_implementation="eager").eval()
    # random init gives near-uniform logits; larger weights make argmax decisions meaningful
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return model


@lru_cache(maxsize=1)
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained in a second on the standard library's own source."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([Path(os.__file__).read_text()], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny tokenizer (a fresh copy) with a small chat template, for chat-prompt code paths."""
    tok = tiny_tokenizer()
    tok = type(tok)(tokenizer_object=tok._tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def eos_prone_model(tok: PreTrainedTokenizerFast, p_end: float = 0.1):
    """The tiny llama reading out through a zero lm_head with a bias: a uniform next token, except
    end-of-text at probability `p_end`, so a sampled request ends within a few dozen tokens."""
    model = tiny_model("llama", 0).eval()
    v, c = model.config.vocab_size, model.config.hidden_size
    model.config.tie_word_embeddings = False
    model.lm_head = torch.nn.Linear(c, v, bias=True)
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.bias.zero_()
        model.lm_head.bias[tok.eos_token_id] = math.log(p_end * (v - 1) / (1 - p_end))
    return model


def save_tiny(folder: Path, family: str, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tiny_model(family, seed).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def write_recipe(path: Path, model_dir: Path, name: str = "tiny", graphs: str | None = None,
                 extra: str = "") -> Path:
    graphs = graphs or "  decode: {width: 1, context: 64}\n  prefill: {width: 8, context: 64}\n"
    path.write_text(
        f"name: {name}\nsource: {{path: {model_dir}}}\ngraphs:\n{graphs}"
        f"verify: {{greedy_tokens: 12}}\noutput: {path.parent / 'out' / name}\n{extra}"
    )
    return path


def save_near_tiny(folder: Path, family: str, seed: int = 0, sigma: float = 0.1, noise_seed: int = 7) -> Path:
    """The seed-`seed` tiny model with Gaussian noise (sigma x each matrix's std) on its matrices: a draft
    that agrees with that target on about half of its greedy choices (measured 57% at sigma 0.1 on
    llama seed 0), so speculative policies see full, partial and zero acceptance. A tiny model of
    another seed agrees on almost none (chain's acceptance with one measured 0.0)."""
    model = tiny_model(family, seed)
    g = torch.Generator().manual_seed(noise_seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(sigma * p.std() * torch.randn(p.shape, generator=g))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder
