"""ctg: concurrent token generation, K styles of one prompt decoded together in one call per step.

The K styles are K LoRA adapters (an artifact compiled with `lora_inputs` and slots >= the
number of distinct adapters; None = the base model). All styles share the prompt's KV cache:

  - the prompt minus its last token is prefilled once, without adapters (the shared prefix);
  - step 0 feeds the last prompt token K times, row k under adapter k (lora_rows selects
    row k's rank block), at the same position; each row sees the shared prefix and itself;
  - step t feeds each style's newest token, row k at position L-1+t; `past_allowed` lets row k
    see the shared prefix and only its own style's committed rows; all K rows are committed.

So a step is one call of the narrowest graph of width >= K, where K sequential runs would each
make one width-1 call. Style k's tokens equal a sequential run of adapter k that prefills the
prompt's shared prefix with the base model (`sequential_styles(..., shared_prefix=True)`); an
adapter that touches k_proj/v_proj would have given the prefix other K/V rows, which is the
price of sharing the cache. Sliding-window layers see slot indices, not positions, for the
committed style rows: exact while the window covers the whole context (Gemma 3 270M: 512).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from toolchain.errors import MobcError
from toolchain.runtime.adapters import Adapter, LoraSpec, write_rows, write_slots
from toolchain.runtime.model import StepModel
from toolchain.runtime.policies.base import Policy
from toolchain.runtime.policies.sampling import Sampler


def assign_slots(styles: Sequence[Adapter | None]) -> tuple[list[Adapter | None], list[int | None]]:
    """Distinct adapters -> slot list, and each style's slot (None for the base model)."""
    slots: list[Adapter | None] = []
    rows: list[int | None] = []
    for ad in styles:
        if ad is None:
            rows.append(None)
            continue
        idx = next((i for i, s in enumerate(slots) if s is ad), None)
        if idx is None:
            slots.append(ad)
            idx = len(slots) - 1
        rows.append(idx)
    return slots, rows


def bind_adapters(model: StepModel, slots: Sequence[Adapter | None], rows: int | Sequence[int | None] | None = 0,
                  families: Sequence[str] | None = None) -> LoraSpec:
    """Writes adapters into every (or the given) family's lora_* inputs; rows: slot per row (int = all rows)."""
    spec = LoraSpec.from_manifest(model.manifest)
    if len(slots) > spec.slots:
        raise MobcError(f"{len(slots)} distinct adapters in one call, but {model.name} was compiled with "
                        f"lora_inputs slots={spec.slots}; recompile with slots >= {len(slots)}")
    for ad in slots:
        if ad is not None and ad.rank > spec.max_rank:
            raise MobcError(f"adapter {ad.name} has rank {ad.rank} > max_rank {spec.max_rank} of {model.name}")
    for fam in families or list(model.widths):
        arrays = model.extra_inputs(fam)
        write_slots(arrays, list(slots), spec.max_rank)
        write_rows(arrays, rows if isinstance(rows, int | None) else list(rows), spec.max_rank)
    return spec


class CTG(Policy):
    name = "ctg"

    def __init__(self, target: StepModel, draft: StepModel | None = None,
                 styles: Sequence[Adapter | None] = ()):
        if not styles:
            raise MobcError("policy ctg needs styles: pass --adapter NAME once per style (K >= 2)")
        super().__init__(target, None)
        self.styles = list(styles)
        self.k = len(self.styles)
        self.family = target.family_for(self.k)
        self.slots, self.rows = assign_slots(self.styles)
        self.outputs: list[list[int]] = [[] for _ in range(self.k)]

    def generate(self, prompt: Sequence[int], max_new_tokens: int, sampler: Sampler) -> Iterator[list[int]]:
        """Yields one list of K tokens per step (token k belongs to style k); `outputs` collects
        each style's tokens cut after its end-of-sequence token."""
        if len(prompt) < 2:
            raise MobcError("ctg needs a prompt of at least 2 tokens (a shared prefix and a last token)")
        m, k = self.target, self.k
        self._start(prompt)
        self.outputs = [[] for _ in range(k)]
        bind_adapters(m, self.slots, None)  # the shared prefix runs on the base model, whatever width
        m.prefill(prompt[:-1])
        bind_adapters(m, self.slots, self.rows, [self.family])
        prefix = m.length
        self._end_prefill()
        tokens = [prompt[-1]] * k
        done = [False] * k
        try:
            for t in range(max_new_tokens):
                if m.cache.free(m.widths[self.family]) < k:
                    break
                length = m.length
                past = np.zeros((k, length), dtype=bool)
                past[:, :prefix] = True
                own = prefix + np.arange(t)[:, None] * k  # slot of style j's step s: prefix + s*k + j
                for j in range(k):
                    past[j, (own + j).ravel()] = True
                depths = [prefix + t - length] * k  # position prefix + t for every row
                logits = m.forward(tokens, np.eye(k, dtype=bool), depths, self.family, past)
                m.commit(range(k))
                tokens = [sampler.pick(logits[j]) for j in range(k)]
                for j, tok in enumerate(tokens):
                    if not done[j]:
                        self.outputs[j].append(tok)
                        done[j] = tok in m.eos_ids
                yield list(tokens)
                if all(done):
                    break
        finally:
            self.stats.tokens = sum(len(o) for o in self.outputs)
            self._finish()


def sequential_styles(model: StepModel, prompt: Sequence[int], styles: Sequence[Adapter | None],
                      max_new_tokens: int, sampler: Sampler, shared_prefix: bool = True) -> list[list[int]]:
    """K plain AR runs, one per style, through the width-1 graph (the CTG baseline).

    shared_prefix=True prefills prompt[:-1] without adapters, like CTG (same tokens, greedy);
    False runs each adapter over the whole prompt, as a single-adapter request would.
    """
    outs = []
    for ad in styles:
        slots = [ad] if ad is not None else []
        if shared_prefix:
            bind_adapters(model, slots, None)
            model.prefill(prompt[:-1])
            bind_adapters(model, slots, 0 if ad is not None else None, [model.decode_family])
            logits = model.feed([prompt[-1]])
        else:
            bind_adapters(model, slots, 0 if ad is not None else None)
            logits = model.prefill(prompt)
        out: list[int] = []
        for _ in range(max_new_tokens):
            tok = sampler.pick(logits)
            out.append(tok)
            if tok in model.eos_ids or not model.room(1):
                break
            logits = model.feed([tok])
        outs.append(out)
    return outs


def make(target: StepModel, draft: StepModel | None = None, gamma: int = 4, variant: str = "",
         styles: Sequence[Adapter | None] = (), **_: object) -> CTG:
    """make_policy("ctg", target, styles=[...]) (LAZY_POLICIES entry)."""
    return CTG(target, draft, styles)
