"""A draft head under the chain policy: AR's tokens, the target's features in every committed head row."""

from __future__ import annotations

import numpy as np
import pytest

from tests.tiny import tiny_tokenizer
from tests.toolchain.head_fixtures import (
    compile_target,
    head_recipe,
    head_weights,
    target_hidden,
    tiny_head_world,
)
from toolchain.errors import ArtifactError, MobcError
from toolchain.runtime.head_draft import HeadDraft
from toolchain.runtime.model import StepModel
from toolchain.runtime.policies import make_policy
from toolchain.runtime.policies.sampling import Sampler

PROMPTS = ["def fibonacci(n):\n    return", "import os\nimport sys\n\n\ndef main("]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return tiny_head_world(tmp_path_factory.mktemp("headrt"))


def prefilled(world, prompt):
    """(target, its head, the prompt's ids, the target's first new token) after both ran the prompt."""
    _, target_dir, head_dir = world
    target = StepModel(target_dir)
    draft = HeadDraft(StepModel(head_dir), target)
    ids = tiny_tokenizer()(prompt).input_ids
    pending = int(np.argmax(target.prefill(ids)))
    draft.prefill(ids)
    return target, draft, ids, pending


def generate(policy, ids, n=24):
    return [t for chunk in policy.generate(ids, n, Sampler()) for t in chunk]


def test_chain_with_a_head_generates_ars_tokens_and_keeps_target_features(world):
    _, target_dir, head_dir = world
    target = StepModel(target_dir)
    draft = HeadDraft(StepModel(head_dir), target)
    ar, chain = make_policy("ar", target), make_policy("chain", target, draft, gamma=3)
    tok = tiny_tokenizer()
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        want = generate(ar, ids)
        assert generate(chain, ids) == want, prompt
        # every head row of a committed token was (re)computed from the target's own features:
        # the head's cache equals a fresh head run over the committed text
        n = min(draft.length, target.length)
        text = draft.tokens[:n]
        fresh = HeadDraft(StepModel(head_dir), target)
        fresh.reset()
        fresh.target_features[:] = draft.target_features  # it joined after the target's commits
        fresh.heard = draft.heard
        fresh._run(text)
        for mine, ref in zip(draft.cache.keys + draft.cache.values, fresh.cache.keys + fresh.cache.values,
                             strict=True):
            np.testing.assert_allclose(mine[..., :n] if mine.shape[-1] == draft.cache.slots else mine[:, :, :n],
                                       ref[..., :n] if ref.shape[-1] == draft.cache.slots else ref[:, :, :n],
                                       atol=1e-5)
        assert text == (ids + want)[:n]


def test_a_two_layer_head_drafts_for_chain_and_lever_and_keeps_both_layers_caches(world, tmp_path):
    from toolchain.compile.pipeline import compile_recipe

    hf, target_dir, _ = world
    weights = head_weights(hf, tmp_path / "w2.safetensors", layers=2)
    head_dir = compile_recipe(head_recipe(tmp_path, hf, weights, name="deep")).out_dir
    target = StepModel(target_dir)
    draft = HeadDraft(StepModel(head_dir), target)
    assert len(draft.cache.keys) == 2
    ar = make_policy("ar", target)
    tok = tiny_tokenizer()
    for policy in ("chain", "lever"):
        spec = make_policy(policy, target, draft, **({"gamma": 3} if policy == "chain" else {}))
        for prompt in PROMPTS:
            ids = tok(prompt).input_ids
            want = generate(ar, ids)
            assert generate(spec, ids) == want, (policy, prompt)
    n = min(draft.length, target.length)
    fresh = HeadDraft(StepModel(head_dir), target)
    fresh.reset()
    fresh.target_features[:] = draft.target_features
    fresh.heard = draft.heard
    fresh._run(draft.tokens[:n])
    for mine, ref in zip(draft.cache.keys + draft.cache.values, fresh.cache.keys + fresh.cache.values, strict=True):
        np.testing.assert_allclose(mine[..., :n] if mine.shape[-1] == draft.cache.slots else mine[:, :, :n],
                                   ref[..., :n] if ref.shape[-1] == draft.cache.slots else ref[:, :, :n], atol=1e-5)


def test_features_are_the_targets_residual_at_the_previous_position(world):
    _, target_dir, head_dir = world
    target = StepModel(target_dir)
    draft = HeadDraft(StepModel(head_dir), target)
    ids = tiny_tokenizer()(PROMPTS[0]).input_ids
    target.prefill(ids)
    np.testing.assert_allclose(draft.target_features[: len(ids)], target_hidden(target_dir, ids), atol=1e-4)
    assert np.all(draft._feature(0, target.length) == 0)
    np.testing.assert_array_equal(draft._feature(3, target.length), draft.target_features[2])


def test_a_target_without_features_is_refused(world, tmp_path):
    hf, _, head_dir = world
    plain = compile_target(tmp_path, hf, passes="")
    with pytest.raises(ArtifactError, match="split_lm_head"):
        HeadDraft(StepModel(head_dir), StepModel(plain))


def test_rows_drafted_on_the_heads_own_features_are_redone_once_the_target_commits_them(world):
    """A round whose drafts are all accepted: the head's rows of those drafts were computed from its
    own features; the next call redoes them from the target's, so its cache matches a fresh run."""
    head_dir = world[2]
    target, draft, ids, pending = prefilled(world, PROMPTS[1])
    d1 = int(np.argmax(draft.feed([pending])))  # pending's row: the target's feature of the last prompt token
    d2 = int(np.argmax(draft.feed([d1])))  # d1's row: the head's own feature of pending
    assert draft.guessed_from == len(ids) + 1
    target.forward([pending, d1, d2])  # the target accepts both drafts (whatever they are)
    target.commit([0, 1, 2])
    before = sum(draft.calls.values())
    draft.feed([d2])
    assert draft.guessed_from == draft.length  # nothing guessed is left
    assert sum(draft.calls.values()) == before + 1  # the redone row and d2's row share one call
    fresh = HeadDraft(StepModel(head_dir), target)
    fresh.target_features[:] = draft.target_features
    fresh.heard = draft.heard
    fresh.reset()
    fresh._run([*ids, pending, d1, d2])
    for mine, ref in zip(draft.cache.keys, fresh.cache.keys, strict=True):
        np.testing.assert_allclose(mine[..., : draft.length], ref[..., : draft.length], atol=1e-5)


def test_a_redo_keeps_the_rows_the_head_ran_past_the_targets_text(world):
    """The head drafted two tokens past what the target has committed (as ahasd's drafter does): the
    redo reruns the committed row with the target's feature and keeps the row past it."""
    target, draft, ids, pending = prefilled(world, PROMPTS[1])
    d1 = int(np.argmax(draft.feed([pending])))
    d2 = int(np.argmax(draft.feed([d1])))
    d3 = int(np.argmax(draft.feed([d2])))
    draft.feed([d3])
    target.forward([pending, d1])
    target.commit([0, 1])  # the target has pending and d1; d3's row reads d2's, which it has not
    draft.feed([7])
    assert draft.tokens == [*ids, pending, d1, d2, d3, 7]
    assert draft.guessed_from == len(ids) + 3  # d3's row still read the head's own feature


def test_lever_drafts_trees_with_a_head_and_generates_ars_tokens(world):
    _, target_dir, head_dir = world
    target = StepModel(target_dir)
    draft = HeadDraft(StepModel(head_dir), target)
    ar, lever = make_policy("ar", target), make_policy("lever", target, draft)
    tok = tiny_tokenizer()
    calls = 0
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        want = generate(ar, ids)
        assert generate(lever, ids) == want, prompt
        calls += sum(lever.stats.draft_calls.values())
    assert calls > 0  # the head really drafted


def test_lever_tells_the_head_the_features_of_every_token_its_tree_verify_commits(world):
    """A tree verify commits the target's rows itself; the head must hear of them like of a chain
    commit, or it drafts every token past the prompt from stale features."""
    _, target_dir, head_dir = world
    target = StepModel(target_dir)
    draft = HeadDraft(StepModel(head_dir), target)
    lever = make_policy("lever", target, draft)
    ids = tiny_tokenizer()(PROMPTS[0]).input_ids
    draft.target_features[:] = 0
    out = generate(lever, ids)
    committed = (ids + out)[: target.length]
    assert target.length > len(ids) + 8  # tree verifies committed the tokens past the prompt
    np.testing.assert_allclose(draft.target_features[: target.length], target_hidden(target_dir, committed),
                               atol=1e-4)


def test_a_target_commit_the_head_never_heard_of_fails_loudly(world):
    """Features of a slot committed behind the head's back are an earlier text's: drafting on them
    would only lower acceptance, silently (as lever's tree verify once did)."""
    target, draft, _, pending = prefilled(world, PROMPTS[0])
    nxt = int(np.argmax(draft.feed([pending])))
    target.forward([pending])
    target.cache.commit(target._last[1], [0])  # not through StepModel.commit: no listener hears it
    with pytest.raises(RuntimeError, match="commit listeners"):
        draft.feed([nxt])


def test_a_tree_node_reads_its_parents_hidden_like_a_chain_draft(world):
    """Expanding root -> a -> b in a tree gives the logits chain drafting gives for the same path."""
    from toolchain.runtime.head_draft import HeadDraftTree
    from toolchain.runtime.tree import Tree

    _, target_dir, head_dir = world
    target = StepModel(target_dir)
    ids = tiny_tokenizer()(PROMPTS[0]).input_ids
    chain, tree_draft = HeadDraft(StepModel(head_dir), target), HeadDraft(StepModel(head_dir), target)
    pending = int(np.argmax(target.prefill(ids)))  # both heads hear the prompt's features
    chain.prefill(ids)
    tree_draft.prefill(ids)
    a, b = 7, 11
    want_a, want_b = chain.feed([pending]), None
    chain.feed([a])
    want_b = chain.feed([b])
    drafter = HeadDraftTree(tree_draft)
    tree = Tree.root(pending)
    np.testing.assert_allclose(drafter.start([pending]), want_a, atol=1e-5)
    na = tree.add(0, a, 0.5, 0.5)
    drafter.expand(tree, [na])
    nb = tree.add(na, b, 0.5, 0.5)
    nc = tree.add(na, 3, 0.5, 0.5)  # a sibling in the same call must not change b's row
    got = drafter.expand(tree, [nb, nc])
    np.testing.assert_allclose(got[0], want_b, atol=1e-4)


def test_ahasd_drafts_asynchronously_with_a_head_and_generates_ars_tokens(world):
    _, target_dir, head_dir = world
    target = StepModel(target_dir)
    draft = HeadDraft(StepModel(head_dir), target)
    ar, ahasd = make_policy("ar", target), make_policy("ahasd", target, draft, gamma=3)
    ids = tiny_tokenizer()(PROMPTS[1]).input_ids
    assert generate(ahasd, ids) == generate(ar, ids)


def test_feeding_several_tokens_past_the_target_drafts_each_on_the_previous_rows_hidden(world):
    """ahasd's drafter feeds tokens the target has not committed: each row needs the row before it
    run first, so one feed of three equals three feeds of one."""
    _, target_dir, head_dir = world
    target = StepModel(target_dir)
    ids = tiny_tokenizer()(PROMPTS[0]).input_ids
    together, apart = HeadDraft(StepModel(head_dir), target), HeadDraft(StepModel(head_dir), target)
    target.prefill(ids)  # both heads hear the prompt's features
    for d in (together, apart):
        d.prefill(ids)
    got = together.feed([5, 6, 7])
    for tok in (5, 6, 7):
        want = apart.feed([tok])
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert together.calls == apart.calls


@pytest.mark.parametrize("policy", ["chain", "lever", "ahasd"])
def test_lookup_proposals_keep_ars_tokens_track_the_draft_cache_and_raise_acceptance(world, policy):
    """+lookup on a head: same tokens as ar; the wrapper's text is the head's cache text after every
    chunk; on a prompt whose continuation repeats itself, more drafts are accepted than without it."""
    from toolchain.runtime.lookup import LookupDraft

    _, target_dir, head_dir = world
    target = StepModel(target_dir)
    ar = make_policy("ar", target)
    ids = tiny_tokenizer()(PROMPTS[0]).input_ids
    want = generate(ar, ids, 12)
    # the tiny target loops: feeding it its own output twice makes the continuation a repeat
    ids = ids + want + want
    want = generate(ar, ids, 16)
    accepted = {}
    for name in (policy, f"{policy}+lookup"):
        head = HeadDraft(StepModel(head_dir), target)
        pol = make_policy(name, target, head, gamma=3)
        out: list[int] = []
        for chunk in pol.generate(ids, 16, Sampler()):
            out += chunk
            if isinstance(pol.draft, LookupDraft) and policy != "ahasd":  # ahasd's drafter runs ahead
                assert pol.draft.tokens == head.tokens == (ids + out)[: head.length]
        assert out == want, name
        accepted[name] = sum(pol.stats.accepted)
        if name.endswith("+lookup"):
            assert pol.draft.proposals > 0
    if policy != "ahasd":  # ahasd verifies whatever is staged when its deadline passes: timing decides
        assert accepted[f"{policy}+lookup"] > accepted[policy] + 3, accepted


def test_lookup_runs_draft_a_repeat_without_head_calls_and_keep_ars_tokens(world):
    """chain+lookup drafts a long context match's continuation at once (runs=M; default 3): ar's tokens, fewer
    head calls than without runs (runs=0), and the head's cache text stays a prefix of the committed text (the run's
    tokens are heard in one call the next round)."""
    _, target_dir, head_dir = world
    target = StepModel(target_dir)
    ar = make_policy("ar", target)
    ids = tiny_tokenizer()(PROMPTS[0]).input_ids
    want = generate(ar, ids, 12)
    ids = ids + want + want  # the continuation repeats itself
    want = generate(ar, ids, 16)
    calls, accepted = {}, {}
    for name in ("chain+lookup:runs=0", "chain+lookup"):
        head = HeadDraft(StepModel(head_dir), target)
        pol = make_policy(name, target, head, gamma=3)
        out: list[int] = []
        for chunk in pol.generate(ids, 16, Sampler()):
            out += chunk
            assert pol.draft.tokens == head.tokens == (ids + out)[: head.length]
        assert out == want, name
        calls[name], accepted[name] = sum(head.calls.values()), sum(pol.stats.accepted)
    assert calls["chain+lookup"] < calls["chain+lookup:runs=0"], calls
    assert accepted["chain+lookup"] >= accepted["chain+lookup:runs=0"] - 1, accepted


def test_lookup_runs_need_lookup(world):
    _, target_dir, head_dir = world
    target = StepModel(target_dir)
    with pytest.raises(MobcError, match=r"runs=3 drafts context-lookup runs: use chain\+lookup"):
        make_policy("chain:runs=3", target, HeadDraft(StepModel(head_dir), target))
