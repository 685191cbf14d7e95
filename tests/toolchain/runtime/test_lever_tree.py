"""Gain/cost tree construction on synthetic drafts: exact selection, near-optimal online growth,
the adaptive stop rule, tree masks/positions, and lossless sampled multi-candidate acceptance."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from toolchain.artifact.layout import MASK_MIN
from toolchain.runtime.lever_tree import (
    Calibrator,
    StepCost,
    TreeBuilder,
    select,
    top_candidates,
    top_softmax,
)
from toolchain.runtime.policies.sampling import Sampler, softmax
from toolchain.runtime.tree import Tree, accept_greedy, accept_sampled

VERIFY = StepCost({1: 1.0, 4: 1.05, 8: 1.2})


def synthetic_tree(rng, branching: int, depth: int) -> Tree:
    """A full draft tree whose children probabilities are Dirichlet draws (gains = path products)."""
    t = Tree.root(0)
    frontier = [0]
    for _ in range(depth):
        nxt = []
        for u in frontier:
            probs = np.sort(rng.dirichlet(np.ones(branching + 1) * 0.6))[::-1][:branching]
            for j, p in enumerate(probs):
                nxt.append(t.add(u, 10 * u + j + 1, p, t.gains[u] * p))
        frontier = nxt
    return t


def closed_subsets(t: Tree, max_size: int):
    nodes = list(range(1, len(t)))
    for r in range(0, max_size + 1):
        for combo in itertools.combinations(nodes, r):
            s = set(combo)
            if all(t.parents[i] == 0 or t.parents[i] in s for i in s):
                yield s


def brute_rate(t: Tree, verify: StepCost, draft: StepCost | None, sunk: float = 0.0) -> float:
    """Best (1 + sum gains) / (draft + verify) over every parent-closed subset of the tree.

    With `draft`, revealing a subset costs one draft call per depth level, expanding exactly the
    parents the subset needs there (the cheapest schedule); without, the draft cost is `sunk`.
    """
    best = 0.0
    for s in closed_subsets(t, max(verify.by_width) - 1):
        d = sunk
        if draft is not None:
            for depth in range(1, 1 + max((t.depths[i] for i in s), default=0)):
                d += draft(len({t.parents[i] for i in s if t.depths[i] == depth}))
        best = max(best, (1 + sum(t.gains[i] for i in s)) / (d + verify(len(s) + 1)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_select_is_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    t = synthetic_tree(rng, branching=2, depth=3)
    sunk = float(rng.uniform(0.0, 0.5))
    sel = select(t.gains, t.depths, VERIFY, sunk)
    assert sel.rate == pytest.approx(brute_rate(t, VERIFY, None, sunk), rel=1e-9)
    sub, _ = t.subtree(sel.nodes)  # closed under parents (subtree() raises otherwise)
    assert len(sub) <= sel.width


def synthetic_expand(full: Tree):
    """An expand function that reveals the full tree's children (the 'draft')."""

    def expand(pool: Tree, nodes: list[int]):
        out = []
        for x in nodes:
            # find the full-tree node at the same path by tokens
            path_tokens = [pool.tokens[i] for i in pool.path(x)][1:]
            u = 0
            for tok in path_tokens:
                u = full.child_with(u, tok)
            kids = sorted(full.children(u), key=lambda c: -full.probs[c])
            out.append(([full.tokens[c] for c in kids], [full.probs[c] for c in kids]))
        return out

    return expand


def builder(draft_cost: float, full: Tree | None = None, top_k: int = 2) -> TreeBuilder:
    calib = Calibrator(top_k=top_k)
    calib.identity = True
    b = TreeBuilder(VERIFY, StepCost({1: draft_cost, 8: draft_cost * 1.1}), top_k=top_k, calibrator=calib)
    if full is not None:  # phantom children estimated from the synthetic distribution's mean ranks
        kids = [sorted((full.probs[c] for c in full.children(u)), reverse=True) for u in range(len(full))]
        kids = [k for k in kids if k]
        calib.child_mean = np.mean(kids, axis=0)
    calib.observe_children = lambda probs, decay=0.05: None  # keep the estimate fixed
    return b


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("draft_cost", [0.02, 0.1, 0.3])
def test_online_growth_is_near_the_brute_force_optimum(seed, draft_cost):
    rng = np.random.default_rng(100 + seed)
    full = synthetic_tree(rng, branching=2, depth=3)
    b = builder(draft_cost, full)
    res = b.build(0, synthetic_expand(full))
    opt = brute_rate(full, VERIFY, b.draft)
    got = res.selection.rate
    assert got <= opt * (1 + 1e-9)
    assert got >= 0.8 * opt, (got, opt, res.draft_calls)


def test_adaptive_stop_rule():
    rng = np.random.default_rng(7)
    full = synthetic_tree(rng, branching=2, depth=3)
    cheap = builder(0.01, full).build(0, synthetic_expand(full))
    dear = builder(2.0, full).build(0, synthetic_expand(full))
    assert dear.draft_calls == [] and len(dear.tree) == 1  # drafting never pays: verify the root alone (AR)
    assert len(cheap.draft_calls) >= 3 and max(cheap.pool.depths) == 3
    for res in (cheap, dear):
        for rec in res.trace[1:]:
            if "batch" in rec:  # expanded only when the batch's marginal rate beat the average rate
                assert rec["marginal_rate"] > rec["rate"] and rec["est_rate"] > rec["rate"]
        # stopped when no batch's estimated rate beats the current rate
        assert "batch" not in res.trace[-1]


def test_draft_rows_bound_the_expansions_not_the_pool():
    """The draft's free cache rows bound how many nodes it runs; proposed-but-unexpanded nodes take no
    row, so the pool grows past that bound (capping the pool by the rows stopped trees at depth 3-4)."""
    rng = np.random.default_rng(3)
    full = synthetic_tree(rng, branching=4, depth=4)
    expanded_calls = []
    inner = synthetic_expand(full)

    def expand(pool, nodes):
        expanded_calls.append(list(nodes))
        return inner(pool, nodes)

    b = builder(0.001, full, top_k=4)
    b.max_rows = 6
    res = b.build(0, expand)
    ran = [x for call in expanded_calls for x in call]
    assert len(ran) <= 6 and len(set(ran)) == len(ran)
    assert len(res.pool) > 6  # every expanded node proposed 4 children: the pool is not capped at the rows
    assert max(res.pool.depths) >= 3  # cheap drafting went deep within its 6 rows


def test_near_root_nodes_propose_more_children():
    """near_root sets the children of the root (and the next depths); deeper nodes keep top_k and hand
    their further candidates on as shadows."""
    rng = np.random.default_rng(5)
    full = synthetic_tree(rng, branching=6, depth=3)
    b = builder(0.001, full, top_k=2)
    b.near_root = (6, 4)
    b._admission_bar = lambda pool: 0.0  # every proposed child joins the pool (the bar is tested below)
    res = b.build(0, synthetic_expand(full))
    pool = res.pool
    assert len(pool.children(0)) == 6
    by_depth = {}
    for u in range(1, len(pool)):
        if pool.children(u):
            by_depth.setdefault(pool.depths[u], set()).add(len(pool.children(u)))
    assert by_depth[1] <= {4} and by_depth.get(2, {2}) <= {2}, by_depth
    assert all(len(v) == 6 - len(pool.children(u)) for u, v in pool.shadows.items())


def test_admission_bar_keeps_the_pool_small_and_the_selection():
    """A node that cannot beat the widest graph's worst selected gain is never selected, nor are its
    descendants: leaving it out of the pool keeps the pool small and the chosen tree the same."""
    rng = np.random.default_rng(11)
    full = synthetic_tree(rng, branching=6, depth=3)
    with_bar = builder(0.001, full, top_k=6).build(0, synthetic_expand(full))
    b = builder(0.001, full, top_k=6)
    b._admission_bar = lambda pool: 0.0
    without = b.build(0, synthetic_expand(full))
    assert len(with_bar.pool) < len(without.pool)
    assert with_bar.selection.rate == pytest.approx(without.selection.rate, rel=1e-9)

    def paths(res):  # the selected nodes by their token paths (pool indices differ between the two)
        return sorted(tuple(res.pool.tokens[i] for i in res.pool.path(x)) for x in res.selection.nodes)

    assert paths(with_bar) == paths(without)


def test_a_lookup_run_hangs_as_a_chain_expanded_only_below_nodes_that_ran():
    """A run offered with a node's candidates becomes a chain under the proposed child without a draft
    call (each link gains the calibrated run confidence); a chain node is expanded only once its parent
    has run, and when that parent's candidates repeat the chain's token, no second child is added."""
    from toolchain.runtime.lookup import Run

    calib = Calibrator(top_k=2)
    calib.identity = True
    b = TreeBuilder(VERIFY, StepCost({1: 1e-4, 8: 1.1e-4}), top_k=2, max_depth=8, calibrator=calib)
    calls: list[list[int]] = []
    depth_seen: list[int] = []  # the pool's depth when each draft call starts

    def expand(pool: Tree, nodes: list[int]):
        calls.append(list(nodes))
        depth_seen.append(max(pool.depths))
        for x in nodes:
            assert x == 0 or pool.parents[x] in {n for c in calls[:-1] for n in c}, "expanded before its parent ran"
        out = []
        for x in nodes:
            toks = [pool.tokens[x] + 1, pool.tokens[x] + 50]  # the run's next token is the best candidate
            out.append((toks, [0.9, 0.05], Run(1, (2, 3, 4), 0.9) if x == 0 else None))
        return out

    res = b.build(0, expand)
    pool = res.pool
    node = 0
    for depth, tok in enumerate((1, 2, 3, 4), start=1):  # the run, one node per token, no duplicates
        kids = [c for c in pool.children(node) if pool.tokens[c] == tok]
        assert len(kids) == 1, (tok, kids)
        node = kids[0]
        assert pool.gains[node] == pytest.approx(0.9**depth)
    assert depth_seen[:2] == [0, 4]  # one draft call (the root's) put the whole run in the pool
    assert 4 in [pool.tokens[x] for x in res.selection.nodes]  # and the chain is worth verifying


def test_ancestor_mask_and_positions_against_reference():
    from toolchain.artifact.layout import StepLayout
    from toolchain.runtime.cache import KVCache

    t = Tree.root(5)
    a = t.add(0, 6, 0.5, 0.5)
    t.add(0, 7, 0.3, 0.3)
    c = t.add(a, 8, 0.9, 0.45)
    t.add(c, 9, 0.9, 0.4)
    ref = np.zeros((len(t), len(t)), dtype=bool)
    for i in range(len(t)):
        j = i
        while j >= 0:
            ref[i, j] = True
            j = t.parents[j]
    assert (t.ancestor_mask() == ref).all()
    assert t.depths == [0, 1, 1, 2, 3]
    layout = StepLayout(width=8, context=32, n_layers=1, n_heads=2, n_kv=1, head_dim=4, hidden=8, vocab=16,
                        layer_kinds=("full",), rope_per_kind=False, sliding_window=None)
    rope = {"cos": np.arange(32 * 2, dtype=np.float32).reshape(32, 2), "sin": np.zeros((32, 2), np.float32)}
    cache = KVCache(layout, rope)
    cache.length = 10
    feeds = cache.step_inputs(t.tokens, 8, t.ancestor_mask(), t.depths)
    mask = feeds["attention_mask"][0, 0]
    past = 32 - 8
    for i in range(8):
        for k in range(32):
            if k < 10:
                want = True  # every query (padding too) sees the committed text
            elif past <= k:
                j = k - past
                want = ref[i, j] if i < len(t) and j < len(t) else i == j
            else:
                want = False
            assert (mask[i, k] == 0.0) == want, (i, k)
            assert mask[i, k] in (0.0, MASK_MIN)
    pos = feeds["position_cos"][0, 0, :, 0] / 2
    assert list(pos[: len(t)]) == [10 + d for d in t.depths]


def test_greedy_walk_takes_the_longest_matching_path():
    t = Tree.root(0)
    a = t.add(0, 1, 0.6, 0.6)
    t.add(0, 2, 0.3, 0.3)
    b = t.add(a, 3, 0.5, 0.3)
    t.add(b, 4, 0.5, 0.15)
    rows = {0: 1, a: 3, b: 7}  # target argmax per node: 1, then 3, then 7 (not in the tree)
    seen = []

    def row(i):
        seen.append(i)
        out = np.zeros(8)
        out[rows[i]] = 1.0
        return out

    acc = accept_greedy(t, row)
    assert acc.path == [0, a, b] and acc.next_token == 7 and seen == [0, a, b]  # path rows only


CHI2_5DOF_P001 = 20.515


def test_sampled_multi_candidate_acceptance_is_lossless():
    p = np.array([0.05, 0.40, 0.25, 0.15, 0.10, 0.05])
    p2 = np.array([0.30, 0.10, 0.10, 0.20, 0.20, 0.10])
    sampler = Sampler(temperature=1.0, seed=99)
    t = Tree.root(0)
    k1 = t.add(0, 2, 0.6, 0.6)  # deliberately not the target's favourite first
    t.add(0, 3, 0.2, 0.2)
    t.add(0, 5, 0.1, 0.1)
    t.add(k1, 4, 0.9, 0.5)

    def row(i):
        return np.log(p2 if i == k1 else p)

    trials = 20000
    first, second = np.zeros(6), np.zeros(6)
    for _ in range(trials):
        acc = accept_sampled(t, row, sampler)
        toks = [t.tokens[i] for i in acc.path[1:]] + [acc.next_token]
        first[toks[0]] += 1
        if toks[0] == 2:
            second[toks[1]] += 1
    chi = ((first - p * trials) ** 2 / (p * trials)).sum()
    assert chi < CHI2_5DOF_P001
    n2 = second.sum()
    chi2 = ((second - p2 * n2) ** 2 / (p2 * n2)).sum()
    assert chi2 < CHI2_5DOF_P001


def test_top_softmax_equals_the_top_of_each_rows_softmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (5, 300)).astype(np.float32)
    logits[2, 100:] = MASK_MIN  # a draft head's row: tokens outside its vocabulary masked
    idx, probs = top_softmax(logits, 8)
    for r, row in enumerate(logits):
        want_idx, want_p = top_candidates(softmax(row), 8)
        assert idx[r].tolist() == want_idx.tolist()
        np.testing.assert_allclose(probs[r], want_p, rtol=1e-6)
