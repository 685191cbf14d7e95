"""Chain runs replayed on the target's greedy answers: what `mobc bench decode` would count, in seconds.

A teacher-forced count from every answer position (bench/head.py's chains) weighs every position alike; a
run starts a round only where the last one ended, so easy stretches are crossed in few rounds and hard ones
cost a round per token, and its tokens per target call are lower. The replay walks an answer as the chain
policy does: a round at position s drafts gamma tokens, more while the draft is confident (its drafted
token's probability >= extend_at, up to max_drafts), accepts the leading drafts equal to the target's
tokens and starts the next round after them. With `lookup` every draft position also asks the context
lookup the runtime uses (toolchain/runtime/lookup.py: the same proposal, overrule and confidence rules).

While every draft of a round so far is right, the text before the next one is the answer's own, so the
replay reads its drafts from chains drafted on the true prefix (draft_chains: [a, s] is the (a+1)-th draft
of the chain after position s), and a lookup token's probability from the head's own distribution there, as
the runtime's blend does. One approximation: after a lookup token the head itself got wrong, a run's
head continues from its own features of that row, the replay from the target's (a fresh chain there).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from toolchain.runtime.lookup import confidence, lookup_run, overruled, propose


def replay_chain(ids: Sequence[int], start: int, drafts: torch.Tensor, dist: torch.Tensor, vocab_ids: torch.Tensor,
                 gamma: int, extend_at: float, max_drafts: int, lookup: bool = False, run_match: int = 0) -> list[int]:
    """Accepted drafts per round of a greedy chain run over `ids` (prompt + answer, the answer from position
    `start` on: the prefill gives ids[start]). drafts [D, T]: the head's chains from every position (D >=
    max_drafts); dist [D, T, V']: the head's distribution over its draft vocabulary `vocab_ids` [V'] at each;
    run_match (with lookup): chain's lookup runs, the rest of a round drafted from a match this long."""
    ids = list(map(int, ids))
    column = {int(t): i for i, t in enumerate(vocab_ids.tolist())}
    n, depth = len(ids), drafts.shape[0]
    rounds = []
    s = start
    while s < n - 1:
        left = n - 1 - s  # answer tokens after the pending one
        g, g_max = min(gamma, left), min(max(gamma, max_drafts), left)
        accepted = 0
        own = True  # every draft so far was the head's own chain (no lookup token it got wrong)
        for a in range(g_max):
            run = lookup_run(ids[: s + 1 + a], run_match, g - a, g_max - a) if lookup and run_match else []
            if run:  # drafted whole, no extension check: accepted up to its first wrong token
                accepted += next((i for i, t in enumerate(run) if t != ids[s + 1 + a + i]), len(run))
                break
            row, col = (a, s) if own and a < depth else (0, s + a)  # else: a fresh chain (the one approximation)
            token = int(drafts[row, col])
            p = float(dist[row, col].max())
            head_token = token
            if lookup:
                prop = propose(ids[: s + 1 + a])
                if prop is not None and not overruled(token, p, prop):
                    q = confidence(prop.match)  # the blend: q on the proposal, 1-q on the head's distribution
                    own_p = float(dist[row, col, column[prop.token]]) if prop.token in column else 0.0
                    token, p = prop.token, q + (1 - q) * own_p  # q >= 0.5 > (1-q) * any other token's
            if token != ids[s + 1 + a]:
                break
            accepted += 1
            own = own and head_token == token
            if a + 1 >= g and p < extend_at:
                break
        rounds.append(accepted)
        s += accepted + 1
    return rounds


def head_distribution(head, hidden: torch.Tensor) -> torch.Tensor:
    """[D, T, V'] the head's distribution over its draft vocabulary from its output rows [D, T, C]."""
    with torch.no_grad():
        return torch.softmax(head.logits(hidden).float(), -1)


def tokens_per_call(answers: list[tuple[int, list[int]]]) -> float | None:
    """Tokens per target call over (answer tokens, rounds) pairs, as `mobc bench decode` counts a run: every
    answer token (the prefill's first one too; a last round's bonus past the answer's end is not one) over the
    calls after the prefill (each round's verify)."""
    calls = sum(len(r) for _, r in answers)
    return sum(t for t, _ in answers) / calls if calls else None
