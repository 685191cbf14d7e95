"""The KV cache manager against a plain-torch reference: scatter, discard, rollback, masks, RoPE."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from toolchain.artifact.layout import MASK_MIN, StepLayout
from toolchain.runtime.cache import CacheFullError, KVCache, StackedRows

CL, D, HKV, LAYERS = 16, 4, 2, 2


def layout(kinds=("full", "full"), window=None) -> StepLayout:
    return StepLayout(width=1, context=CL, n_layers=LAYERS, n_heads=4, n_kv=HKV, head_dim=D, hidden=16,
                      vocab=32, layer_kinds=tuple(kinds), rope_per_kind=False, sliding_window=window)


def rope() -> dict[str, np.ndarray]:
    t = np.arange(CL * D // 2, dtype=np.float32).reshape(CL, D // 2)
    return {"cos": np.cos(t), "sin": np.sin(t)}


def rows(n: int, seed: int) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    out = {}
    for i in range(LAYERS):
        out[f"new_key_{i}"] = g.standard_normal((HKV, 1, D, n)).astype(np.float32)
        out[f"new_value_{i}"] = g.standard_normal((HKV, 1, n, D)).astype(np.float32)
    return out


def test_commit_scatter_discard_truncate_match_torch_reference():
    cache = KVCache(layout(), rope())
    cache.buffers(1)  # bound buffers of two widths must follow every commit
    cache.buffers(4)
    ref_k = [torch.zeros(HKV, 1, D, 0) for _ in range(LAYERS)]  # reference: a growing list of kept rows
    ref_v = [torch.zeros(HKV, 1, 0, D) for _ in range(LAYERS)]
    plan = [(4, [0, 1, 2, 3]), (4, [0, 2]), (3, []), (4, [3, 1, 0])]
    for step, (n, keep) in enumerate(plan):
        new = rows(n, step)
        cache.commit(new, keep)
        for i in range(LAYERS):
            k, v = torch.from_numpy(new[f"new_key_{i}"]), torch.from_numpy(new[f"new_value_{i}"])
            ref_k[i] = torch.cat([ref_k[i], k[..., keep]], dim=3)
            ref_v[i] = torch.cat([ref_v[i], v[:, :, keep]], dim=2)
    assert cache.length == 9
    for i in range(LAYERS):
        np.testing.assert_array_equal(cache.keys[i][..., :9], ref_k[i].numpy())
        np.testing.assert_array_equal(cache.values[i][:, :, :9], ref_v[i].numpy())
        for w in (1, 4):
            np.testing.assert_array_equal(cache.buffers(w)[f"past_key_{i}"][..., :9], ref_k[i].numpy())
            np.testing.assert_array_equal(cache.buffers(w)[f"past_value_{i}"][:, :, :9], ref_v[i].numpy())
    # rollback: the rows after the new length are replaced by the next commit
    cache.truncate(5)
    new = rows(2, 99)
    cache.commit(new, [1])
    np.testing.assert_array_equal(cache.keys[0][..., 5], new["new_key_0"][..., 1])
    np.testing.assert_array_equal(cache.buffers(4)["past_value_1"][:, :, 5], new["new_value_1"][:, :, 1])
    assert cache.length == 6
    # the in-place inputs equal the freshly built ones
    fresh = cache.step_inputs([5, 6], 4)
    bound = cache.fill([5, 6], 4)
    for name, arr in fresh.items():
        np.testing.assert_array_equal(bound[name], arr, err_msg=name)


def torch_mask(length: int, width: int, allowed_new: torch.Tensor, positions: torch.Tensor,
               window: int | None = None) -> torch.Tensor:
    """Reference additive mask: past slots 0..length-1 visible, new block as given, window by position."""
    key_pos = torch.full((CL,), -(10**9), dtype=torch.long)
    key_pos[:length] = torch.arange(length)
    key_pos[CL - width :] = positions
    ok = torch.zeros(width, CL, dtype=torch.bool)
    ok[:, :length] = True
    ok[:, CL - width :] = allowed_new
    if window:
        ok &= (positions[:, None] - key_pos[None, :]) < window
    return torch.where(ok, 0.0, MASK_MIN).reshape(1, 1, width, CL)


@pytest.mark.parametrize("structure", ["causal", "tree", "bidirectional"])
def test_masks_and_rope_match_reference(structure):
    cache = KVCache(layout(("full", "sliding"), window=6), rope())
    cache.commit(rows(4, 0), [0, 1, 2, 3])
    cache.commit(rows(4, 1), [0, 1, 2])  # 7 committed
    width, k = 4, 4
    if structure == "causal":
        allowed, depths = torch.tril(torch.ones(k, k, dtype=torch.bool)), [0, 1, 2, 3]
    elif structure == "tree":  # root -> (a, b), a -> c
        parent = [-1, 0, 0, 1]
        allowed = torch.eye(k, dtype=torch.bool)
        for j in range(k):
            p = parent[j]
            while p >= 0:
                allowed[j, p] = True
                p = parent[p]
        depths = [0, 1, 1, 2]
    else:
        allowed, depths = torch.ones(k, k, dtype=torch.bool), [0, 1, 2, 3]
    feeds = cache.step_inputs([3, 4, 5, 6], width, allowed_new=allowed.numpy(), depths=depths)
    positions = 7 + torch.tensor(depths)
    np.testing.assert_array_equal(feeds["attention_mask"], torch_mask(7, width, allowed, positions).numpy())
    np.testing.assert_array_equal(feeds["attention_mask_sliding"],
                                  torch_mask(7, width, allowed, positions, window=6).numpy())
    np.testing.assert_array_equal(feeds["position_cos"][0, 0], rope()["cos"][positions.numpy()])
    np.testing.assert_array_equal(feeds["past_key_1"], cache.keys[1][..., : CL - width])


def test_padding_rows_and_overflow():
    cache = KVCache(layout(), rope())
    feeds = cache.step_inputs([7], 4)  # 1 real token, 3 padding rows
    m = feeds["attention_mask"][0, 0]
    assert (m[:, CL - 4 :] == np.where(np.eye(4, dtype=bool), 0.0, MASK_MIN)).all()
    assert feeds["input_ids"].tolist() == [[7, 0, 0, 0]]
    cache.commit(rows(4, 0), [0, 1, 2, 3])
    cache.commit(rows(4, 1), [0, 1, 2, 3])
    cache.commit(rows(4, 2), [0, 1, 2, 3])
    with pytest.raises(CacheFullError):
        cache.step_inputs([1], 8)
    cache.step_inputs([1], 4)  # 12 past slots: exactly fits


def test_move_slots_moves_rows_down_in_master_and_bound_buffers():
    cache = KVCache(layout(), rope())
    cache.buffers(1)
    cache.buffers(4)  # its past holds CL-4 = 12 slots: a move past slot 12 updates only what it holds
    cache.commit(rows(14, 0), range(14))
    before_k = [k.copy() for k in cache.keys]
    before_v = [v.copy() for v in cache.values]
    src = [4, 7, 8, 13]  # kept rows, moved down to slots 3..6
    cache.move_slots(src, 3)
    assert cache.length == 14  # moving keeps the length; the caller truncates
    for i in range(LAYERS):
        np.testing.assert_array_equal(cache.keys[i][..., 3:7], before_k[i][..., src])
        np.testing.assert_array_equal(cache.values[i][:, :, 3:7], before_v[i][:, :, src])
        np.testing.assert_array_equal(cache.keys[i][..., :3], before_k[i][..., :3])
        for w in (1, 4):
            past = CL - w
            np.testing.assert_array_equal(cache.buffers(w)[f"past_key_{i}"], cache.keys[i][..., :past])
            np.testing.assert_array_equal(cache.buffers(w)[f"past_value_{i}"], cache.values[i][:, :, :past])


def test_a_commit_copies_rows_only_into_the_width_that_runs_next():
    """AR decoding after a wide prefill: committed rows reach the decode width's past at its next
    fill, and the idle wide width is brought up to date only when it runs again."""
    cache = KVCache(layout(), rope())
    wide_past = cache.buffers(4)["past_key_0"]
    cache.buffers(1)
    for t in range(3):
        cache.commit(rows(1, t), [0])
    assert not wide_past[..., :3].any()  # idle width: not copied on every commit
    cache.fill([5], 1)
    np.testing.assert_array_equal(cache.buffers(1)["past_key_0"][..., :3], cache.keys[0][..., :3])
    cache.fill([5, 6], 4)
    np.testing.assert_array_equal(wide_past[..., :3], cache.keys[0][..., :3])


def _stacked(new: dict[str, np.ndarray]) -> StackedRows:
    """The same rows as a bound family returns them: views of one [layers, ...] array per kind."""
    out = StackedRows()
    out.stacked = {kind: np.stack([new[f"{kind}_{i}"] for i in range(LAYERS)]) for kind in ("new_key", "new_value")}
    for kind, arr in out.stacked.items():
        for i in range(LAYERS):
            out[f"{kind}_{i}"] = arr[i]
    return out


@pytest.mark.parametrize("keep", [[0, 1, 2, 3], [2], [3, 1, 0], []])
def test_stacked_rows_commit_as_the_per_layer_ones(keep):
    """A commit of stacked rows (one copy for every layer) writes what per-layer copies write, into
    the master and into a bound width's past, for consecutive, single, reordered and no rows."""
    per_layer, stacked = KVCache(layout(), rope()), KVCache(layout(), rope())
    for cache in (per_layer, stacked):
        cache.buffers(1)
        cache.commit(rows(4, 0), [0, 1])
    new = rows(4, 1)
    per_layer.commit(new, keep)
    stacked.commit(_stacked(new), keep)
    for i in range(LAYERS):
        np.testing.assert_array_equal(stacked.keys[i], per_layer.keys[i])
        np.testing.assert_array_equal(stacked.values[i], per_layer.values[i])
        np.testing.assert_array_equal(stacked.buffers(1)[f"past_value_{i}"], per_layer.buffers(1)[f"past_value_{i}"])
    assert stacked.keys[1][..., 2 : 2 + len(keep)].any() or not keep


@pytest.mark.parametrize("kinds,window", [(("full", "full"), None), (("full", "sliding"), 6)])
def test_one_token_fast_path_equals_the_general_inputs(kinds, window):
    """An AR decode step's inputs (one token, width 1) built by slices equal the general path's
    (forced here with explicit depths) at every cache length, sliding windows included."""
    cache = KVCache(layout(kinds, window), rope())
    for length in range(CL):
        cache.length = length
        fast = cache._new_token_inputs([5], 1, None, None, 0)
        general = cache._new_token_inputs([5], 1, None, [0], 0)
        assert fast.keys() == general.keys()
        for name in general:
            np.testing.assert_array_equal(fast[name], general[name], err_msg=f"{name} at length {length}")
            assert fast[name].dtype == general[name].dtype and fast[name].shape == general[name].shape


def test_the_narrowest_widths_bound_past_is_the_master_and_step_inputs_stay_copies():
    """Width 1 reads every slot the cache keeps: its bound buffers are the master (a commit writes
    each row once), while step_inputs still hands out arrays no later commit changes."""
    cache = KVCache(layout(), rope())
    assert cache.slots == CL - 1
    bound = cache.buffers(1)
    assert all(np.shares_memory(bound[f"past_key_{i}"], cache.keys[i]) for i in range(LAYERS))
    assert not np.shares_memory(cache.buffers(4)["past_key_0"], cache.keys[0])
    fresh = cache.step_inputs([5], 1)
    assert not any(np.shares_memory(fresh[f"past_{kind}_{i}"], cache.keys[i]) or
                   np.shares_memory(fresh[f"past_{kind}_{i}"], cache.values[i])
                   for kind in ("key", "value") for i in range(LAYERS))
    new = rows(1, seed=3)
    cache.commit(new, [0])
    np.testing.assert_array_equal(bound["past_key_1"][..., 0], new["new_key_1"][..., 0])
    np.testing.assert_array_equal(cache.fill([6], 1)["past_value_0"][:, :, 0], new["new_value_0"][:, :, 0])
    assert not fresh["past_key_1"].any()  # taken before the commit, unchanged by it


def test_a_commit_past_the_last_readable_slot_counts_but_stores_nothing():
    cache = KVCache(layout(), rope())
    cache.commit(rows(CL - 1, seed=4), range(CL - 1))
    last = rows(1, seed=5)
    cache.commit(last, [0])  # slot CL - 1: no call reads it (a width-1 call needs length <= CL - 1)
    assert cache.length == CL and cache.free(1) < 0
    with pytest.raises(CacheFullError):
        cache.step_inputs([1], 1)
    cache.truncate(CL - 2)
    cache.commit(last, [0])  # slot CL - 2 is kept
    np.testing.assert_array_equal(cache.keys[0][..., CL - 2], last["new_key_0"][..., 0])


def test_a_call_narrower_than_the_cache_was_made_for_is_refused():
    wide = dataclasses.replace(layout(), width=4)
    cache = KVCache(wide, rope())
    with pytest.raises(ValueError, match="keeps 12"):
        cache.step_inputs([1], 1)
