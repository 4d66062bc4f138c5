"""Retraction backup (behavior.md 1.18): park a running request's KV in host memory, restore it
bit-exact into fresh device slots later, or discard it; cancellation leaks nothing."""

from __future__ import annotations

import asyncio

import pytest

from asynccache.errors import ConfigError, InvalidInputError, PoolExhaustedError

TOKENS = list(range(500, 530))  # 7 whole pages + 2


async def _running(cache, model, tokens=TOKENS, chunk=12):
    """A request mid-flight: its first chunk cached in the tree, the rest its own."""
    req = cache.admit(tokens)
    new = await cache.extend(req, chunk)
    cache.write_kv(new, model.expected(tokens, 0, chunk))
    cache.cache_unfinished_req(req)
    new = await cache.extend(req, len(tokens) - 4 - chunk)
    cache.write_kv(new, model.expected(tokens, chunk, len(tokens) - 4))
    return req


async def _clobber_device(cache):
    """Evict everything and overwrite every free device slot (reused memory must not leak in)."""
    await cache.evict_async(10_000)
    slots = await cache.alloc_device(cache.device_available)
    import torch
    s = cache.shape
    cache.write_kv(slots, torch.full((s.num_layers, 2, len(slots), s.num_heads, s.head_dim), 7.0,
                                     dtype=s.dtype))
    cache.free_device(slots)


@pytest.mark.parametrize("host_mode", ["cache", "buffer_only"])
async def test_retract_restore_is_bit_exact(make_cache, kit, host_mode):
    cache = await make_cache(retraction_backup=True, device_tokens=64, host_tokens=64,
                             host_mode=host_mode)
    model = kit.KVModel.of(cache)
    req = await _running(cache, model)
    assert (req.prefix_len, req.computed) == (12, 26)
    backup = await asyncio.wait_for(cache.retract(req), kit.TIMEOUT)
    assert backup.num_tokens == 26 and len(backup.host_slots) == 28
    assert req.retracted is backup and req.computed == 0 and req.receipt is None
    assert cache.tree.held_locks == 0
    assert cache.device_pool.allocator.used_size == cache.tree.device_size == 12
    assert cache.host_in_flight == 28
    cache.sanity_check()
    await _clobber_device(cache)
    assert cache.tree.device_size == 0
    await asyncio.wait_for(cache.restore(req), kit.TIMEOUT)
    assert req.retracted is None and backup.state == "restored"
    assert (req.prefix_len, req.computed, len(req.spare)) == (0, 26, 2)
    model.check(cache, TOKENS, req.slots, "restored KV")
    assert cache.host_in_flight == 0
    cache.sanity_check()
    new = await cache.extend(req, 4)  # and it carries on
    cache.write_kv(new, model.expected(TOKENS, 26, 30))
    cache.cache_finished_req(req)
    m = cache.match_prefix(TOKENS)
    assert m.device_prefix_len == 28
    model.check(cache, TOKENS, m.device_indices, "cached after restore")


async def test_restore_dedupes_against_what_the_tree_kept(make_cache, kit):
    cache = await make_cache(retraction_backup=True, device_tokens=64, host_tokens=64)
    model = kit.KVModel.of(cache)
    req = await _running(cache, model)
    await cache.retract(req)
    await cache.restore(req)  # the tree still holds the first 12 tokens
    cache.cache_finished_req(req)
    assert cache.tree.device_size == 24  # 12 kept + 12 newly cached; the duplicates were freed
    assert cache.device_pool.allocator.used_size == 24
    model.check(cache, TOKENS, cache.match_prefix(TOKENS).device_indices)


async def test_discard_and_abort_free_the_host_copy(make_cache, kit):
    cache = await make_cache(retraction_backup=True, device_tokens=64, host_tokens=64)
    model = kit.KVModel.of(cache)
    req = await _running(cache, model)
    backup = await cache.retract(req)
    cache.discard_retracted(req)
    assert backup.state == "discarded" and cache.host_pool.allocator.used_size == 0
    with pytest.raises(InvalidInputError, match="no retracted KV"):
        await cache.restore(req)
    cache.abort_req(req)
    req2 = await _running(cache, model)
    await cache.retract(req2)
    cache.abort_req(req2)  # aborting a retracted request drops its host copy too
    await cache.flush()
    assert cache.host_in_flight == 0
    assert cache.host_pool.allocator.used_size == cache.host_size == 12  # a backup of the hit prefix
    cache.sanity_check()


async def test_host_shortage_is_a_clear_error_and_changes_nothing(make_cache, kit):
    cache = await make_cache(retraction_backup=True, device_tokens=64, host_tokens=64)
    model = kit.KVModel.of(cache)
    first = await _running(cache, model, list(range(1000, 1040)), chunk=8)  # 36 computed
    await cache.retract(first)  # 36 host slots
    second = await _running(cache, model, list(range(2000, 2040)), chunk=8)
    before = (second.slots.copy(), second.prefix_len, cache.device_pool.allocator.used_size)
    with pytest.raises(PoolExhaustedError, match="36 host slots needed, 28 free"):
        await cache.retract(second)
    assert (second.slots.tolist(), second.prefix_len, cache.device_pool.allocator.used_size) == (
        before[0].tolist(), before[1], before[2])
    model.check(cache, list(range(2000, 2040)), second.slots, "KV after a refused retraction")
    cache.sanity_check()
    cache.abort_req(first)
    cache.abort_req(second)


async def test_configuration_is_validated_at_start(make_cache, kit):
    with pytest.raises(ConfigError, match="host tier"):
        kit.config(retraction_backup=True, host_tokens=0)
    with pytest.raises(ConfigError, match="32 host slots < 64 device slots"):
        await make_cache(retraction_backup=True, device_tokens=64, host_tokens=32)
    cache = await make_cache(device_tokens=64, host_tokens=64)
    req = cache.admit(TOKENS)
    with pytest.raises(ConfigError, match="retraction_backup"):
        await cache.retract(req)
    cache.abort_req(req)


async def test_retract_twice_and_finished(make_cache, kit):
    cache = await make_cache(retraction_backup=True, device_tokens=64, host_tokens=64)
    req = await _running(cache, kit.KVModel.of(cache))
    await cache.retract(req)
    with pytest.raises(InvalidInputError, match="already retracted"):
        await cache.retract(req)
    cache.cache_finished_req(req)
    with pytest.raises(InvalidInputError, match="already finished"):
        await cache.retract(req)


@pytest.mark.parametrize("k", [0, 1, 2, 3, 5, 500])
async def test_cancelled_retract_leaves_the_request_intact(make_cache, kit, k):
    cache = await make_cache(retraction_backup=True, device_tokens=64, host_tokens=64)
    model = kit.KVModel.of(cache)
    req = await _running(cache, model)
    outcome, _ = await kit.run_cancelled(lambda: cache.retract(req), k)
    await cache.flush()
    cache.sanity_check()
    if outcome == "cancelled":
        assert req.retracted is None and req.computed == 26
        assert cache.host_in_flight == 0 and cache.host_pool.allocator.used_size == cache.host_size
        model.check(cache, TOKENS, req.slots, "KV after a cancelled retraction")
    else:
        assert req.retracted is not None
        await cache.restore(req)
        model.check(cache, TOKENS, req.slots)
    cache.abort_req(req)


@pytest.mark.parametrize("k", [0, 1, 2, 3, 5, 8, 500])
async def test_cancelled_restore_keeps_the_backup(make_cache, kit, k):
    cache = await make_cache(retraction_backup=True, device_tokens=64, host_tokens=64)
    model = kit.KVModel.of(cache)
    req = await _running(cache, model)
    await cache.retract(req)
    outcome, _ = await kit.run_cancelled(lambda: cache.restore(req), k)
    await cache.flush()
    cache.sanity_check()
    if outcome == "cancelled":
        assert req.retracted is not None and req.retracted.state == "held"
        assert cache.device_pool.allocator.used_size == cache.tree.device_size
        await cache.restore(req)
    model.check(cache, TOKENS, req.slots, "restored KV")
    cache.abort_req(req)


async def test_a_retracted_request_refuses_work_until_restored(make_cache, kit):
    cache = await make_cache(retraction_backup=True, device_tokens=64, host_tokens=64)
    model = kit.KVModel.of(cache)
    req = await _running(cache, model)
    await cache.retract(req)
    for call in (lambda: cache.extend(req, 4), lambda: cache.load_back_request(req)):
        with pytest.raises(InvalidInputError, match="retracted: restore it first"):
            await call()
    with pytest.raises(InvalidInputError, match="retracted: restore it first"):
        cache.cache_unfinished_req(req)
    cache.sanity_check()
    await cache.restore(req)
    new = await cache.extend(req, 4)
    cache.write_kv(new, model.expected(TOKENS, 26, 30))
    cache.cache_finished_req(req)
