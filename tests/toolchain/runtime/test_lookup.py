"""Context lookup: the proposal rule, the blended distribution, and its bookkeeping under the policies."""

from __future__ import annotations

import numpy as np

from toolchain.runtime.lookup import OVERRULE, LookupDraft, Proposal, blend, confidence, propose


def test_propose_takes_the_longest_then_the_most_recent_match():
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 1, 2, 9, 7, 1, 2, 8, 3, 1, 2]
    # suffix [1, 2] ends at 2 and at 6 (match 2 both; [x,1,2] differs): the most recent wins -> 8
    assert propose(tokens) == Proposal(8, 2)
    # a longer match beats a more recent one: [7, 1, 2] ends at 6 only
    assert propose([7, 1, 2, 4, 0, 1, 2, 6, 7, 1, 2]) == Proposal(4, 3)
    assert propose([1, 2, 3, 4]) is None  # the last token never occurred before
    assert propose([4, 2, 3, 2]) is None  # a match of 1 is below min_match
    assert propose([4, 2, 3, 2], min_match=1) == Proposal(3, 1)
    assert propose([1, 2, 3] * 4, max_match=4) == Proposal(1, 4)  # capped; the latest of the longest
    # follow: the tokens after the proposal in that occurrence, as many as there are
    assert propose(tokens, follow=2) == Proposal(8, 2, (3, 1))
    assert propose(tokens, follow=9) == Proposal(8, 2, (3, 1, 2))
    assert propose([7, 1, 2, 4, 0, 1, 2, 6, 7, 1, 2], follow=3) == Proposal(4, 3, (0, 1, 2))


def test_blend_is_the_mixture_it_claims():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=50).astype(np.float32) * 3
    logits[:10] = -1e4  # masked rows (a head's tokens outside its vocabulary) stay negligible
    p = 0.7
    out = blend(logits, Proposal(3, 2), p)
    q = np.exp(logits - logits.max())
    q /= q.sum()
    want = (1 - p) * q
    want[3] += p
    got = np.exp(out.astype(np.float64) - out.max())
    got /= got.sum()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-12)
    assert np.isfinite(out).all() and int(np.argmax(out)) == 3
    assert blend(logits, None, p) is logits
    assert confidence(2) < confidence(3) < confidence(4) < confidence(9) <= 0.9


def test_blend_on_a_masked_proposal_and_with_all_the_mass():
    logits = np.array([2.0, 1.0, -1e4, 0.5], np.float32)
    out = blend(logits, Proposal(2, 5), 0.9)  # the proposal is a token the draft cannot emit itself
    got = np.exp(out.astype(np.float64))
    np.testing.assert_allclose(got.sum(), 1.0, rtol=1e-6)  # log-probabilities, normalized
    np.testing.assert_allclose(got[2], 0.9, rtol=1e-6)
    top = blend(logits, Proposal(3, 5), 1.0)
    assert int(np.argmax(top)) == 3 and top[3] == 0.0 and list(np.argsort(top[:3])) == [2, 1, 0]


def _row(top: int, p: float, vocab: int = 50) -> np.ndarray:
    """Logits whose softmax gives token `top` probability p and the rest equal shares."""
    q = np.full(vocab, (1 - p) / (vocab - 1))
    q[top] = p
    return np.log(q).astype(np.float32)


def test_a_draft_that_confidently_disagrees_overrules_a_short_match():
    lookup = LookupDraft(inner=None)
    short = [5, 1, 2, 9, 7, 1, 2]  # proposes 9 after a 2-token match
    long = [3, 4, 5, 6, 7, 9, 8, 3, 4, 5, 6, 7]  # proposes 9 after a 5-token match
    assert propose(short) == Proposal(9, 2) and propose(long) == Proposal(9, 5)
    cases = [  # (context, the draft's top token, its probability, whether the proposal survives)
        (short, 4, OVERRULE[2] + 0.05, False),  # disagrees, just above the 2-token bar: the draft's row stands
        (short, 4, OVERRULE[2] - 0.05, True),  # below it: the lookup wins
        (short, 9, 0.99, True),  # agrees: blended, however confident
        (long, 4, 0.8, True),  # a long match outweighs a draft that is fairly sure
        (long, 4, 0.97, False),
    ]
    for context, top, p, survives in cases:
        row = _row(top, p)
        out, prop = lookup.proposed(row, context)
        assert (prop is not None) == survives, (context, top, p)
        assert int(np.argmax(out)) == (9 if survives else top)
        if not survives:
            assert out is row
    assert lookup.overruled == 2 and lookup.proposals == 3
