"""Slots and requests are checked for ownership before anything changes (issue 23 item 3):
inserting or freeing slots the caller does not hold is an InvalidInputError naming the slot,
and the tree, the pools and the accounting are exactly as before; a request belongs to the cache
that admitted it. Also the argument errors of item 6."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from asynccache.errors import ClosedError, InvalidInputError

PS = 4


def _state(cache) -> tuple:
    return (cache.tree.node_count, cache.tree.device_size, cache.device_pool.allocator.used_size,
            cache.outstanding_device_tokens)


async def _cached(cache, tokens: list[int]) -> np.ndarray:
    req = cache.admit(tokens)
    slots = await cache.extend(req, len(tokens))
    cache.cache_finished_req(req)
    return slots


async def test_insert_of_slots_never_allocated_is_rejected(make_cache) -> None:
    cache = await make_cache()
    before = _state(cache)
    with pytest.raises(InvalidInputError, match=r"slot 0 .*not held by the caller"):
        cache.insert(list(range(8)), np.arange(8))  # valid slots, but never handed out
    assert _state(cache) == before
    cache.sanity_check()
    # The next request gets those slots and its KV is its own.
    req = cache.admit(list(range(100, 108)))
    got = await cache.extend(req, 8)
    assert got.tolist() == list(range(8))
    cache.cache_finished_req(req)
    assert cache.match_prefix(list(range(8))).device_prefix_len == 0
    cache.sanity_check()


@pytest.mark.parametrize(("slots", "needle"), [
    (np.arange(1000, 1008), "out of range"),
    (np.array([1, 2, 3, 4, 5, 6, 7, 8]), "whole pages"),
    (np.array([0, 1, 2, 3, 0, 1, 2, 3]), "twice"),
])
async def test_insert_of_bad_slots_is_rejected_before_the_tree_changes(make_cache, slots,
                                                                      needle) -> None:
    cache = await make_cache()
    held = await cache.alloc_device(8)
    assert held.tolist() == list(range(8))
    before = _state(cache)
    with pytest.raises(InvalidInputError, match=needle):
        cache.insert(list(range(8)), slots)
    assert _state(cache) == before
    assert cache.tree.pending_ops == 0
    cache.free_device(held)
    cache.sanity_check()


async def test_free_device_of_tree_slots_is_rejected(make_cache) -> None:
    cache = await make_cache()
    tree_slots = await _cached(cache, list(range(8)))
    before = _state(cache)
    with pytest.raises(InvalidInputError, match=rf"slot {int(tree_slots[0])} .*not held"):
        cache.free_device(tree_slots)
    assert _state(cache) == before
    assert cache.match_prefix(list(range(8))).device_prefix_len == 8
    cache.sanity_check()


async def test_double_free_device_is_rejected(make_cache) -> None:
    cache = await make_cache()
    slots = await cache.alloc_device(4)
    cache.free_device(slots)
    with pytest.raises(InvalidInputError, match="not held"):
        cache.free_device(slots)
    cache.sanity_check()


async def test_insert_of_tree_slots_past_prev_prefix_is_rejected(make_cache) -> None:
    cache = await make_cache()
    tree_slots = await _cached(cache, list(range(8)))
    with pytest.raises(InvalidInputError, match="not held"):
        cache.insert(list(range(50, 58)), tree_slots)
    cache.sanity_check()


async def test_a_request_belongs_to_its_cache(make_cache) -> None:
    a = await make_cache()
    b = await make_cache()
    await _cached(a, list(range(8)))
    req = a.admit(list(range(12)))
    before_a, before_b = _state(a), _state(b)
    for call in (lambda: b.cache_finished_req(req), lambda: b.abort_req(req),
                 lambda: b.cache_unfinished_req(req)):
        with pytest.raises(InvalidInputError, match=f"request {req.rid} .*another cache"):
            call()
    with pytest.raises(InvalidInputError, match="another cache"):
        await b.extend(req, 4)
    with pytest.raises(InvalidInputError, match="another cache"):
        await b.load_back_request(req)
    assert (_state(a), _state(b)) == (before_a, before_b)
    a.abort_req(req)
    a.sanity_check()
    b.sanity_check()


@pytest.mark.parametrize(("n", "needle"), [
    (1.5, "1.5"), ("8", "'8'"), (True, "True"), (-1, "-1"), (None, "None"),
])
async def test_extend_rejects_bad_counts_by_name(make_cache, n, needle) -> None:
    cache = await make_cache()
    req = cache.admit(list(range(8)))
    with pytest.raises(InvalidInputError, match=rf"num_tokens must be .*{needle}"):
        await cache.extend(req, n)
    cache.abort_req(req)


async def test_request_helpers_reject_a_non_request(make_cache) -> None:
    cache = await make_cache()
    for call in (cache.cache_finished_req, cache.cache_unfinished_req, cache.abort_req):
        with pytest.raises(InvalidInputError, match=r"CacheRequest.*None"):
            call(None)


async def test_read_kv_out_of_range_names_the_slot(make_cache) -> None:
    cache = await make_cache()
    with pytest.raises(InvalidInputError, match="100000"):
        cache.read_kv([100000])
    with pytest.raises(InvalidInputError, match="-1"):
        cache.read_kv([-1])


async def test_admit_a_meta_tensor_is_a_clear_error(make_cache) -> None:
    cache = await make_cache()
    with pytest.raises(InvalidInputError, match="meta"):
        cache.admit(torch.empty(8, dtype=torch.int64, device="meta"))


async def test_extend_after_close_is_refused(cache_factory, kit) -> None:
    async with cache_factory(kit.config, kit.quiesce_and_check, kit.close_and_check) as make:
        cache = await make()
        req = cache.admit(list(range(6)))
        await cache.extend(req, 5)  # a spare slot is left in the page
        await cache.aclose()
        with pytest.raises(ClosedError):
            await cache.extend(req, 1)


def _host_state(cache) -> tuple:
    return (cache.tree.host_size, cache.host_pool.allocator.used_size, cache.host_in_flight)


async def test_free_host_of_the_trees_host_copy_is_rejected(make_cache, kit) -> None:
    # free_host takes back only what take_host handed out: the host slots of a cached
    # prefix's host copy are the tree's. Accepting them let the next backup reuse the page
    # and a later load-back serve another prompt's KV.
    cache = await make_cache(write_policy="write_through")
    model = kit.KVModel.of(cache)
    a = list(range(1000, 1032))
    await kit.serve(cache, model, a)
    await cache.flush()
    assert _host_state(cache) == (32, 32, 0)
    tree_host = np.flatnonzero(cache.host_pool.allocator.is_allocated(np.arange(256)))[:4]
    with pytest.raises(InvalidInputError, match=rf"slot {int(tree_host[0])} .*not held by an "
                                                r"operation.*take_host"):
        cache.free_host(tree_host)
    assert _host_state(cache) == (32, 32, 0)
    cache.sanity_check()
    await kit.serve(cache, model, list(range(2000, 2032)))  # its backup takes fresh host pages
    await cache.flush()
    cache.evict(64)
    assert cache.match_prefix(a).device_prefix_len == 0
    req = await kit.serve(cache, model, a)  # loaded back from host: a's own KV
    assert req.prefix_len == 32
    cache.sanity_check()


async def test_free_host_twice_is_rejected(make_cache) -> None:
    cache = await make_cache()
    slots = cache.take_host(8)
    assert slots is not None and cache.host_in_flight == 8
    cache.free_host(slots[:4])
    with pytest.raises(InvalidInputError, match=rf"slot {int(slots[0])} .*not held by an operation"):
        cache.free_host(slots)
    assert cache.host_in_flight == 4  # nothing freed by the refused call
    cache.free_host(slots[4:])
    assert (cache.host_in_flight, cache.host_pool.allocator.used_size) == (0, 0)
    cache.sanity_check()


async def test_admit_of_bad_tokens_opens_no_session(make_cache) -> None:
    cache = await make_cache(enable_sessions=True)
    with pytest.raises(InvalidInputError, match="-2"):
        cache.admit([1, -2, 3, 4], session_id="tenant-x")
    with pytest.raises(InvalidInputError, match="session"):
        cache.admit([1, 2, 3, 4], session_id="")
    assert cache.sessions.open_sessions == 0
    req = cache.admit([1, 2, 3, 4], session_id="tenant-x")
    assert cache.sessions.open_sessions == 1
    cache.abort_req(req)
    cache.sanity_check()


@pytest.mark.parametrize("value", ["3", None, -1, 2.5, True])
async def test_token_counts_are_checked_by_name_before_anything_changes(make_cache, kit,
                                                                        value) -> None:
    cache = await make_cache(write_policy="write_through")
    model = kit.KVModel.of(cache)
    await kit.serve(cache, model, list(range(500, 516)))
    await cache.flush()
    before = (_state(cache), _host_state(cache))
    calls = {"alloc_device": lambda: cache.alloc_device(value),
             "try_alloc_device": lambda: cache.try_alloc_device(value),
             "take_host": lambda: cache.take_host(value),
             "evict_async": lambda: cache.evict_async(value)}
    for name, call in calls.items():
        with pytest.raises(InvalidInputError, match=rf"num_tokens must be .*{value!r}"):
            got = call()
            if asyncio.iscoroutine(got):
                await got
        assert (_state(cache), _host_state(cache)) == before, name
    cache.sanity_check()


@pytest.mark.parametrize("quota", ["x", -5, 2.5])
async def test_mem_quota_is_checked_by_name(make_cache, kit, quota) -> None:
    cache = await make_cache(write_policy="write_through")
    model = kit.KVModel.of(cache)
    tokens = list(range(500, 516))
    await kit.serve(cache, model, tokens)
    await cache.flush()
    cache.evict(64)
    req = cache.admit(tokens)
    assert req.host_hit_length == 16
    with pytest.raises(InvalidInputError, match=rf"mem_quota must be .*{quota!r}"):
        await cache.load_back_request(req, mem_quota=quota)
    with pytest.raises(InvalidInputError, match=rf"mem_quota must be .*{quota!r}"):
        cache.begin_load_back(req.match(), mem_quota=quota)
    assert await cache.load_back_request(req, mem_quota=None) == 16
    cache.abort_req(req)
    cache.sanity_check()


async def test_release_load_of_a_non_load_back_is_a_clear_error(make_cache) -> None:
    cache = await make_cache()
    with pytest.raises(InvalidInputError, match="release_load needs a LoadBack, got None"):
        cache.release_load(None)


async def test_free_device_of_a_requests_slots_is_rejected(make_cache, kit) -> None:
    # extend's slots are the request's until abort_req / cache_finished_req. free_device took
    # them back before: the request could then never be released (its own release refused
    # the freed slots), and if another request was handed the same slots, finishing the first
    # one inserted them under its tokens (wrong KV).
    cache = await make_cache()
    model = kit.KVModel.of(cache)
    first = list(range(300, 316))
    tokens = [*first, *range(400, 416)]
    await kit.serve(cache, model, first)
    req = cache.admit(tokens)
    new = await cache.extend(req, 16)
    before = _state(cache)
    with pytest.raises(InvalidInputError, match=rf"slot {int(new[0])} .*belongs to a request.*"
                                                r"abort_req / cache_finished_req"):
        cache.free_device(new)
    with pytest.raises(InvalidInputError, match="belongs to a request"):
        cache.insert(list(range(700, 716)), new)
    assert _state(cache) == before
    other = await cache.alloc_device(4)
    with pytest.raises(InvalidInputError, match=rf"slot {int(other[0])} .*not held by request"):
        req.spare = other  # a caller's slots smuggled into the request are not its own
        cache.abort_req(req)
    req.spare = new[:0]
    cache.free_device(other)
    assert _state(cache) == before  # the refused release changed nothing
    cache.write_kv(new, model.expected(tokens, 16, 32))
    cache.cache_finished_req(req)
    assert cache.match_prefix(tokens).device_prefix_len == 32
    model.check(cache, tokens, cache.match_prefix(tokens).device_indices)
    cache.sanity_check()
