"""Diffusion decoding on a tiny bidirectional model: schedules, baselines vs a torch reference,
multi-block speculation (off = baseline exactly; on = never more calls per block), revisable
re-masking, and the dual-path revision thread's clean shutdown."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.tiny import save_tiny, tiny_tokenizer, write_recipe
from toolchain.compile.pipeline import compile_recipe
from toolchain.diffusion.form import DiffusionForm, read_form, write_form
from toolchain.diffusion.reference import generate as reference_generate
from toolchain.runtime.diffusion_schedule import due_now, low_confidence_pick, threshold_pick, transfer_counts
from toolchain.runtime.model import StepModel
from toolchain.runtime.policies import Sampler, make_policy
from toolchain.runtime.policies.diffusion import DiffusionPolicy, FastDLLM
from toolchain.runtime.policies.llada import LLaDA

MASK_ID = 3
W = 8
PROMPTS = ["def f(x):\n    return", "import os\nimport sys\n", "class A:\n    def __init__(self"]


@pytest.fixture(scope="module")
def tiny_dlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("dlm")
    hf = save_tiny(root / "hf", "llama", seed=3)
    write_form(hf, DiffusionForm(mask_token_id=MASK_ID))
    recipe = write_recipe(root / "d.yaml", hf, name="tiny-dlm",
                          graphs=f"  diffusion: {{width: {W}, context: 64, role: diffusion}}\n")
    recipe.write_text(recipe.read_text().replace("greedy_tokens: 12", "greedy_tokens: 0"))
    out = compile_recipe(recipe).out_dir
    return hf, out


def ids(i: int) -> list[int]:
    return tiny_tokenizer()(PROMPTS[i]).input_ids


def run(policy, prompt, n):
    return [t for chunk in policy.generate(prompt, n, Sampler()) for t in chunk]


# ---- decision rules --------------------------------------------------------------------------
def test_remasking_schedule_matches_llada():
    assert transfer_counts(32, 8) == [4] * 8
    assert transfer_counts(10, 4) == [3, 3, 2, 2]
    assert transfer_counts(3, 8) == [1, 1, 1]  # never a step with nothing to do
    assert sum(transfer_counts(29, 5)) == 29
    # recomputing from what is left reproduces the tail of the schedule (the baseline's path)
    left, sched = 10, transfer_counts(10, 4)
    for s in range(4):
        assert due_now(left, 4 - s) == sched[s]
        left -= sched[s]
    assert low_confidence_pick([0.1, 0.9, 0.5, 0.9], 2) == [1, 3]


def test_threshold_rule_commits_all_above_and_at_least_one():
    assert threshold_pick([0.95, 0.2, 0.91, 0.5], 0.9) == [0, 2]
    assert threshold_pick([0.3, 0.6, 0.1], 0.9) == [1]  # none above: the most confident one
    assert threshold_pick([], 0.9) == []


def test_marker_round_trip_and_manifest(tiny_dlm):
    hf, out = tiny_dlm
    assert read_form(hf).mask_token_id == MASK_ID
    sm = StepModel(out)
    assert sm.manifest.model.diffusion["mask_token_id"] == MASK_ID
    fam = sm.manifest.verification["families"]["diffusion"]
    assert fam["worst_max_abs"] < 1e-3  # the block graph (bidirectional, mask tokens) matches torch
    dec = sm.manifest.verification["diffusion_decode"]  # compile-time decode check vs torch
    assert dec["identical"] and len(dec["ours"]) == 2 * W


# ---- baselines ---------------------------------------------------------------------------------
def test_baseline_equals_torch_reference(tiny_dlm):
    hf, out = tiny_dlm
    model = AutoModelForCausalLM.from_pretrained(hf, attn_implementation="eager", dtype=torch.float32).eval()
    sm = StepModel(out)
    for i in range(2):
        ref = reference_generate(model, ids(i), MASK_ID, block=W, steps=4, n_blocks=3)
        ours = run(DiffusionPolicy(sm, steps=4), ids(i), 3 * W)
        assert ours == ref
        assert MASK_ID not in ours


def test_baseline_calls_per_block(tiny_dlm):
    _, out = tiny_dlm
    pol = DiffusionPolicy(StepModel(out), steps=4)
    run(pol, ids(0), 3 * W)
    assert pol.dstats.block_calls == [5, 5, 4]  # S steps + the refresh call; the last block has none
    fast = FastDLLM(StepModel(out), threshold=0.5)
    run(fast, ids(0), 3 * W)
    assert all(1 <= c <= W + 1 for c in fast.dstats.block_calls)


# ---- llada ------------------------------------------------------------------------------------
@pytest.mark.parametrize("rule,base", [("steps", "dllm"), ("threshold", "fastdllm")])
def test_llada_without_speculation_is_the_baseline(tiny_dlm, rule, base):
    _, out = tiny_dlm
    sm = StepModel(out)
    for i in range(3):
        b = make_policy(base, sm)
        ref = run(b, ids(i), 3 * W)
        pol = LLaDA(sm, rule=rule, speculate=False)
        assert run(pol, ids(i), 3 * W) == ref
        assert pol.stats.target_calls == b.stats.target_calls


@pytest.mark.parametrize("block", [W // 2, W])  # two-block window / block = graph width
def test_speculation_never_costs_more_calls_per_block(tiny_dlm, block):
    _, out = tiny_dlm
    sm = StepModel(out)
    for i in range(3):
        base = DiffusionPolicy(sm, steps=4, block=block)
        run(base, ids(i), 4 * block)
        spec = LLaDA(sm, rule="steps", steps=4, block=block, spec_masks=2, spec_threshold=0.0, keep_threshold=0.0)
        out_tokens = run(spec, ids(i), 4 * block)
        assert len(out_tokens) == 4 * block and MASK_ID not in out_tokens
        if block < W:  # spare width from the first call on
            assert spec.dstats.spec_decided > 0
        n = len(spec.dstats.block_calls)
        assert all(s <= b for s, b in zip(spec.dstats.block_calls, base.dstats.block_calls[:n], strict=True))
        assert sum(spec.stats.target_calls.values()) < sum(base.stats.target_calls.values())


def test_revisable_tokens_are_remasked_below_keep(tiny_dlm):
    _, out = tiny_dlm
    sm = StepModel(out)
    keep_all = LLaDA(sm, rule="steps", steps=4, block=W // 2, spec_threshold=0.0, keep_threshold=0.0)
    run(keep_all, ids(1), 3 * W)
    assert keep_all.dstats.spec_decided > 0 and keep_all.dstats.spec_remasked == 0
    assert keep_all.dstats.spec_kept == keep_all.dstats.spec_decided
    drop_all = LLaDA(sm, rule="steps", steps=4, block=W // 2, spec_threshold=0.0, keep_threshold=1.01)
    toks = run(drop_all, ids(1), 3 * W)
    d = drop_all.dstats
    assert d.spec_decided > 0 and d.spec_kept == 0 and d.spec_remasked == d.spec_decided
    assert MASK_ID not in toks and len(toks) == 3 * W


# ---- dual-path revision ------------------------------------------------------------------------
def _revision_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "mobc-revision"]


def test_revision_path_remasks_and_shuts_down(tiny_dlm):
    _, out = tiny_dlm
    sm = StepModel(out)
    pol = LLaDA(sm, rule="steps", steps=4, revise=True, revise_below=1.01, keep_threshold=1.01, speculate=False)
    toks = run(pol, ids(2), 2 * W)
    d = pol.dstats
    assert d.provisional > 0 and d.revised > 0
    assert MASK_ID not in toks and len(toks) == 2 * W
    assert 0.0 <= d.revision["overlap"] <= 1.0 and d.revision["revision_s"] > 0
    again = run(pol, ids(2), 2 * W)  # deterministic: results are applied at fixed points
    assert again == toks
    # early close of the generator, then close(): the worker thread is joined
    gen = pol.generate(ids(0), 2 * W, Sampler())
    next(gen)
    gen.close()
    pol.close()
    assert not _revision_threads()


def test_revision_keeps_confident_tokens_like_no_revision(tiny_dlm):
    _, out = tiny_dlm
    sm = StepModel(out)
    plain = run(LLaDA(sm, rule="steps", steps=4, speculate=False), ids(0), 2 * W)
    pol = LLaDA(sm, rule="steps", steps=4, speculate=False, revise=True, revise_below=1.01, keep_threshold=0.0)
    assert run(pol, ids(0), 2 * W) == plain  # everything confirmed: same tokens, one more path busy
    pol.close()
    assert not _revision_threads()
    assert np.isfinite(pol.dstats.revision["overlapped_s"])


@pytest.mark.parametrize("keep", [1.01, 0.3])
def test_revision_with_speculation_finishes_every_block(tiny_dlm, keep):
    """A token re-masked by the revision path in the call that would commit its row must not be
    committed (it once left a mask under the cache: the block never finished, 11,896 calls)."""
    _, out = tiny_dlm
    sm = StepModel(out)
    pol = LLaDA(sm, rule="threshold", threshold=0.2, steps=4, speculate=True, spec_masks=W // 2,
                revise=True, revise_below=1.01, keep_threshold=keep)
    for i in range(len(PROMPTS)):
        toks = run(pol, ids(i), 3 * W)
        assert len(toks) == 3 * W and MASK_ID not in toks
        assert max(pol.dstats.block_calls) <= 2 * W
    pol.close()
    assert not _revision_threads()
