"""WeightStore reads a checkpoint tensor by tensor; fp32 weights bind to the file itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from toolchain.compile.weight_store import WeightStore
from toolchain.errors import SourceError
from toolchain.ir.disk import DiskTensor, Spill


def test_reads_fp32_and_upcasts_bf16(tmp_path):
    a = torch.randn(5, 7)
    b = torch.randn(3, 2).to(torch.bfloat16)
    save_file({"a": a, "b": b}, tmp_path / "model.safetensors")
    store = WeightStore.of_folder(tmp_path)
    np.testing.assert_array_equal(store.float32("a"), a.numpy())
    np.testing.assert_array_equal(store.float32("b"), b.float().numpy())
    spill = Spill(tmp_path / "spill")
    ta = store.graph_tensor("a", "a", spill)
    assert isinstance(ta, DiskTensor) and spill.bytes_written == 0  # fp32: the checkpoint's own bytes
    np.testing.assert_array_equal(ta.numpy(), a.numpy())
    tb = store.graph_tensor("b", "b", spill)
    assert tb.dtype.name == "FLOAT" and spill.bytes_written == b.numel() * 4
    np.testing.assert_array_equal(tb.numpy(), b.float().numpy())


def test_tied_alias_and_missing(tmp_path):
    save_file({"model.embed_tokens.weight": torch.ones(4, 2)}, tmp_path / "model.safetensors")
    store = WeightStore.of_folder(tmp_path)
    assert "lm_head.weight" not in store
    store.tie("lm_head.weight", "model.embed_tokens.weight")
    np.testing.assert_array_equal(store.float32("lm_head.weight"), np.ones((4, 2), np.float32))
    with pytest.raises(KeyError):
        store.raw("nope")


def test_folder_without_safetensors_and_garbage_file(tmp_path):
    with pytest.raises(SourceError, match="no .safetensors"):
        WeightStore.of_folder(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(SourceError, match="not a readable .safetensors"):
        WeightStore.of_folder(tmp_path)
