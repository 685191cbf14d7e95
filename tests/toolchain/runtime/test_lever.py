"""lever over tiny compiled artifacts: draft scratch masks, path-only logits, lossless vs ar."""

from __future__ import annotations

import numpy as np
import pytest

from tests.tiny import tiny_tokenizer
from tests.toolchain.runtime.speculative import assert_cache_holds, second_token_check
from tests.toolchain.runtime.test_sampling import CHI2_5DOF_P001
from toolchain.runtime.model import StepModel
from toolchain.runtime.policies import Sampler, make_policy
from toolchain.runtime.policies.lever import Lever, LeverConfig
from toolchain.runtime.tree import Tree
from toolchain.runtime.tree_exec import DraftTree, TreeVerifier

PROMPTS = ["def f(x):\n    return", "import os\nimport sys\n", "class A:\n    def __init__(self"]


@pytest.fixture(scope="module")
def artifacts(tree_artifacts):
    return tree_artifacts


class FixedPrices:
    """Cheap draft, flat verify: makes the builder grow deep, wide trees on tiny models."""

    def __init__(self, per_call: float, per_width: float = 0.0):
        self.per_call, self.per_width = per_call, per_width

    def seconds(self, key: str) -> float:
        return self.per_call if key.startswith("stage:") is False else self.per_call * 0.01


def random_tree(rng, n: int, vocab: int = 500) -> Tree:
    t = Tree.root(int(rng.integers(3, vocab)))
    for _ in range(n - 1):
        t.add(int(rng.integers(0, len(t))), int(rng.integers(3, vocab)), 0.5, 0.5)
    return t


def test_draft_tree_scratch_rows_match_a_causal_run(artifacts):
    """Each expanded node's draft logits equal those of feeding its path causally from scratch."""
    _, draft_dir = artifacts
    ids = tiny_tokenizer()(PROMPTS[0]).input_ids
    m = StepModel(draft_dir)
    m.prefill(ids[:-1])
    dt = DraftTree(m)
    root_logits = dt.start([ids[-1]])
    rng = np.random.default_rng(0)
    t = Tree.root(ids[-1])
    got = {0: root_logits}
    for _level in range(3):  # grow by levels: every batch's parents ran before it
        frontier = [i for i in range(len(t)) if i in got and not t.children(i)]
        new = [t.add(u, int(rng.integers(3, 500)), 0.5, 0.5) for u in frontier for _ in range(2)]
        for x, row in zip(new, dt.expand(t, new), strict=True):
            got[x] = row
    ref = StepModel(draft_dir)
    for x in rng.choice(len(t), size=6, replace=False):
        path = [t.tokens[i] for i in t.path(int(x))]
        ref.prefill(ids[:-1])
        want = ref.feed(path)
        np.testing.assert_allclose(got[int(x)], want, atol=2e-4)
    # keep an accepted path: its rows move down to their final slots, as a causal run would leave them
    leaf = max(range(len(t)), key=lambda i: t.depths[i] if i in dt.slot else -1)
    path = t.path(leaf)
    kept = dt.finish(path)
    assert kept == len(path) - 1 and m.length == len(ids) + kept
    ref.prefill(ids[:-1])
    ref.feed([t.tokens[i] for i in path])
    for i in range(m.cache.layout.n_layers):
        np.testing.assert_allclose(m.cache.keys[i][..., : m.length], ref.cache.keys[i][..., : m.length], atol=2e-5)


def test_path_only_logits_equal_full_logits_on_the_accepted_path(artifacts):
    target_dir, _ = artifacts
    ids = tiny_tokenizer()(PROMPTS[1]).input_ids
    rng = np.random.default_rng(1)
    for n in (3, 8):
        t = random_tree(rng, n)
        res = {}
        for mode in ("path", "full"):
            m = StepModel(target_dir)
            m.prefill(ids)
            v = TreeVerifier(m, logits=mode)
            seen: dict[int, np.ndarray] = {}
            orig = v._row_fn

            def spy(outs, orig=orig, seen=seen):
                row, done = orig(outs)

                def wrapped(node):
                    seen[node] = np.array(row(node))
                    return seen[node]

                return wrapped, done

            v._row_fn = spy
            vr = v.verify(t, Sampler())
            res[mode] = (vr, seen, m)
        (vp, sp, mp), (vf, sf, mf) = res["path"], res["full"]
        assert vp.acceptance == vf.acceptance
        assert sorted(sp) == vp.acceptance.path  # logits computed for the path rows only
        assert vp.rows_logits == len(vp.acceptance.path) and vf.rows_logits == vf.rows_total
        for i in sp:
            np.testing.assert_allclose(sp[i], sf[i], atol=1e-4)
        assert mp.calls[f"stage:{v.row_head.name}"] == len(vp.acceptance.path)
        assert mp.length == mf.length == len(ids) + len(vp.acceptance.path)


def run(policy, ids, n, sampler=None):
    return [t for chunk in policy.generate(ids, n, sampler or Sampler()) for t in chunk]


@pytest.mark.parametrize("draft_kind", ["other", "self"])
@pytest.mark.parametrize("logits", ["path", "full"])
def test_greedy_lever_equals_ar(artifacts, draft_kind, logits):
    target_dir, draft_dir = artifacts
    target = StepModel(target_dir)
    draft = StepModel(target_dir if draft_kind == "self" else draft_dir)
    ar = make_policy("ar", target)
    prices = (FixedPrices(1.0), FixedPrices(0.01))  # deep trees: drafting is cheap
    lever = Lever(target, draft, LeverConfig(logits=logits, top_k=3), prices=prices)
    for prompt in PROMPTS[:2]:
        ids = tiny_tokenizer()(prompt).input_ids
        ref = run(ar, ids, 24)
        assert run(lever, ids, 24) == ref, prompt
        assert lever.stats.tokens == len(ref)
        # one verify per cycle, however many pieces (body, then the path rows' lm_head) it ran in
        assert lever.stats.n_target_calls == len(lever.stats.accepted)
        assert max(lever.stats.tree_nodes) > 2
        if draft_kind == "self":  # a draft equal to the target: the greedy backbone is always accepted
            assert sum(lever.stats.accepted) >= len(ref) // 2


def test_lever_with_a_near_draft_accepts_partly_and_keeps_only_the_accepted_path(artifacts, near_draft):
    """A draft that agrees about half the time: cycles accept some, none or a whole branch; after
    every cycle the draft cache holds exactly the committed text (scratch rows of rejected branches
    gone, accepted rows moved down) and the target's too; the output is ar's."""
    target_dir, _ = artifacts
    target, draft = StepModel(target_dir), StepModel(near_draft)
    ar = make_policy("ar", target)
    lever = Lever(target, draft, LeverConfig(top_k=3), prices=(FixedPrices(1.0), FixedPrices(0.01)))
    accepted: list[int] = []
    for prompt in PROMPTS:
        ids = tiny_tokenizer()(prompt).input_ids
        ref = run(ar, ids, 32)  # past the budget: the last cycle's tree is not cut at it
        out: list[int] = []
        for chunk in lever.generate(ids, 24, Sampler()):
            out += chunk
            # measured: the last cycle's accepted path can run past the budget; the emitted text is clipped
            # but the caches keep those (correct) rows
            last = len(out) == 24
            assert_cache_holds(draft, ids + ref, None if last else len(ids + out))
            assert_cache_holds(target, ids + ref, None if last else len(ids + out))
        assert out == ref[:24], prompt
        accepted += lever.stats.accepted
    assert 0 in accepted and max(accepted) >= 2, accepted
    assert sum(a > 0 for a in accepted) >= len(accepted) // 3, accepted


def test_sampled_lever_emits_the_targets_distribution(artifacts, near_draft):
    """Multi-candidate tree acceptance at temperature 0.1 (tests/toolchain/runtime/speculative.py):
    the second token, decided among the near draft's top-3 children of the root, follows the target."""
    target_dir, _ = artifacts
    target, draft = StepModel(target_dir), StepModel(near_draft)
    lever = Lever(target, draft, LeverConfig(top_k=3, max_depth=1), prices=(FixedPrices(1.0), FixedPrices(0.01)))
    ids = tiny_tokenizer()(PROMPTS[0]).input_ids
    r = second_token_check(lever, StepModel(target_dir), ids, 0.1, 300)
    # measured chi2 4.4; a residual that keeps a rejected candidate's mass: 43 (28 with 150 runs, too close)
    assert r["chi2"] < CHI2_5DOF_P001, r


def test_context_exhaustion_finishes_like_ar(artifacts):
    target_dir, draft_dir = artifacts
    target, draft = StepModel(target_dir), StepModel(draft_dir)
    ids = list(np.random.default_rng(0).integers(3, 500, size=40))
    ref = run(make_policy("ar", target), ids, 100)
    lever = Lever(target, draft, LeverConfig(top_k=3), prices=(FixedPrices(1.0), FixedPrices(0.01)))
    assert run(lever, ids, 100) == ref and len(ref) < 100  # the last tokens come from plain target steps
    assert lever.stats.tokens == len(ref)


def test_lever_by_name_with_phone_costs_and_sampling(artifacts):
    target_dir, draft_dir = artifacts
    target, draft = StepModel(target_dir), StepModel(draft_dir)
    lever = make_policy("lever", target, draft, device="snapdragon-8-gen-3", target_dram=0.0)
    ids = tiny_tokenizer()(PROMPTS[2]).input_ids
    assert run(lever, ids, 25) == run(make_policy("ar", target), ids, 25)
    out = run(lever, ids, 25, Sampler(temperature=0.8, seed=3))
    assert len(out) == 25 and all(0 <= t < 512 for t in out)
    # reproducible for a seed from a fresh policy (a used one has calibrated on earlier runs)
    again = make_policy("lever", target, draft, device="snapdragon-8-gen-3", target_dram=0.0)
    assert run(make_policy("lever", target, draft), ids, 25, Sampler(temperature=0.8, seed=3)) == \
        run(again, ids, 25, Sampler(temperature=0.8, seed=3))


@pytest.fixture(scope="module")
def prefill_pair(tmp_path_factory):
    """(target, draft) folders: the target has a tree graph of 4 rows and a prefill graph of 8 (context 64);
    the draft a longer context (128), so near the target's end the draft still has room for trees."""
    from tests.tiny import save_tiny, write_recipe
    from toolchain.compile.pipeline import compile_recipe

    root = tmp_path_factory.mktemp("lever_prefill")
    target = write_recipe(root / "t.yaml", save_tiny(root / "t_hf", "llama", seed=0), name="target-p",
                          graphs="  decode: {width: 1, context: 64}\n  tree4: {width: 4, context: 64, role: tree}\n"
                                 "  prefill: {width: 8, context: 64}\n", extra="passes: [split_lm_head]\n")
    draft = write_recipe(root / "d.yaml", save_tiny(root / "d_hf", "llama", seed=1), name="draft-p",
                         graphs="  decode: {width: 1, context: 128}\n  tree4: {width: 4, context: 128, role: tree}\n")
    return compile_recipe(target).out_dir, compile_recipe(draft).out_dir


def test_phone_priced_lever_also_verifies_on_the_prefill_graph(prefill_pair):
    """On the phone's prices a verify is nearly flat in rows, so the prefill graph is one more verify
    width; CPU prices keep to the tree graphs. Either way the output is ar's."""
    target_dir, draft_dir = prefill_pair
    target, draft = StepModel(target_dir), StepModel(draft_dir)
    ids = tiny_tokenizer()(PROMPTS[0]).input_ids
    ref = run(make_policy("ar", target), ids, 24)
    phone = Lever(target, draft, LeverConfig(top_k=3), prices=(FixedPrices(1.0), FixedPrices(0.01)))
    assert sorted(phone.verifier.widths) == [1, 4, 8]
    assert run(phone, ids, 24) == ref
    assert phone.stats.widths[8] > 0  # flat verify prices: the builder filled the 8-row graph
    cpu = Lever(target, draft, LeverConfig(top_k=3, cost="cpu"))
    assert sorted(cpu.verifier.widths) == [1, 4]
    assert run(cpu, ids, 24) == ref


def test_near_the_context_end_lever_keeps_verifying_on_the_graphs_that_fit(prefill_pair):
    """With 58 of the target's 64 rows taken the 8-row graph no longer fits but the 4-row one does:
    lever goes on with 4-row trees (it used to fall back to plain steps once its widest graph did not fit)."""
    target_dir, draft_dir = prefill_pair
    target, draft = StepModel(target_dir), StepModel(draft_dir)
    ids = list(np.random.default_rng(1).integers(3, 500, size=58))
    ref = run(make_policy("ar", target), ids, 6)
    lever = Lever(target, draft, LeverConfig(top_k=3), prices=(FixedPrices(1.0), FixedPrices(0.01)))
    assert run(lever, ids, 6) == ref
    assert set(lever.stats.widths) == {4}, lever.stats.widths
