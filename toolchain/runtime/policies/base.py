"""The policy interface: every decoding policy turns a prompt into a stream of token chunks.

A policy owns no cache of its own: it drives StepModels (target, and a draft if it has one),
whose KV caches are the runtime's one cache manager. After `generate` is exhausted, `stats`
(a RunStats, or a policy's subclass of it with its own figures) says what the tokens cost; it
is self-contained, so a bench keeps a copy per prompt and prices it again under another
device or DRAM budget (`phone_seconds`) without the policy.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from toolchain.runtime.model import StepModel
from toolchain.runtime.policies.sampling import Sampler


class Pricer(Protocol):
    """Predicted seconds of a model's recorded calls (toolchain/cost/prices.py)."""

    def seconds(self, key: str) -> float: ...

    def total(self, calls: Counter[str]) -> float: ...


# call keys (toolchain/runtime/tree_exec.py run_stages) of the later pieces of one target call
PIECE_KEYS = ("stage:", "tail:")


@dataclass
class RunStats:
    tokens: int = 0
    target_calls: Counter[str] = field(default_factory=Counter)  # decode-phase calls per family
    draft_calls: Counter[str] = field(default_factory=Counter)
    target_family_seconds: Counter[str] = field(default_factory=Counter)  # decode-phase seconds per family
    draft_family_seconds: Counter[str] = field(default_factory=Counter)
    accepted: list[int] = field(default_factory=list)  # drafts accepted per verify call
    prefill_calls: Counter[str] = field(default_factory=Counter)  # target, then draft, prompt calls
    prefill_seconds: float = 0.0

    @property
    def target_seconds(self) -> float:
        return sum(self.target_family_seconds.values())

    @property
    def draft_seconds(self) -> float:
        return sum(self.draft_family_seconds.values())

    @property
    def n_target_calls(self) -> int:
        """Target calls of the decode phase. A call run in pieces counts once: a verify's body and then
        its accepted rows' lm_head (`stage:` keys), a pruned verify's layers before the cut and then
        after it (`tail:` keys); each piece is still priced on its own (phone_seconds)."""
        return sum(n for key, n in self.target_calls.items() if not key.startswith(PIECE_KEYS))

    def phone_seconds(self, target: Pricer, draft: Pricer | None = None) -> float:
        """Predicted decode time: every recorded call priced, target and draft one after the other."""
        seconds = target.total(self.target_calls)
        if draft is not None and self.draft_calls:
            seconds += draft.total(self.draft_calls)
        return seconds


class Policy:
    name = "base"
    stats_type: ClassVar[type[RunStats]] = RunStats

    def __init__(self, target: StepModel, draft: StepModel | None = None):
        self.target = target
        self.draft = draft
        self.stats = self.stats_type()

    def generate(self, prompt: Sequence[int], max_new_tokens: int, sampler: Sampler) -> Iterator[list[int]]:
        raise NotImplementedError

    # ---- shared helpers ---------------------------------------------------------------------
    def _start(self, prompt: Sequence[int]) -> None:
        self.stats = self.stats_type()
        for m in self._models():
            m.reset()

    def _prefill(self, prompt: Sequence[int], sampler: Sampler) -> int:
        """Run the prompt through the target (then the draft, if any), move those calls out of the
        decode-phase counters, and pick the first new token from the target's logits."""
        logits = self.target.prefill(prompt)
        if self.draft is not None:
            self.draft.prefill(prompt)
        self._end_prefill()
        self.stats.tokens = 1
        return sampler.pick(logits)

    def _models(self) -> list[StepModel]:
        return [m for m in (self.target, self.draft) if m is not None]

    def _end_prefill(self) -> None:
        """Move the prompt's calls out of the decode-phase counters."""
        for m in self._models():
            self.stats.prefill_calls.update(m.calls)
            self.stats.prefill_seconds += sum(m.seconds.values())
            m.calls.clear()
            m.seconds.clear()

    def _finish(self) -> None:
        self.stats.target_calls = Counter(self.target.calls)
        self.stats.target_family_seconds = Counter(self.target.seconds)
        if self.draft is not None:
            self.stats.draft_calls = Counter(self.draft.calls)
            self.stats.draft_family_seconds = Counter(self.draft.seconds)

    def _ar_step(self, pending: int, n: int, sampler: Sampler) -> Generator[list[int], None, int | None]:
        """Out of context for a speculative round: one plain target step, like ar.

        `pending` is the newest token (the target has not seen it), `n` the tokens emitted so far.
        Yields the next token and returns it, or returns None when generation ends: no room even
        for a width-1 step, or the token ends the sequence. In a policy's `generate`:

            nxt = yield from self._ar_step(pending, n, sampler)
            if nxt is None:
                return
            pending, n = nxt, n + 1
        """
        if not self.target.room(1):
            return None
        token = sampler.pick(self.target.feed([pending]))
        self.stats.tokens = n + 1
        yield [token]
        return None if token in self.target.eos_ids else token

    def _clip(self, tokens: list[int], budget: int) -> tuple[list[int], bool]:
        """Cut at the budget and after an end-of-sequence token; (tokens, stop)."""
        out: list[int] = []
        for t in tokens[:budget]:
            out.append(t)
            if t in self.target.eos_ids:
                return out, True
        return out, len(out) >= budget
