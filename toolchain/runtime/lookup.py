"""Context lookup: propose the token that followed the latest earlier occurrence of the text's suffix.

Small models repeat themselves (code identifiers, docstring phrases, loops of whole lines) and
chat answers quote their prompt; the text already in the cache is then the best draft there is,
and it costs no model call (prompt-lookup / suffix decoding). `propose` finds the longest suffix
of `tokens` (at least `min_match`, at most `max_match` tokens) that also ends earlier in
`tokens`, and returns the token that followed its most recent such occurrence.

`LookupDraft` blends the proposal into a draft model's distribution with a probability by match
length (`confidence`), so a tree builder weighs lookup branches against the draft's own candidates,
unless the draft confidently disagrees (`overruled`): then the row stays the draft's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from toolchain.runtime.policies.sampling import log_partition


@dataclass(frozen=True)
class Proposal:
    token: int
    match: int  # length of the matched suffix
    after: tuple[int, ...] = ()  # the tokens that followed `token` there (with propose's `follow`)


def propose(tokens: Sequence[int] | np.ndarray, min_match: int = 2, max_match: int = 8,
            follow: int = 0) -> Proposal | None:
    """The continuation of the longest (then most recent) earlier occurrence of the suffix, and up to
    `follow` of the tokens after it."""
    arr = np.asarray(tokens, dtype=np.int64)
    n = len(arr)
    if n <= min_match:
        return None
    # candidate ends j < n-1 with arr[j] == arr[-1]; the continuation arr[j+1] must exist
    ends = np.flatnonzero(arr[: n - 1] == arr[-1])
    if len(ends) == 0:
        return None
    match = np.ones(len(ends), np.int64)
    alive = np.ones(len(ends), bool)
    for k in range(1, max_match):
        idx = ends - k
        ok = alive & (idx >= 0)
        ok[ok] = arr[idx[ok]] == arr[n - 1 - k]
        match += ok
        alive = ok
        if not alive.any():
            break
    best = int(match.max())
    if best < min_match:
        return None
    j = int(ends[np.flatnonzero(match == best)[-1]])
    return Proposal(int(arr[j + 1]), best, tuple(arr[j + 2 : j + 2 + follow].tolist()))


def lookup_run(tokens: Sequence[int], min_match: int, least: int, most: int, max_match: int = 8) -> list[int]:
    """What chain drafts as a lookup run after `tokens`: the proposal and the tokens that followed it, up to
    `most`, when the suffix matches at least `min_match` tokens and the run has at least `least`; else []."""
    prop = propose(tokens, max(min_match, 2), max_match, most - 1)
    run = [prop.token, *prop.after] if prop else []
    return run if len(run) >= least else []


def blend(logits: np.ndarray, proposal: Proposal | None, p: float,
          partition: tuple[np.ndarray, float] | None = None) -> np.ndarray:
    """Logits of (1-p) * softmax(logits) + p * onehot(proposal): the draft's distribution with the
    lookup token given probability mass p (unchanged when there is no proposal).

    Every other token's log-probability is its own shifted by log(1-p), so only the proposal's
    entry needs the mixture: one `log_partition` of the row, not a float64 exp and log of every
    entry (that cost 2.5 ms per 49k-token row, more than the draft head's call). `partition`: the row's
    log_partition, when the caller has it already."""
    if proposal is None:
        return logits
    z, lse = partition or log_partition(logits)
    own = float(z[proposal.token]) - lse  # the proposal's log-probability under the draft alone
    if p < 1:
        out = z + np.float32(np.log1p(-p) - lse)
        out[proposal.token] = np.logaddexp(np.log1p(-p) + own, np.log(p))
    else:  # all mass on the proposal; the rest stays ordered, far below it
        out = z - np.float32(lse + 50.0)
        out[proposal.token] = 0.0
    return out


# The probability a lookup proposal gets in the draft's distribution, by match length. Measured on
# SmolLM2-135M's greedy answers (matches of 2+ tokens): 85% of proposals were the target's token on
# HumanEval prompts, 67% on chat prompts; the values sit at or below those and rise with the match
# length. Lever's calibrator corrects them per run; chain and ahasd draft the argmax, which is the
# proposal whenever p >= 0.5.
CONFIDENCE = {2: 0.6, 3: 0.7, 4: 0.8}
CONFIDENCE_LONG = 0.9  # matches of 5 tokens or more


def confidence(match: int) -> float:
    return CONFIDENCE.get(match, CONFIDENCE_LONG if match > max(CONFIDENCE) else 0.5)


# A proposal the draft disagrees with, while its own top token has at least this probability, is dropped
# (by match length). CONFIDENCE is a proposal's precision over all of them, most of which the draft agrees
# with; where they disagree, the lookup is right less often. Fit on text no bench reads (SmolLM2-135M's
# answers to 64 held-out self-written requests and its continuations of 16 held-out stdlib windows, the
# shipped head drafting, 2602 disagreements): a 2-token match was right less often than the head from a
# head probability of 0.2 on, a 3-4-token one from 0.5; a longer one about as often from 0.7 and never
# clearly less. On the 44 bench prompts chain+lookup's tokens per target call went from 2.68 to 2.74 (docs/draft-head.md).
OVERRULE = {2: 0.2, 3: 0.5, 4: 0.5}
OVERRULE_LONG = 0.9


def overruled(top: int, top_p: float, proposal: Proposal) -> bool:
    """Whether the draft, whose top token is `top` with probability `top_p`, overrules `proposal`."""
    return top != proposal.token and top_p >= OVERRULE.get(proposal.match, OVERRULE_LONG)


@dataclass(frozen=True)
class Run:
    """A lookup proposal as a chain: `token`, then the tokens that followed it, each with `p`."""

    token: int
    after: tuple[int, ...]
    p: float


class LookupDraft:
    """A draft model whose distribution also proposes the context's own continuation.

    Wraps any draft (a StepModel or a HeadDraft) and looks like it to a policy; it tracks the
    tokens in the draft's cache (prefill, feed, truncate) and blends the lookup proposal for that
    text into every logits row it returns. The wrapped draft still runs every token, so its cache
    and features stay exact."""

    def __init__(self, inner, min_match: int = 2, max_match: int = 8, follow: int = 32):
        self.inner = inner
        self.min_match, self.max_match = min_match, max_match
        self.follow = follow  # tokens after a proposal a tree drafter may hang under it (LookupTree)
        self.tokens: list[int] = []
        self.proposals = 0  # rows whose distribution carried a lookup proposal
        self.overruled = 0  # proposals dropped because the draft confidently disagreed (overruled)

    def __getattr__(self, name: str):  # everything else is the wrapped draft's (cache, widths, calls, ...)
        return getattr(self.inner, name)

    @property
    def step_model(self):  # what benches time and price
        return getattr(self.inner, "step_model", self.inner)

    def proposed(self, logits: np.ndarray, context: Sequence[int], follow: int = 0
                 ) -> tuple[np.ndarray, Proposal | None]:
        """The row with the lookup proposal for `context` blended in, and that proposal (None: the row
        is the draft's own); `follow`: how many of the tokens after it the proposal also carries."""
        prop = propose(context, self.min_match, self.max_match, follow)
        if prop is None:
            return logits, None
        z, lse = log_partition(logits)
        if overruled(int(np.argmax(z)), float(np.exp(-lse)), prop):
            self.overruled += 1
            return logits, None
        self.proposals += 1
        return blend(logits, prop, confidence(prop.match), (z, lse)), prop

    def lookup_run(self, unheard: Sequence[int], min_match: int, least: int, most: int) -> list[int]:
        """`lookup_run` after the draft's text plus `unheard` (tokens the draft has not run yet)."""
        return lookup_run([*self.tokens, *unheard], max(min_match, self.min_match), least, most, self.max_match)

    def blended(self, logits: np.ndarray, context: Sequence[int]) -> np.ndarray:
        return self.proposed(logits, context)[0]

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        self.tokens = list(ids)
        return self.blended(self.inner.prefill(ids), self.tokens)

    def feed(self, tokens: Sequence[int]) -> np.ndarray:
        logits = self.inner.feed(tokens)
        self.tokens.extend(tokens)
        return self.blended(logits, self.tokens)

    def truncate(self, length: int) -> None:
        self.inner.truncate(length)
        del self.tokens[length:]

    def reset(self, stats: bool = True) -> None:
        self.inner.reset(stats)
        self.tokens = []

    def tree_drafter(self):
        from toolchain.runtime.head_draft import tree_drafter

        return LookupTree(tree_drafter(self.inner), self)


class LookupTree:
    """Lever's tree drafter with lookup: a node's context is the committed text plus its path.

    A proposal also brings the tokens that followed it in the context (`runs`): a tree builder may
    hang them under the proposed child as a chain of nodes no draft call proposed, so a long repeat
    is drafted at once instead of one level per call (each chain node becomes expandable once its
    parent has run)."""

    def __init__(self, inner, draft: LookupDraft):
        self.inner, self.draft = inner, draft
        self.committed: list[int] = []
        self._tree = None  # the tree of the cycle's last expand (finish reads its tokens)
        self.runs: dict[int, Run] = {}  # node -> its lookup proposal's run, this cycle (start resets it)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def start(self, todo: Sequence[int]) -> np.ndarray:
        logits = self.inner.start(todo)
        self.draft.tokens.extend(todo)
        self.committed = list(self.draft.tokens)
        self.runs = {}
        return self._row(logits, self.committed, 0)

    def _row(self, logits: np.ndarray, context: list[int], node: int) -> np.ndarray:
        """A node's blended row; its proposal's run, if it has one, is kept for the builder."""
        row, prop = self.draft.proposed(logits, context, self.draft.follow)
        if prop is not None and prop.after:
            self.runs[node] = Run(prop.token, prop.after, confidence(prop.match))
        return row

    def _path(self, tree, node: int) -> list[int]:
        out = []
        while node > 0:
            out.append(tree.tokens[node])
            node = tree.parents[node]
        return out[::-1]

    def expand(self, tree, nodes: list[int]) -> np.ndarray:
        self._tree = tree
        rows = self.inner.expand(tree, nodes)
        return np.stack([self._row(r, self.committed + self._path(tree, x), x)
                         for r, x in zip(rows, nodes, strict=True)])

    def finish(self, path: Sequence[int]) -> int:
        kept = self.inner.finish(path)  # the accepted path's first `kept` nodes stay in the draft cache
        self.draft.tokens = self.committed + [self._tree.tokens[x] for x in path[1 : 1 + kept]]
        return kept
