"""Retraction backup / restore (behavior.md 1.18) carries the sidecars: a retracted request's
sidecar data parks in the sidecar host pools at its KV host slots and comes back bit-exact into
its fresh device slots; cancelled retracts and restores leak nothing."""

from __future__ import annotations

import asyncio

import pytest

TOKENS = list(range(500, 530))  # 7 whole pages + 2


async def _running(cache, model, tokens=TOKENS, chunk=12):
    """A request mid-flight: its first chunk cached in the tree, the rest its own."""
    req = cache.admit(tokens)
    new = await cache.extend(req, chunk)
    model.write(new, tokens, 0, chunk)
    cache.cache_unfinished_req(req)
    new = await cache.extend(req, len(tokens) - 4 - chunk)
    model.write(new, tokens, chunk, len(tokens) - 4)
    return req


@pytest.mark.parametrize("host_mode", ["cache", "buffer_only"])
async def test_retract_restore_is_bit_exact(make_cache, kit, host_mode):
    cache = await make_cache(retraction_backup=True, device_tokens=64, host_tokens=64,
                             host_mode=host_mode)
    model = kit.SidecarModel(cache)
    req = await _running(cache, model)
    backup = await asyncio.wait_for(cache.retract(req), kit.TIMEOUT)
    assert backup.num_tokens == 26 and len(backup.host_slots) == 28
    for sc in cache.sidecars:  # parked at the KV host slots
        kit.assert_bits_equal(sc.host.read_slots(backup.host_slots[:26]),
                              model.expected(sc.name, TOKENS, 0, 26), f"parked {sc.name}")
    await kit.clobber_device(cache, model)
    await asyncio.wait_for(cache.restore(req), kit.TIMEOUT)
    model.check(TOKENS, req.slots, "restored")
    cache.sanity_check()
    new = await cache.extend(req, 4)
    model.write(new, TOKENS, 26, 30)
    cache.cache_finished_req(req)
    m = cache.match_prefix(TOKENS)
    assert m.device_prefix_len == 28
    model.check(TOKENS, m.device_indices, "cached after restore")


@pytest.mark.parametrize("k", [0, 1, 2, 3, 5, 500])
async def test_cancelled_retract_leaves_the_request_intact(make_cache, kit, k):
    cache = await make_cache(retraction_backup=True, device_tokens=64, host_tokens=64)
    model = kit.SidecarModel(cache)
    req = await _running(cache, model)
    outcome, _ = await kit.run_cancelled(lambda: cache.retract(req), k)
    await cache.flush()
    cache.sanity_check()
    if outcome == "cancelled":
        assert req.retracted is None and req.computed == 26
        assert cache.host_in_flight == 0
    else:
        assert req.retracted is not None
        await cache.restore(req)
    model.check(TOKENS, req.slots, f"after a retract cancelled at {k}")
    cache.abort_req(req)


@pytest.mark.parametrize("k", [0, 1, 2, 3, 5, 8, 500])
async def test_cancelled_restore_keeps_the_backup(make_cache, kit, k):
    cache = await make_cache(retraction_backup=True, device_tokens=64, host_tokens=64)
    model = kit.SidecarModel(cache)
    req = await _running(cache, model)
    await cache.retract(req)
    outcome, _ = await kit.run_cancelled(lambda: cache.restore(req), k)
    await cache.flush()
    cache.sanity_check()
    if outcome == "cancelled":
        assert req.retracted is not None and req.retracted.state == "held"
        await kit.clobber_device(cache, model)
        await cache.restore(req)
    model.check(TOKENS, req.slots, f"restored after a restore cancelled at {k}")
    cache.abort_req(req)
