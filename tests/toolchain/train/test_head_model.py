"""The draft head module (toolchain/train/head_model.py): its layers, and the files it is saved in."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.tiny import tiny_model
from toolchain.compile.head import HeadError, load_head
from toolchain.train.head_model import DraftHead, load_head_tensors, save_head, saved_layers


def _head(target, layers: int, seed: int = 0) -> DraftHead:
    torch.manual_seed(seed)
    head = DraftHead(target, torch.arange(0, target.config.vocab_size, 4), init_layer=None, layers=layers)
    with torch.no_grad():
        for p in head.trainable():
            p.add_(torch.randn_like(p) * 0.02)
    return head.eval()


def _rows(head: DraftHead) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (1, 12), generator=g)
    feats = torch.randn(1, 12, head.config.hidden_size, generator=g)
    with torch.no_grad():
        return head.forward_train(feats, tokens, torch.arange(12)[None], normalized=False)


def test_every_layer_of_a_deeper_head_shapes_its_output():
    target = tiny_model("llama", 0).float().eval()
    head = _head(target, 2)
    assert head.config.num_hidden_layers == 2 and len(head.layers) == 2
    both = _rows(head)
    head.layers = torch.nn.ModuleList([head.layers[0]])
    assert not torch.allclose(both, _rows(head), atol=1e-4)  # the second layer is not skipped


def test_dropout_acts_while_training_and_never_in_eval():
    """--dropout: a training pass drops rows and attention weights (two passes differ); in eval, as the compile
    and the held-out counts run it, the head gives what the same weights without dropout give."""
    target = tiny_model("llama", 0).float().eval()
    torch.manual_seed(0)
    head = DraftHead(target, torch.arange(0, target.config.vocab_size, 4), init_layer=None, layers=2, dropout=0.3)
    plain = DraftHead(target, head.vocab_ids, init_layer=None, layers=2)
    plain.load_state_dict(head.state_dict())
    assert head.config.attention_dropout == 0.3 and plain.config.attention_dropout == 0.0
    head.train()
    assert not torch.allclose(_rows(head), _rows(head))
    head.eval()
    torch.testing.assert_close(_rows(head), _rows(plain.eval()))


def test_a_one_layer_head_keeps_the_shipped_files_names_and_a_deeper_one_numbers_its_layers(tmp_path):
    target = tiny_model("llama", 0).float().eval()
    for layers, want in ((1, {"layer."}), (2, {"layers.0.", "layers.1."})):
        head = _head(target, layers)
        path = tmp_path / f"h{layers}.safetensors"
        save_head(head, path)
        names = load_file(str(path)).keys()
        assert {k.split("self_attn")[0] for k in names if "self_attn" in k} == want
        assert saved_layers(names) == layers
        loaded = load_head(target, path)
        assert len(loaded.layers) == layers
        torch.testing.assert_close(_rows(loaded), _rows(head), atol=2e-3, rtol=2e-3)  # fp16 on disk


def test_a_file_with_more_layers_than_the_head_is_refused_not_cut(tmp_path):
    target = tiny_model("llama", 0).float().eval()
    path = tmp_path / "h2.safetensors"
    save_head(_head(target, 2), path)
    tensors = load_file(str(path))
    tensors.pop("vocab_ids")
    one = _head(target, 1)
    with pytest.raises(RuntimeError, match="no place in a 1-layer head"):
        load_head_tensors(one, tensors)
    with pytest.raises(HeadError, match="no head layer tensors"):
        from safetensors.torch import save_file

        save_file({"fc.weight": tensors["fc.weight"], "vocab_ids": torch.arange(4).int()}, str(tmp_path / "x.safetensors"))
        load_head(target, tmp_path / "x.safetensors")
