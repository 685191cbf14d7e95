"""Prefill and plain greedy decoding over an artifact's step graphs (the AR baseline's core)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from toolchain.runtime.cache import KVCache
from toolchain.runtime.sessions import ArtifactSessions


def family_by_role(sessions: ArtifactSessions, role: str) -> str | None:
    """The family whose first stage has the role (decode/prefill/...), widest first for prefill."""
    fams = [f for f in sessions.families() if sessions.chain(f)[0].role == role]
    if not fams:
        return None
    return max(fams, key=lambda f: sessions.chain(f)[0].width)


def decode_family(sessions: ArtifactSessions) -> str:
    fam = family_by_role(sessions, "decode")
    if fam is None:
        widths = {f: sessions.chain(f)[0].width for f in sessions.families()}
        fam = min(widths, key=widths.get)
    return fam


def run_tokens(sessions: ArtifactSessions, family: str, cache: KVCache, tokens: Sequence[int],
               width: int, commit: bool = True) -> np.ndarray:
    """One call with up to `width` causal tokens; commits their rows; returns their logits [k,V]."""
    feeds = cache.step_inputs(list(tokens), width)
    outs = sessions.run_family(family, feeds)
    if commit:
        cache.commit(outs, range(len(tokens)))
    return outs["logits"][0, : len(tokens)]


def prefill(sessions: ArtifactSessions, cache: KVCache, ids: Sequence[int]) -> np.ndarray:
    """Feeds the prompt through the widest prefill graph (chunked), else token by token.

    Returns the logits of the last prompt token.
    """
    fam = family_by_role(sessions, "prefill") or decode_family(sessions)
    width = sessions.chain(fam)[0].width
    logits = None
    for start in range(0, len(ids), width):
        chunk = ids[start : start + width]
        logits = run_tokens(sessions, fam, cache, chunk, width)
    assert logits is not None, "empty prompt"
    return logits[-1]


def greedy(sessions: ArtifactSessions, ids: Sequence[int], max_new_tokens: int,
           eos_ids: Sequence[int] = ()) -> list[int]:
    fam = decode_family(sessions)
    layout = sessions.layout(fam)
    cache = KVCache(layout, sessions.rope)
    last = prefill(sessions, cache, ids)
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(np.argmax(last))
        out.append(token)
        if token in eos_ids or cache.free(layout.width) < 0:
            break
        last = run_tokens(sessions, fam, cache, [token], layout.width)[-1]
    return out
