"""The real SmolLM2-135M-Instruct artifact (recipes/smollm2-135m.yaml: 30 layers in parts, lm_head
split off) as an onnxruntime-genai bundle: onnxruntime-genai generates mobc's greedy tokens."""

import os

import pytest

from toolchain.bench.prompts import prompt_ids
from toolchain.bundle.genai import write_bundle
from toolchain.bundle.genai_run import verify_bundle
from toolchain.runtime.tokenizer import Tokenizer

pytestmark = pytest.mark.real


def test_genai_generates_mobcs_tokens_on_five_humaneval_prompts(real_smollm2, tmp_path):
    artifact = real_smollm2.out_dir
    summary = write_bundle(artifact, tmp_path / "bundle")
    assert os.stat(summary.folder / "weights.bin").st_ino == os.stat(artifact / "weights.bin").st_ino
    assert summary.written_bytes < 5e6  # the bundle adds position/KV stages, not weights
    ids = prompt_ids(Tokenizer(artifact / "tokenizer"), "humaneval:5")
    check = verify_bundle(summary.folder, ids, tokens=32)
    assert [r.identical for r in check.results] == [True] * 5, [
        (r.first_difference, r.genai.tokens, r.mobc.tokens) for r in check.results]
    assert all(len(r.mobc.tokens) == 32 for r in check.results)
