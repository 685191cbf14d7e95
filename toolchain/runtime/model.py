"""A compiled model ready to decode: its sessions, one KV cache, and bound graphs per width.

Policies talk to models only through this class: `prefill`, `forward` (up to N new tokens,
causal or with a tree/block mask), `commit` (keep some of the last call's rows) and
`truncate` (roll back). It counts calls and seconds per family, which the bench turns into
real and predicted (cost model) time.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from toolchain.artifact import integrity
from toolchain.artifact.chain import optional_zeros
from toolchain.errors import ArtifactError
from toolchain.runtime.cache import KVCache
from toolchain.runtime.sessions import ArtifactSessions, BoundFamily
from toolchain.runtime.tokenizer import Tokenizer

# prompts of at most this many tokens may run token by token through the decode graph (prefill)
SHORT_PROMPT_TOKENS = 8
# roles whose first stage is a full step graph (an lm_head or part stage never starts a family)
STEP_ROLES = ("decode", "prefill", "tree", "custom", "diffusion")


class StepModel:
    def __init__(self, folder: str | Path, provider: str = "cpu", threads: int | None = None,
                 provider_options: dict[str, str] | None = None, io_binding: bool = True,
                 share_weights: bool = False):
        self.folder = Path(folder)
        # sizes are checked now; weights not verified before are hashed while the sessions start
        # (toolchain/artifact/integrity.py) and the first call waits for that check
        with integrity.deferred_hashing() as pending:
            self.sessions = ArtifactSessions(folder, provider, threads, provider_options,
                                             share_weights=share_weights)
        self._integrity = pending
        self.manifest = self.sessions.manifest
        self.name: str = self.manifest.name
        self.widths: dict[str, int] = {}
        for fam in self.sessions.families():
            first = self.sessions.chain(fam)[0]
            if first.role in STEP_ROLES:
                self.widths[fam] = first.width
        if not self.widths:
            raise ArtifactError(f"{self.folder}: no decode/prefill/tree step graph in the manifest")
        contexts = {self.sessions.chain(f)[0].context for f in self.widths}
        if len(contexts) != 1:
            raise ArtifactError(
                f"{self.folder}: graphs have different context lengths {sorted(contexts)}; the runtime "
                "keeps one cache per model, so compile every graph with the same context"
            )
        self.context = contexts.pop()
        self.decode_family = min(self.widths, key=lambda f: (self.widths[f], f != "decode"))
        self.cache = KVCache(self.sessions.layout(self.decode_family), self.sessions.rope)
        self.io_binding = io_binding
        self._bound: dict[str, BoundFamily] = {}
        self._last: tuple[str, dict[str, np.ndarray], int] | None = None  # family, outputs, first row
        self._extra: dict[str, dict[str, np.ndarray]] = {}
        self.eos_ids: list[int] = list(self.manifest.model.eos_token_ids)
        self.vocab: int = self.manifest.model.vocab
        self.calls: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()
        self._tokenizer: Any = None
        # called as listener(outputs, rows, first_slot) after each commit (a draft head collects features)
        self.commit_listeners: list[Any] = []

    # ---- bookkeeping --------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            tok_dir = self.folder / "tokenizer"
            if not tok_dir.is_dir():
                raise ArtifactError(f"{self.folder} has no tokenizer/ folder; recompile it with mobc compile")
            self._tokenizer = Tokenizer(tok_dir)
        return self._tokenizer

    def open_ahead(self) -> None:
        """Starts opening the decode family's sessions in the background (every generation needs
        them), so that loading the tokenizer and tokenizing overlap the slowest part of a start."""
        self.sessions.open_ahead([stage.name for stage in self.sessions.chain(self.decode_family)])

    def reset(self, stats: bool = True) -> None:
        self.cache.reset()
        self._last = None
        if stats:
            self.calls.clear()
            self.seconds.clear()

    @property
    def length(self) -> int:
        return self.cache.length

    def family_for(self, n: int) -> str:
        """The narrowest step graph that takes n new tokens."""
        fits = [f for f, w in self.widths.items() if w >= n]
        if not fits:
            raise ArtifactError(
                f"{self.name}: no graph takes {n} new tokens (widths {sorted(self.widths.values())}); "
                f"add a graph of width >= {n} to the recipe (e.g. verify: {{width: {n}, context: {self.context}, "
                "role: tree}) and recompile"
            )
        return min(fits, key=lambda f: (self.widths[f], f))

    def room(self, n: int) -> bool:
        """Whether a call with n new tokens (and committing them) still fits the context."""
        return self.cache.free(self.widths[self.family_for(n)]) >= 0

    def extra_inputs(self, family: str) -> dict[str, np.ndarray]:
        """The family's optional inputs (lora_*, forecast_*: adapters, forecast embeddings) as
        preallocated arrays, zero (= the base model) until a caller writes them in place; bound
        once like the cache buffers, so they must never be replaced."""
        if family not in self._extra:
            arrays: dict[str, np.ndarray] = {}
            for stage in self.sessions.chain(family):
                for name in stage.input_names:
                    if name not in arrays and (zeros := optional_zeros(stage, name)) is not None:
                        arrays[name] = zeros
            self._extra[family] = arrays
        return self._extra[family]

    # ---- calls --------------------------------------------------------------------------------
    def call_inputs(self, tokens: Sequence[int], width: int, allowed_new: np.ndarray | None = None,
                    depths: Sequence[int] | None = None) -> dict[str, np.ndarray]:
        """A width-N call's inputs for callers that run stages themselves (tree verifiers): the
        preallocated per-width buffers, whose past is brought up to date by copying only the rows
        committed since (a fresh `step_inputs` copies every layer's whole past: ~3 ms per SmolLM2
        verify call). A new dict over those arrays: a caller may add inputs, never write into them."""
        if not self.io_binding:
            return self.cache.step_inputs(tokens, width, allowed_new, depths)
        return dict(self.cache.fill(tokens, width, allowed_new, depths))

    def forward(self, tokens: Sequence[int], allowed_new: np.ndarray | None = None,
                depths: Sequence[int] | None = None, family: str | None = None,
                past_allowed: np.ndarray | None = None, first_row: int = 0) -> np.ndarray:
        """One call with the new tokens (causal by default); returns their logits [k, V] (a copy).

        Nothing is committed: call `commit` with the indices of the tokens to keep.
        past_allowed [k, length] limits which committed slots each token sees (default: all).
        first_row: the graph row of the first token (the rows before it are padding).
        """
        family = family or self.family_for(len(tokens))
        width = self.widths[family]
        extra = self.extra_inputs(family)
        t = time.perf_counter()
        try:
            if self.io_binding:
                feeds = self.cache.fill(tokens, width, allowed_new, depths, past_allowed=past_allowed,
                                        first_row=first_row)
                if family not in self._bound:
                    self._bound[family] = self.sessions.bind(family, {**feeds, **extra})
                outs = self._bound[family].run()
            else:
                feeds = self.cache.step_inputs(tokens, width, allowed_new, depths, past_allowed=past_allowed,
                                               first_row=first_row)
                feeds.update(extra)
                outs = self.sessions.run_family(family, feeds)
        finally:
            while self._integrity:  # the first call: a damaged file wins over any result or error
                self._integrity.pop().wait()
        self.seconds[family] += time.perf_counter() - t
        self.calls[family] += 1
        self._last = (family, outs, first_row)
        return np.array(outs["logits"][0, first_row : first_row + len(tokens)], dtype=np.float32)

    def commit(self, accepted: Sequence[int]) -> None:
        """Keep the rows of the last call's tokens at these indices (in order)."""
        if self._last is None:
            raise RuntimeError("commit without a preceding forward call")
        _, outs, first_row = self._last
        self.commit_rows(outs, [first_row + i for i in accepted])

    def commit_rows(self, outs: dict[str, np.ndarray], rows: Sequence[int]) -> None:
        """Keep these rows of a call's outputs (run by this model, e.g. a tree verify's stages) and
        tell the listeners: every commit of the target goes through here, or a draft head reading
        the target's features would draft from stale ones."""
        slot = self.cache.length
        for listener in self.commit_listeners:  # before the length moves: a concurrent drafter (ahasd)
            listener(outs, list(rows), slot)  # that sees the new length must also see the rows' features
        self.cache.commit(outs, rows)

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)

    def feed(self, tokens: Sequence[int]) -> np.ndarray:
        """Runs and commits tokens causally in as few calls as possible; returns the last logits [V].

        Laid out as onnxruntime-genai lays out a prompt: windows of the widest graph, the first one
        holding the remainder in its last rows (left padding). A quantized graph's rounding depends
        on the order its attention sums run in, so the same layout is what makes a genai bundle of
        it generate mobc's tokens (toolchain/bundle)."""
        if not tokens:
            raise ValueError("feed needs at least one token")
        widest = max(self.widths.values())
        first = len(tokens) % widest or widest
        logits = None
        for start in [0, *range(first, len(tokens), widest)]:
            chunk = list(tokens[start : (start + widest if start else first)])
            width = self.widths[self.family_for(len(chunk))]
            logits = self.forward(chunk, first_row=width - len(chunk))
            self.commit(range(len(chunk)))
        return logits[-1]

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Reset the cache and feed the prompt; returns the last prompt token's logits.

        The sessions of the prompt's windows and of decoding open together first (the first
        generation of a process: its time to first token is mostly opening sessions)."""
        self.reset(stats=False)
        if self._token_by_token(ids):
            logits = None
            for token in ids:
                logits = self.forward([token])  # the narrowest graph: the decode family
                self.commit([0])
            return logits[-1]
        stages = [self.sessions.chain(f) for f in (*self._window_families(len(ids)), self.decode_family)]
        self.sessions.open_many([stage.name for chain in stages for stage in chain])
        return self.feed(ids)

    def _window_families(self, n: int) -> list[str]:
        """The families `feed` runs an n-token prompt's windows through (the remainder's, the widest)."""
        widest = max(self.widths.values())
        return sorted({self.family_for(n % widest or widest), self.family_for(min(n, widest))})

    def _token_by_token(self, ids: Sequence[int]) -> bool:
        """A short prompt runs through the decode graph, one token per call, when a wider graph is
        not open yet: opening one costs more than the calls (SmolLM2 int4: 0.6 s and a second copy
        of the weights, vs ~30 ms per token). Not for quantized graphs, whose rounding depends on the
        window layout that onnxruntime-genai bundles reproduce (see feed)."""
        if len(ids) > SHORT_PROMPT_TOKENS or self.widths[self.decode_family] != 1 or len(ids) < 2:
            return False
        if any(g.quantization for g in self.manifest.graphs):
            return False
        prompt_family = self.family_for(min(len(ids), max(self.widths.values())))
        return self.sessions.chain(prompt_family)[0].name not in self.sessions.open_names()
