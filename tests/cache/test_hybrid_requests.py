"""Request helpers on hybrid caches: a request's own Mamba state (copy-on-write of the matched
one, checkpointed into the tree at page-aligned cache points) and its SWA floor (slots that slid
out of the window freed early, the tree told at insert)."""

from __future__ import annotations

import pytest
import torch

from asynccache.errors import PoolExhaustedError

BASE = {"host_tokens": 0, "page_size": 2, "device_tokens": 64, "mamba_state_shape": (3,)}


def used(cache) -> tuple[int, int, int]:
    hy = cache.hybrid
    swa = hy.swa_pool.allocator.used_size if hy.swa_pool is not None else 0
    mamba = hy.mamba_pool.used_size if hy.mamba_pool is not None else 0
    return cache.device_pool.allocator.used_size, swa, mamba


async def _compute(cache, model, req, tokens, n):
    lo = req.computed
    new = await cache.extend(req, n)
    cache.write_kv(new, model.expected(tokens, lo, lo + n))


async def test_mamba_state_follows_the_request(make_cache, kit):
    cache = await make_cache(**BASE, mamba_states=4)
    model = kit.KVModel.of(cache)
    states = cache.hybrid.mamba_pool.states
    a = list(range(12))
    ra = cache.admit(a)
    assert ra.prefix_len == 0 and ra.mamba_state is not None  # a fresh state
    await _compute(cache, model, ra, a, 12)
    states[ra.mamba_state] = torch.tensor([1.0, 2.0, 3.0])
    tree_state = ra.mamba_state
    cache.cache_finished_req(ra)  # 12 tokens, page-aligned: the tree adopts the state
    assert ra.mamba_state is None and used(cache) == (12, 0, 1)
    cache.sanity_check()
    b = [*a, 50, 51, 52]
    rb = cache.admit(b)
    assert rb.prefix_len == 12 and rb.mamba_state not in (None, tree_state)
    assert torch.equal(states[rb.mamba_state], torch.tensor([1.0, 2.0, 3.0]))  # copy-on-write
    model.check(cache, b, rb.slots, "matched prefix")
    await _compute(cache, model, rb, b, 3)
    cache.cache_finished_req(rb)  # 15 computed: 14 cached, no state at 14 -> its state is freed
    assert used(cache) == (14, 0, 1)
    assert cache.match_prefix(b).device_prefix_len == 12  # a match ends only at a state
    assert cache.match_prefix(b).full_kv_hit_length == 14
    cache.sanity_check()


async def test_chunk_checkpoints_a_copy_of_the_state(make_cache, kit):
    cache = await make_cache(**BASE, mamba_states=4, sliding_window=4)
    model = kit.KVModel.of(cache)
    t = list(range(100, 116))
    r = cache.admit(t)
    await _compute(cache, model, r, t, 8)
    own = r.mamba_state
    cache.cache_unfinished_req(r)  # aligned: a checkpoint copy goes to the tree
    assert r.mamba_state == own and r.prefix_len == 8
    assert used(cache) == (8, 8, 2)
    model.check(cache, t, r.slots, "slots after cache_unfinished_req")
    m = cache.match_prefix(t)
    assert m.device_prefix_len == 8
    cache.sanity_check()
    await _compute(cache, model, r, t, 8)
    cache.cache_finished_req(r)
    assert used(cache) == (16, 16, 2)
    assert cache.match_prefix(t).device_prefix_len == 16
    cache.sanity_check()


async def test_swa_window_released_early(make_cache, kit):
    cache = await make_cache(**BASE, sliding_window=4)
    model = kit.KVModel.of(cache)
    t = list(range(200, 220))
    r = cache.admit(t)
    await _compute(cache, model, r, t, 10)
    assert cache.release_swa_window(r) == 4  # keeps window 4 + one page of cushion
    assert r.swa_evicted == 4 and used(cache) == (10, 6, 0)
    assert cache.release_swa_window(r) == 0
    cache.sanity_check()
    cache.cache_unfinished_req(r)  # the tree learns the floor: [0, 4) are SWA tombstones
    assert used(cache) == (10, 6, 0)
    assert cache.match_prefix(t[:10]).device_prefix_len == 10  # the last window is live
    assert cache.match_prefix(t[:6]).device_prefix_len == 0  # only 2 live tokens before 6
    await _compute(cache, model, r, t, 10)
    # Computed 20: own tokens [10, 14) slid out (the tree already holds [0, 10)).
    assert cache.release_swa_window(r) == 4 and r.swa_evicted == 14
    cache.cache_finished_req(r)
    assert used(cache) == (20, 6 + 6, 0)  # SWA kept: [4, 10) of the tree and [14, 20)
    cache.sanity_check()
    assert cache.match_prefix(t).device_prefix_len == 20
    model.check(cache, t, cache.match_prefix(t).device_indices)


async def test_no_state_left_is_a_clear_error(make_cache, kit):
    cache = await make_cache(**BASE, mamba_states=1)
    first = cache.admit([1, 2, 3, 4])
    locks = cache.tree.held_locks
    with pytest.raises(PoolExhaustedError, match="no Mamba state slot"):
        cache.admit([5, 6, 7, 8])
    assert cache.tree.held_locks == locks
    cache.abort_req(first)
    assert used(cache) == (0, 0, 0)
    cache.sanity_check()


async def test_chunked_prefill_frees_out_of_window_swa_by_itself(make_cache, kit):
    cache = await make_cache(**BASE, sliding_window=4, swa_free_out_of_window=True)
    model = kit.KVModel.of(cache)
    t = list(range(300, 330))
    r = cache.admit(t)
    for lo in (0, 10, 20):  # three chunks of 10, cached after each
        await _compute(cache, model, r, t, 10)
        if lo < 20:
            cache.cache_unfinished_req(r)
            cache.sanity_check()
    # After chunk 1: floor 4 (own [0, 4) freed). After chunk 2: own [10, 14) freed, floor 14.
    assert r.swa_evicted == 14
    assert used(cache) == (30, 30 - 4 - 4, 0)
    cache.cache_finished_req(r)
    cache.sanity_check()
    m = cache.match_prefix(t)
    assert m.device_prefix_len == 30
    model.check(cache, t, m.device_indices)


async def test_a_failed_finishing_insert_keeps_the_mamba_state_the_requests(make_cache, kit,
                                                                          monkeypatch):
    # cache_finished_req hands the request's Mamba state to the insert; when the insert
    # raises, the state is still the request's, and aborting the request frees it.
    cache = await make_cache(**BASE, mamba_states=2)
    model = kit.KVModel.of(cache)
    t = list(range(300, 308))
    r = cache.admit(t)
    await _compute(cache, model, r, t, 8)
    state = r.mamba_state
    flow = cache._requests

    def broken(req, **extra):
        raise RuntimeError("insert failed")

    monkeypatch.setattr(flow, "_insert", broken)
    with pytest.raises(RuntimeError, match="insert failed"):
        cache.cache_finished_req(r)
    monkeypatch.undo()
    assert r.mamba_state == state and not r.finished
    cache.abort_req(r)
    assert used(cache) == (0, 0, 0)
    cache.sanity_check()
