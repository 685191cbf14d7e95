"""ar: plain autoregressive decoding through the target's narrowest graph (the baseline)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from toolchain.runtime.policies.base import Policy
from toolchain.runtime.policies.sampling import Sampler


class AR(Policy):
    name = "ar"

    def generate(self, prompt: Sequence[int], max_new_tokens: int, sampler: Sampler) -> Iterator[list[int]]:
        self._start(prompt)
        logits = self.target.prefill(prompt)
        self._end_prefill()
        n = 0
        try:
            while n < max_new_tokens:
                token = sampler.pick(logits)
                n += 1
                self.stats.tokens = n
                yield [token]
                if token in self.target.eos_ids or n >= max_new_tokens or not self.target.room(1):
                    break
                logits = self.target.feed([token])
        finally:
            self._finish()
