"""Rejection sampling keeps the target's distribution (statistical test, fixed seed)."""

from __future__ import annotations

import numpy as np

from toolchain.runtime.policies.sampling import Sampler, accept_chain, softmax, top_probability

# chi-square critical value for 5 degrees of freedom at p = 0.001 (tables; no scipy needed)
CHI2_5DOF_P001 = 20.515


def chi2(observed: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * observed.sum()
    return float(((observed - expected) ** 2 / expected).sum())


P = np.array([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])  # target
Q = np.array([0.10, 0.10, 0.30, 0.30, 0.10, 0.10])  # a deliberately bad draft


def test_chain_acceptance_reproduces_target_distribution():
    sampler = Sampler(temperature=1.0, seed=1234)
    logits_p = np.log(P)
    gamma, trials = 3, 20000
    first = np.zeros(len(P))
    second = np.zeros(len(P))
    for _ in range(trials):
        drafts = [sampler.sample(Q) for _ in range(gamma)]
        k, nxt = accept_chain(np.stack([logits_p] * (gamma + 1)), drafts, [Q] * gamma, sampler)
        emitted = [*drafts[:k], nxt]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
    # emitted tokens are i.i.d. samples of P, whatever the draft proposed
    assert chi2(first, P) < CHI2_5DOF_P001
    assert chi2(second, P) < CHI2_5DOF_P001
    # a draft-shaped bias would be caught: Q itself is far outside the bound
    assert chi2(first, Q) > 10 * CHI2_5DOF_P001
    # and the draft was really rejected often (the test exercises the residual path)
    assert second.sum() < 0.7 * trials


def test_greedy_acceptance_is_longest_matching_prefix():
    logits = np.eye(5)[[1, 2, 3, 4]] * 5.0  # target argmax: 1, 2, 3, 4
    s = Sampler()
    assert accept_chain(logits, [1, 2, 3], [None] * 3, s) == (3, 4)
    assert accept_chain(logits, [1, 0, 3], [None] * 3, s) == (1, 2)
    assert accept_chain(logits, [0, 2, 3], [None] * 3, s) == (0, 1)


def test_softmax_and_top_probability_agree_with_float64_on_a_masked_row():
    rng = np.random.default_rng(1)
    logits = np.full(49152, -1e4, np.float32)  # a draft head's row: most tokens outside its vocabulary
    logits[rng.choice(49152, 8192, replace=False)] = rng.normal(size=8192).astype(np.float32) * 4
    ref = np.exp(logits.astype(np.float64) - logits.max())
    ref /= ref.sum()
    got = softmax(logits)
    assert got.dtype == np.float64 and abs(got.sum() - 1) < 1e-9
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-12)
    assert abs(top_probability(logits) - ref.max()) < 1e-6
