"""chain: classic draft-then-verify speculative decoding.

State between rounds: both caches hold the committed text except the newest token `pending`,
which the target has not seen yet. A round drafts up to gamma tokens with the draft model
(one width-1 call each), then runs the target once on [pending, d1..dg] through its narrowest
graph of width >= gamma+1 (causal mask; padding rows are masked off by the cache manager).
A round drafts past gamma while the draft is confident (its drafted token's probability >=
`extend_at`), up to the rows of the widest verify graph of at most `extend_rows`: a
confident draft is usually accepted (a long context-lookup match, +lookup, is the typical case),
and each accepted token saves a whole target step, more than a wider verify call costs. The call
itself runs on the narrowest graph that holds its rows (on a CPU a call's cost grows with its
rows, so a recipe may compile a gamma+1-wide graph beside a wider one). With +lookup, where the text's
suffix matches RUN_MATCH+ tokens earlier on, the rest of the round is the text that followed the match
there, drafted with no draft call (a lookup run); the draft hears the accepted part next round, in one call.
Row i of that call predicts the token after d_i, so accepting k drafts emits k+1 tokens
(the k drafts and the target's correction or bonus) for one target call; the target
commits the rows of pending and the k accepted drafts, and the draft cache is rolled back to
what the target accepted.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from toolchain.errors import MobcError
from toolchain.runtime.model import StepModel
from toolchain.runtime.policies.base import Policy
from toolchain.runtime.policies.sampling import Sampler, accept_chain, top_probability

EXTEND_AT = 0.8  # a drafted token's probability from which a round drafts past gamma
EXTEND_ROWS = 8  # the most rows such a round's verify call fills (its graph: the widest of at most this many)
# with +lookup, a context match of at least this many tokens drafts what followed it with no draft call: on the
# 44 bench prompts (SmolLM2-135M, shipped head, one thread) 1.77x ar against 1.63x without, 2.72 tokens per
# target call against 2.74 (docs/draft-head.md)
RUN_MATCH = 3


class Chain(Policy):
    name = "chain"

    def __init__(self, target: StepModel, draft: StepModel | None = None, gamma: int = 4,
                 extend_at: float = EXTEND_AT, extend_rows: int = EXTEND_ROWS, run_match: int | None = None):
        if draft is None:
            raise MobcError("policy chain needs a draft model: pass --draft <artifact folder>")
        if draft.vocab != target.vocab:
            raise MobcError(
                f"draft {draft.name} has vocabulary {draft.vocab} but target {target.name} has "
                f"{target.vocab}; a draft must share the target's tokenizer"
            )
        if gamma < 1:
            raise MobcError("gamma (draft tokens per round) must be >= 1")
        super().__init__(target, draft)
        self.gamma = gamma
        self.extend_at = extend_at
        fam = target.family_for(gamma + 1)  # fail early, with the fix, when no verify graph is wide enough
        rows = max((w for w in target.widths.values() if gamma + 1 <= w <= extend_rows), default=target.widths[fam])
        # confident drafts past gamma fill up to these rows; extend_at >= 1 turns that off (a probability
        # can round to exactly 1.0, so the comparison alone would not)
        self.max_drafts = rows - 1 if extend_at < 1 else gamma
        # a context-lookup match of at least run_match tokens drafts the text that followed it there, the
        # round's remaining drafts at once, with no draft call (0: never; None: RUN_MATCH with +lookup); the
        # draft hears those tokens in one call next round, with the target's features where they were accepted
        looks_up = hasattr(draft, "lookup_run")
        if run_match and not looks_up:
            raise MobcError(f"chain's runs={run_match} drafts context-lookup runs: use chain+lookup")
        self.run_match = (RUN_MATCH if looks_up else 0) if run_match is None else run_match

    def generate(self, prompt: Sequence[int], max_new_tokens: int, sampler: Sampler) -> Iterator[list[int]]:
        assert self.draft is not None
        draft, target = self.draft, self.target
        self._start(prompt)
        pending = self._prefill(prompt, sampler)
        n = 1
        try:
            yield [pending]
            if pending in target.eos_ids:
                return
            todo = [pending]  # committed text the draft has not consumed yet (ends with pending)
            while n < max_new_tokens:
                g = min(self.gamma, max_new_tokens - n)
                if not (target.room(g + 1) and draft.room(1) and draft.cache.free(1) >= len(todo) + g):
                    # out of context for a verify round: finish with plain target steps, like ar
                    nxt = yield from self._ar_step(pending, n, sampler)
                    if nxt is None:
                        return
                    pending, n = nxt, n + 1
                    todo.append(pending)
                    continue
                g_max = max(g, min(self.max_drafts, max_new_tokens - n))  # drafts past g need their room too
                if not (target.room(g_max + 1) and draft.cache.free(1) >= len(todo) + g_max):
                    g_max = g
                base = draft.length
                drafts: list[int] = []
                qs: list[np.ndarray | None] = []
                feed = todo
                confident = True
                fed = 0  # how many of todo + drafts the draft has consumed
                while len(drafts) < g or (confident and len(drafts) < g_max):
                    run = self._run(draft, feed, g - len(drafts), g_max - len(drafts), sampler)
                    if run:
                        drafts += run
                        qs += [None] * len(run)
                        break
                    if len(feed) <= 2:  # width-1 calls: a wider graph would waste its rows
                        for tok in feed:
                            logits = draft.feed([tok])
                    else:  # what a lookup run left unheard: one call
                        logits = draft.feed(feed)
                    fed += len(feed)
                    q = sampler.probs(logits) if not sampler.greedy else None
                    drafts.append(int(np.argmax(logits)) if q is None else sampler.sample(q))
                    qs.append(q)
                    confident = (top_probability(logits) if q is None else q[drafts[-1]]) >= self.extend_at
                    feed = [drafts[-1]]
                v_logits = target.forward([pending, *drafts])
                k, nxt = accept_chain(v_logits, drafts, qs, sampler)
                target.commit(range(k + 1))
                self.stats.accepted.append(k)
                # the draft consumed `fed` of todo + drafts (all but the last draft, or up to a lookup run);
                # keep only what the target accepted, and feed it the accepted text it has not heard
                keep = min(fed, len(todo) + k)
                if fed > keep:
                    draft.truncate(base + keep)
                todo = [*todo, *drafts][keep : len(todo) + k] + [nxt]
                new, stop = self._clip([*drafts[:k], nxt], max_new_tokens - n)
                n += len(new)
                self.stats.tokens = n
                pending = nxt
                yield new
                if stop:
                    return
        finally:
            self._finish()

    def _run(self, draft, feed: list[int], least: int, most: int, sampler: Sampler) -> list[int] | None:
        """The context-lookup run to draft instead of calling the draft (greedy only: a run has no
        distribution to sample against), when its match is long enough and it fills the round to gamma."""
        if not self.run_match or not sampler.greedy:
            return None
        return draft.lookup_run(feed, self.run_match, least, most) or None
