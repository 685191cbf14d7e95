"""The KV cache manager: one implementation of cache rows, masks and RoPE inputs for every policy.

It owns fixed-length K/V buffers in the step-graph layout (keys [Hkv,1,D,CL], values
[Hkv,1,CL,D]); committed tokens occupy slots [0, length). A call of a width-N graph sees the
first CL-N slots as its past and returns N new rows; `commit` scatters the rows of accepted
tokens into the next free slots and everything else is simply never written (discarded).
`truncate` rolls back committed tokens (a draft model that ran ahead of the target).

Two ways to feed a graph:
- `step_inputs` returns fresh arrays (verification keeps several cases alive at once);
- `buffers(width)` + `fill` keep one preallocated, contiguous set of inputs per width that
  an onnxruntime IO binding points at, so a decode step copies nothing but the new rows.
  The per-width past buffers are [.., CL-N] copies of the master buffers (a slice of the master
  would not be contiguous, so ORT would copy it per call). A commit marks the slots it wrote as
  stale in every width's copy and `fill` brings a width up to date just before its call, so AR
  decoding copies each new row once, not once per compiled width (SmolLM2 with four widths bound:
  commit 1.4-1.9 ms per token before).
Every layer's K (and V) buffer is a view into one stacked [layers, ...] array, the master's and each
width's, so a commit of rows that arrive stacked too (`StackedRows`, what a bound family returns)
and a width's refresh are one numpy copy each instead of one per layer (SmolLM2's 30 layers: ~0.7
of ~1.1 ms of Python per decoded token before).
The master holds only the slots a call can read, [0, context - the layout's width): the narrowest
width's past is the whole master, so its bound buffers are the master itself and an AR step writes
each new row once instead of twice (the keys' slot is a strided write across every layer, head and
dim: ~0.1 ms a copy with the caches cold after a decode call). A commit past the last readable slot
(the last token a full context takes) keeps its length but stores nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from toolchain.artifact.layout import MASK_MIN, StepLayout
from toolchain.errors import MobcError


class CacheFullError(MobcError):
    """The generation ran out of the compiled context length."""


class StackedRows(dict):
    """A call's outputs by name, whose `new_key_<i>` / `new_value_<i>` are views, in layer order, of
    the [layers, ...] arrays in `stacked["new_key"]` / `stacked["new_value"]`."""

    stacked: dict[str, np.ndarray]


def _as_slice(idx: np.ndarray) -> slice | np.ndarray:
    """Consecutive indices as a slice (a view, no gather), anything else as is."""
    if len(idx) and (np.diff(idx) == 1).all():
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


class KVCache:
    def __init__(self, layout: StepLayout, rope: dict[str, np.ndarray], context: int | None = None):
        self.layout = layout
        self.context = context or layout.context
        self.rope = rope
        n = layout.n_layers
        self.slots = max(0, self.context - layout.width)  # the slots any call of width >= layout.width reads
        self._keys = np.zeros((n, layout.n_kv, 1, layout.head_dim, self.slots), np.float32)
        self._values = np.zeros((n, layout.n_kv, 1, self.slots, layout.head_dim), np.float32)
        self.keys = list(self._keys)  # per-layer views [Hkv, 1, D, slots] of the stacked master
        self.values = list(self._values)
        self.length = 0  # committed tokens; token at slot s has position s
        self._bufs: dict[int, dict[str, np.ndarray]] = {}
        self._past: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # width -> its stacked past K, V
        self._stale: dict[int, tuple[int, int]] = {}  # width -> master slots [lo, hi) its copy lacks

    def reset(self) -> None:
        self.length = 0

    def truncate(self, length: int) -> None:
        """Forget committed tokens from `length` on (their rows are overwritten by later commits)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length

    def free(self, width: int) -> int:
        """How many more tokens a width-N call can still see as past."""
        return self.context - width - self.length

    # ---- graph inputs -------------------------------------------------------------------------
    def _check_room(self, width: int) -> None:
        if self.length > self.context - width:
            raise CacheFullError(
                f"cache holds {self.length} tokens; a width-{width} call needs at most "
                f"{self.context - width} (context {self.context}); use a shorter prompt or fewer new tokens"
            )

    def _stacked_past(self, width: int, share: bool = False) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """Contiguous copies of the master's first CL-N slots, stacked K and V, and per-layer views
        of them by input name; with `share`, the master itself when it is exactly that past."""
        self._check_room(width)
        past_len = self.context - width
        if past_len > self.slots:
            raise ValueError(f"a width-{width} call reads {past_len} past slots; this cache keeps {self.slots} "
                             f"(made for calls of width >= {self.context - self.slots})")
        if share and past_len == self.slots:
            keys, values = self._keys, self._values
        else:
            keys = self._keys[..., :past_len].copy()
            values = self._values[:, :, :, :past_len].copy()
        feeds = {}
        for i in range(self.layout.n_layers):
            feeds[f"past_key_{i}"], feeds[f"past_value_{i}"] = keys[i], values[i]
        return keys, values, feeds

    def past(self, width: int) -> dict[str, np.ndarray]:
        return self._stacked_past(width)[2]

    def positions(self, depths: Sequence[int]) -> np.ndarray:
        return self.length + np.asarray(depths, dtype=np.int64)

    def rope_inputs(self, positions: np.ndarray) -> dict[str, np.ndarray]:
        n = len(positions)
        feeds = {}
        for kind in self.layout.rope_kinds:
            sfx = StepLayout.suffix(kind)
            half = self.layout.head_dim // 2
            feeds[f"position_cos{sfx}"] = self.rope[f"cos{sfx}"][positions].reshape(1, 1, n, half)
            feeds[f"position_sin{sfx}"] = self.rope[f"sin{sfx}"][positions].reshape(1, 1, n, half)
        return feeds

    def masks(self, width: int, allowed_new: np.ndarray, positions: np.ndarray,
              past_allowed: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Additive masks [1,1,N,CL] per layer kind.

        allowed_new [N,N] bool says which new token may attend to which (causal, tree ancestors,
        bidirectional block); every query sees all committed slots, limited by the sliding window
        for sliding layers, unless past_allowed [N, length] bool says which committed slots each
        new token sees (several sequences sharing one prompt in one cache, as CTG does).
        """
        n, cl = width, self.context
        past_len = cl - n
        allowed = np.zeros((n, cl), dtype=bool)
        if past_allowed is None:
            allowed[:, : self.length] = True
        else:
            allowed[: len(past_allowed), : self.length] = past_allowed[:, : self.length]
            allowed[len(past_allowed):, : self.length] = True  # padding rows: as before
        allowed[:, past_len:] = allowed_new
        key_pos = np.full(cl, -(10**9), dtype=np.int64)
        key_pos[: self.length] = np.arange(self.length)
        key_pos[past_len:] = positions
        feeds = {}
        for kind in self.layout.kinds:
            ok = allowed
            if kind == "sliding" and self.layout.sliding_window:
                ok = allowed & ((positions[:, None] - key_pos[None, :]) < self.layout.sliding_window)
            mask = np.where(ok, 0.0, MASK_MIN).astype(np.float32)
            feeds[f"attention_mask{StepLayout.suffix(kind)}"] = mask.reshape(1, 1, n, cl)
        return feeds

    def _new_token_inputs(self, tokens: Sequence[int], width: int, allowed_new: np.ndarray | None,
                          depths: Sequence[int] | None, pad_token: int,
                          past_allowed: np.ndarray | None = None, first_row: int = 0) -> dict[str, np.ndarray]:
        """input_ids, masks and RoPE inputs of a call (everything but the past)."""
        k = len(tokens)
        if k == width == 1 and allowed_new is None and depths is None and past_allowed is None and not first_row:
            return self._one_token_inputs(tokens[0])
        if not 0 <= first_row <= width - k:
            raise ValueError(f"{k} tokens from row {first_row} do not fit a width-{width} graph")
        if past_allowed is not None and first_row:
            raise ValueError("past_allowed describes rows from 0: use first_row=0 with it")
        if allowed_new is None:
            allowed_new = np.tril(np.ones((k, k), dtype=bool))
        if depths is None:
            depths = range(k)
        rows = slice(first_row, first_row + k)
        full = np.eye(width, dtype=bool)  # padding rows see only themselves (and the past)
        full[rows, rows] = allowed_new
        positions = self.length + np.arange(width) - first_row  # padding rows: any valid position
        positions[rows] = self.positions(depths)
        positions = np.clip(positions, 0, self.context - 1)
        ids = np.full((1, width), pad_token, dtype=np.int32)
        ids[0, rows] = tokens
        feeds = {"input_ids": ids}
        feeds.update(self.masks(width, full, positions, past_allowed))
        feeds.update(self.rope_inputs(positions))
        return feeds

    def _one_token_inputs(self, token: int) -> dict[str, np.ndarray]:
        """What the general path computes for one token in a width-1 call (an AR decode step), built
        from slices instead of [N, CL] boolean algebra: ~0.3 ms less Python per decoded token."""
        cl, pos = self.context, min(self.length, self.context - 1)
        feeds = {"input_ids": np.array([[token]], dtype=np.int32)}
        for kind in self.layout.kinds:
            first = 0  # oldest committed slot the token sees: all of them, or the sliding window's
            if kind == "sliding" and self.layout.sliding_window:
                first = max(0, pos - self.layout.sliding_window + 1)
            mask = np.full((1, 1, 1, cl), MASK_MIN, dtype=np.float32)
            mask[..., first : self.length] = 0.0
            mask[..., cl - 1] = 0.0  # the token itself
            feeds[f"attention_mask{StepLayout.suffix(kind)}"] = mask
        feeds.update(self.rope_inputs(np.array([pos], dtype=np.int64)))
        return feeds

    def step_inputs(self, tokens: Sequence[int], width: int, allowed_new: np.ndarray | None = None,
                    depths: Sequence[int] | None = None, pad_token: int = 0,
                    past_allowed: np.ndarray | None = None, first_row: int = 0) -> dict[str, np.ndarray]:
        """All inputs of a width-N call for len(tokens) <= N new tokens (the rest is padding), as new arrays.

        Default structure is causal over the real tokens; padding rows see only themselves. The
        tokens occupy rows [first_row, first_row + len(tokens)).
        """
        self._check_room(width)
        feeds = self._new_token_inputs(tokens, width, allowed_new, depths, pad_token, past_allowed, first_row)
        feeds.update(self.past(width))
        return feeds

    def buffers(self, width: int) -> dict[str, np.ndarray]:
        """The preallocated inputs of width-N calls (stable arrays: bind them once)."""
        if width not in self._bufs:
            self._check_room(width)
            bufs = {k: np.zeros_like(v) for k, v in self._new_token_inputs([], width, None, None, 0).items()}
            # a copy of the master, refreshed here before every use (or the master itself for the
            # narrowest width); each layer a view of one array
            keys, values, past = self._stacked_past(width, share=True)
            bufs.update(past)
            self._past[width] = (keys, values)
            self._bufs[width] = bufs
        self._refresh(width)
        return self._bufs[width]

    def fill(self, tokens: Sequence[int], width: int, allowed_new: np.ndarray | None = None,
             depths: Sequence[int] | None = None, pad_token: int = 0,
             past_allowed: np.ndarray | None = None, first_row: int = 0) -> dict[str, np.ndarray]:
        """Writes a call's new-token inputs into `buffers(width)` in place and returns them."""
        self._check_room(width)
        bufs = self.buffers(width)
        new = self._new_token_inputs(tokens, width, allowed_new, depths, pad_token, past_allowed, first_row)
        for name, arr in new.items():
            bufs[name][...] = arr
        return bufs

    # ---- cache update -------------------------------------------------------------------------
    def commit(self, new_rows: dict[str, np.ndarray], accepted: Sequence[int]) -> None:
        """Scatter the new rows at indices `accepted` (in order) into the next free slots."""
        idx = np.asarray(accepted, dtype=np.int64)
        m = len(idx)
        if self.length + m > self.context:
            raise CacheFullError(f"committing {m} tokens overflows the context ({self.context})")
        lo, end = self.length, self.length + m
        hi = min(end, self.slots)  # a slot no call reads is not stored
        self.length = end
        if hi <= lo:
            return
        idx = idx[: hi - lo]
        rows = _as_slice(idx)
        stacked = getattr(new_rows, "stacked", None)
        if stacked is not None:  # every layer in one copy: [L, Hkv, 1, D, N] and [L, Hkv, 1, N, D]
            self._keys[..., lo:hi] = stacked["new_key"][..., rows]
            self._values[:, :, :, lo:hi] = stacked["new_value"][:, :, :, rows]
        else:
            for i in range(self.layout.n_layers):
                self.keys[i][..., lo:hi] = new_rows[f"new_key_{i}"][..., rows]
                self.values[i][:, :, lo:hi] = new_rows[f"new_value_{i}"][:, :, rows]
        self._sync_bound(lo, hi)

    def move_slots(self, src: Sequence[int], dst0: int) -> None:
        """Copy committed slots src[j] -> dst0 + j (destinations at or below their sources, in
        increasing order), in the master buffers and the bound per-width copies. `length` is
        unchanged: `truncate` afterwards to drop what lies past the moved rows."""
        for j, s in enumerate(src):
            d = dst0 + j
            if s == d:
                continue
            if s >= self.slots:
                raise ValueError(f"slot {s} was never stored (this cache keeps {self.slots}); keep room for scratch rows")
            for i in range(self.layout.n_layers):
                self.keys[i][..., d] = self.keys[i][..., s]
                self.values[i][:, :, d] = self.values[i][:, :, s]
        self._sync_bound(dst0, dst0 + len(src))

    def _sync_bound(self, lo: int, hi: int) -> None:
        """Mark master slots [lo, hi) stale in every per-width copy (copied by `_refresh` before its next call)."""
        for width in self._bufs:
            old = self._stale.get(width)
            self._stale[width] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))

    def _refresh(self, width: int) -> None:
        """Copy the stale master slots into width's past buffers (a width-N past holds only CL-N slots)."""
        stale = self._stale.pop(width, None)
        if stale is None or self._past[width][0] is self._keys:  # the master itself: nothing to copy
            return
        lo, top = stale[0], min(stale[1], self.context - width)
        if top > lo:
            keys, values = self._past[width]
            keys[..., lo:top] = self._keys[..., lo:top]
            values[:, :, :, lo:top] = self._values[:, :, :, lo:top]
