"""`mobc adapter pack` on real PEFT folders (tiny models): equivalence with PEFT and the merged
model, and the rejections: rank above max_rank, a missing target module, another base model."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tests.lora_tiny import peft_adapter
from tests.tiny import save_tiny, tiny_tokenizer
from toolchain.artifact.manifest import Manifest
from toolchain.lora.pack import from_peft, pack
from toolchain.lora.verify import artifact_logits
from toolchain.runtime.adapters import AdapterError
from toolchain.runtime.model import StepModel
from toolchain.runtime.policies.ctg import bind_adapters


def test_packed_adapter_matches_peft_and_merged(lora_artifact, tmp_path):
    artifact, src = lora_artifact
    peft = peft_adapter(src, tmp_path / "a", targets=("q_proj", "v_proj", "down_proj"), r=3, use_rslora=True)
    path, ad = pack(artifact, tmp_path / "a", "a")
    assert path == artifact / "adapters" / "a.npz" and ad.rank == 3
    ids = tiny_tokenizer()("import os\nclass Path(object):\n    def __init__(self").input_ids[:16]
    with torch.no_grad():
        want = peft(torch.tensor([ids])).logits[0].numpy()
        base = peft.get_base_model()
        peft.merge_adapter()
        merged = base(torch.tensor([ids])).logits[0].numpy()
    model = StepModel(artifact)
    bind_adapters(model, [ad], 0)
    got = artifact_logits(model, ids)
    np.testing.assert_allclose(got, want, atol=1e-4)
    np.testing.assert_allclose(got, merged, atol=1e-4)
    bind_adapters(model, [])
    assert np.max(np.abs(artifact_logits(model, ids) - want)) > 1e-2  # the adapter does change the output


def test_rank_above_max_is_rejected(lora_artifact, tmp_path):
    artifact, src = lora_artifact
    peft_adapter(src, tmp_path / "big", r=8)
    with pytest.raises(AdapterError, match=r"rank 8 but the artifact was compiled with max_rank 4"):
        pack(artifact, tmp_path / "big")


def test_missing_target_module_is_rejected(lora_artifact, tmp_path):
    artifact, src = lora_artifact
    peft_adapter(src, tmp_path / "k", targets=("q_proj", "k_proj"))
    with pytest.raises(AdapterError, match=r"adapts k_proj but the artifact was compiled with LoRA inputs only for"):
        pack(artifact, tmp_path / "k")


def test_other_base_model_is_rejected(lora_artifact, tmp_path):
    artifact, _ = lora_artifact
    other = save_tiny(tmp_path / "other", "llama", seed=7)  # same architecture, other weights
    peft_adapter(other, tmp_path / "o")
    with pytest.raises(AdapterError, match="base-model mismatch"):
        pack(artifact, tmp_path / "o")
    qwen = save_tiny(tmp_path / "qwen", "qwen2")
    peft_adapter(qwen, tmp_path / "q")
    with pytest.raises(AdapterError, match=r"base-model mismatch.*qwen2"):
        pack(artifact, tmp_path / "q")


def test_artifact_without_lora_inputs_and_bad_folders(lora_artifact, tmp_path):
    artifact, src = lora_artifact
    manifest = Manifest.load(artifact)
    peft_adapter(src, tmp_path / "a")
    with pytest.raises(AdapterError, match="compiled without the lora_inputs pass"):
        from_peft(tmp_path / "a", dataclasses.replace(manifest, passes=[]))
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        pack(artifact, tmp_path)
    peft_adapter(src, tmp_path / "dora", use_dora=True)
    with pytest.raises(AdapterError, match="DoRA"):
        pack(artifact, tmp_path / "dora")
    peft_adapter(src, tmp_path / "lb", lora_bias=True)
    with pytest.raises(AdapterError, match="lora_bias"):
        pack(artifact, tmp_path / "lb")
