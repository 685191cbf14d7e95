"""A replayed chain run accepts, round for round, what the runtime's chain policy accepts on the same answer."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.tiny import save_tiny, tiny_tokenizer
from tests.toolchain.head_fixtures import compile_target, head_recipe
from toolchain.bench.replay import head_distribution, replay_chain, tokens_per_call
from toolchain.compile.head import load_head
from toolchain.compile.pipeline import compile_recipe
from toolchain.runtime.head_draft import HeadDraft
from toolchain.runtime.model import StepModel
from toolchain.runtime.policies import make_policy
from toolchain.runtime.policies.sampling import Sampler
from toolchain.train.head import draft_chains, head_losses
from toolchain.train.head_model import DraftHead, save_head

PROMPTS = ("def fibonacci(n):\n    return", "import os\nimport sys\n\n\ndef main(", "class Stack:\n    def")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny target's artifact, and a head fit for a few seconds to its greedy text (an untrained head accepts
    nothing, which would leave the rounds' acceptance untested), as torch modules and compiled."""
    root = tmp_path_factory.mktemp("replay")
    hf = save_tiny(root / "hf", "llama")
    target_dir = compile_target(root, hf)
    target = AutoModelForCausalLM.from_pretrained(hf).float().eval()
    tok = tiny_tokenizer()
    with torch.no_grad():
        texts = [target.generate(torch.tensor([tok(p).input_ids]), max_new_tokens=40, do_sample=False)[0, :48]
                 for p in PROMPTS]
        windows = torch.stack(texts)
        states = target.model(windows).last_hidden_state
    torch.manual_seed(0)
    head = DraftHead(target, torch.arange(target.config.vocab_size), init_layer=-1)
    head.config._attn_implementation = "sdpa"
    opt = torch.optim.Adam(head.trainable(), lr=3e-3)
    for _ in range(150):
        loss, _ = head_losses(head, windows, states, 1, 1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_head(head, root / "head.safetensors")
    head_dir = compile_recipe(head_recipe(root, hf, root / "head.safetensors")).out_dir
    return target_dir, head_dir, target, load_head(target, root / "head.safetensors")


def _prompts(target_dir):
    """The prompts, and one whose continuation repeats itself (the tiny target loops), where lookup acts."""
    tok = tiny_tokenizer()
    ids = [tok(p).input_ids for p in PROMPTS]
    ar = make_policy("ar", StepModel(target_dir))
    first = [t for chunk in ar.generate(ids[0], 8, Sampler()) for t in chunk]
    return [*ids, ids[0] + first + first]


# the policy, then the replay's settings: extension threshold, most drafts per round (the tiny target's widest
# graph is 8 rows), lookup, lookup runs' least match (chain+lookup's default: 3)
CASES = [("chain:extend=1", 1.01, 3, False, 0), ("chain:extend=0.3", 0.3, 7, False, 0),
         ("chain+lookup:extend=0.3:runs=0", 0.3, 7, True, 0), ("chain+lookup:extend=0.3", 0.3, 7, True, 3),
         ("chain+lookup:extend=1:runs=2", 1.01, 3, True, 2)]


@pytest.mark.parametrize("policy, extend_at, max_drafts, lookup, run_match", CASES)
def test_a_replay_accepts_what_a_run_accepts(world, policy, extend_at, max_drafts, lookup, run_match):
    target_dir, head_dir, target, head = world
    accepted = []
    for ids in _prompts(target_dir):
        model = StepModel(target_dir)
        run = make_policy(policy, model, HeadDraft(StepModel(head_dir), model), gamma=3)
        out = [t for chunk in run.generate(ids, 20, Sampler()) for t in chunk]
        seq = torch.tensor([ids + out])
        with torch.no_grad():
            states = target.model(seq).last_hidden_state
        chains, hidden = draft_chains(head, seq, states, 7)
        rounds = replay_chain(seq[0], len(ids), chains[0], head_distribution(head, hidden[0]), head.vocab_ids, 3,
                              extend_at, max_drafts, lookup, run_match)
        assert rounds == run.stats.accepted, (policy, ids)
        accepted.append(sum(rounds))
        assert tokens_per_call([(len(out), rounds)]) == pytest.approx(len(out) / len(run.stats.accepted))
    assert min(accepted[:3]) > 3, accepted  # the rounds did accept drafts, on the prompts the head was fit to


def test_tokens_per_call_counts_every_answer_token_over_the_verify_calls():
    # answer 1: the prefill's token, then rounds accepting 2 and 0 (3 + 1 tokens); answer 2: 4 tokens in one round
    # that accepted all 3 drafts (its bonus would be past the end)
    assert tokens_per_call([(5, [2, 0]), (4, [3])]) == pytest.approx(9 / 3)
    assert tokens_per_call([(1, []), (1, [])]) is None
