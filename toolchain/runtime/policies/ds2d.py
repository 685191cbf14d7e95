"""ds2d: draft-free self-speculation with m learned forecast embeddings (artifact with forecast_inputs).

One call per round, in the narrowest graph of width >= (k+1)^2 (k <= m drafts per round):

    rows  [pending, d1..dc-1]            the chain: the newest token and the drafts to verify
          [F1..Fk] after each chain node  forecast rows (forecast_select one-hot, no token)

Chain rows are causal; forecast row i after node j sees the chain up to j and the forecast rows
1..i of its own set, at position pos(j) + i. Row j of the chain gives the target's greedy token
after node j, so the longest prefix of drafts equal to those tokens is accepted (a of them) and
the token from row a is emitted as well, exactly as greedy AR would produce them. The forecast
rows after node a then already hold the next round's drafts: forecast row i guesses the token
i+1 steps after the one row a predicted. Only the chain rows of accepted tokens are committed.

Greedy only: the output is token for token greedy AR's (the point of the policy's tests).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from toolchain.errors import MobcError
from toolchain.runtime.model import StepModel
from toolchain.runtime.policies.base import Policy
from toolchain.runtime.policies.sampling import Sampler

FORECAST_FILE = "forecast.npz"


def load_forecast(artifact: str | Path, path: str | Path | None = None) -> np.ndarray:
    p = Path(path) if path else Path(artifact) / FORECAST_FILE
    if not p.is_file():
        raise MobcError(f"no forecast embeddings at {p}; train them with `mobc train forecast {artifact}`")
    with np.load(p) as z:
        return z["forecast_embeds"].astype(np.float32)


def tree_layout(c: int, m: int) -> tuple[np.ndarray, list[int], list[tuple[int, int]]]:
    """(allowed [W,W], depths, (row, slot) of every forecast row) for c chain nodes and m slots."""
    w = c * (1 + m)
    allowed = np.zeros((w, w), dtype=bool)
    allowed[:c, :c] = np.tril(np.ones((c, c), dtype=bool))
    depths = list(range(c))
    rows = []
    for j in range(c):
        base = c + j * m
        for i in range(m):
            r = base + i
            allowed[r, : j + 1] = True
            allowed[r, base : r + 1] = True
            depths.append(j + 1 + i)
            rows.append((r, i))
    return allowed, depths, rows


class DS2D(Policy):
    name = "ds2d"

    def __init__(self, target: StepModel, draft: StepModel | None = None, forecast: np.ndarray | None = None,
                 depth: int | None = None):
        if forecast is None:
            forecast = load_forecast(target.folder)
        self.m = int(forecast.shape[0])
        self.k = min(depth or self.m, self.m)  # drafts per round (at most m: one set of forecasts)
        super().__init__(target, None)
        self.family = target.family_for((self.k + 1) ** 2)
        arrays = target.extra_inputs(self.family)
        if "forecast_select" not in arrays:
            raise MobcError(f"{target.name} has no forecast inputs; compile it with the forecast_inputs pass")
        if arrays["forecast_embeds"].shape != forecast.shape:
            raise MobcError(f"forecast embeddings {forecast.shape} do not fit {target.name}'s "
                            f"forecast_embeds {arrays['forecast_embeds'].shape}; retrain with mobc train forecast")
        arrays["forecast_embeds"][...] = forecast

    def _round(self, pending: int, drafts: list[int]) -> tuple[int, int, list[int]]:
        """One call: (accepted drafts, next token, next round's drafts)."""
        model, m = self.target, self.k  # forecast rows per node: only the k slots a round can use
        c = 1 + len(drafts)
        allowed, depths, rows = tree_layout(c, m)
        select = model.extra_inputs(self.family)["forecast_select"]
        select[...] = 0.0
        for r, i in rows:
            select[0, r, i] = 1.0
        tokens = [pending, *drafts] + [0] * len(rows)
        logits = model.forward(tokens, allowed, depths, self.family)
        a = 0
        while a < len(drafts) and int(np.argmax(logits[a])) == drafts[a]:
            a += 1
        nxt = int(np.argmax(logits[a]))
        model.commit(range(a + 1))
        return a, nxt, self._propose(logits, c + a * m)

    def _propose(self, logits: np.ndarray, start: int) -> list[int]:
        """Next round's drafts: the greedy tokens of the forecast rows after the last accepted node."""
        return [int(np.argmax(logits[start + i])) for i in range(self.k)]

    def generate(self, prompt: Sequence[int], max_new_tokens: int, sampler: Sampler) -> Iterator[list[int]]:
        if not sampler.greedy:
            raise MobcError("ds2d verifies greedily; use --temperature 0")
        model = self.target
        self._start(prompt)
        pending = self._prefill(prompt, sampler)  # greedy: the argmax
        n = 1
        drafts: list[int] = []
        width = model.widths[self.family]
        try:
            yield [pending]
            if pending in model.eos_ids:
                return
            while n < max_new_tokens:
                if model.cache.free(width) < 0:  # no room for a round: finish like ar
                    nxt = yield from self._ar_step(pending, n, sampler)
                    if nxt is None:
                        return
                    pending, n = nxt, n + 1
                    continue
                drafts = drafts[: max(0, max_new_tokens - n - 1)]
                a, pending, nxt_drafts = self._round(pending, drafts)
                self.stats.accepted.append(a)
                new, stop = self._clip([*drafts[:a], pending], max_new_tokens - n)
                drafts = nxt_drafts
                n += len(new)
                self.stats.tokens = n
                yield new
                if stop:
                    return
        finally:
            model.extra_inputs(self.family)["forecast_select"][...] = 0.0
            self._finish()


def make(target: StepModel, draft: StepModel | None = None, gamma: int = 4, variant: str = "",
         forecast: np.ndarray | None = None, depth: int | None = None, **_: object) -> DS2D:
    """make_policy("ds2d", target, forecast=...) (LAZY_POLICIES entry); default embeddings from the artifact."""
    return DS2D(target, draft, forecast, depth)
