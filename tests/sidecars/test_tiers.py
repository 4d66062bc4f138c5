"""Sidecar data rides every D->H and H->D copy of its source: write-through backups, write-back
at eviction, load-back (layer by layer for a layered sidecar). Bit-exact, with the free device
slots clobbered between steps, for a draft-KV sidecar and an indexer-style sidecar."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from asynccache.errors import InvalidInputError
from asynccache.testing.copyfaults import copy_faults

TOKENS = list(range(1000, 1026))  # 6 whole pages + 2


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
async def test_evict_and_load_back_bit_exact(make_cache, kit, policy):
    cache = await make_cache(write_policy=policy)
    model = kit.SidecarModel(cache)
    await kit.serve(cache, model, TOKENS)
    if policy == "write_through_selective":
        await kit.serve(cache, model, TOKENS)  # the second hit backs it up
    await asyncio.wait_for(cache.flush(), kit.TIMEOUT)
    assert await cache.evict_async(10_000) >= 24
    await asyncio.wait_for(cache.flush(), kit.TIMEOUT)
    assert cache.tree.device_size == 0 and cache.tree.host_size == 24
    model.clobber()
    req = await kit.serve(cache, model, TOKENS)  # checks the loaded prefix, KV and sidecars
    assert req.prefix_len == 24
    copies = {s.name: s.engine.stats for s in cache.sidecars}
    assert all(st["d2h"].tokens == 24 for st in copies.values()), copies
    assert all(st["h2d_layerwise"].tokens == 24 for st in copies.values()), copies


async def test_host_copies_hold_the_sidecar_bytes(make_cache, kit):
    cache = await make_cache(write_policy="write_through")
    model = kit.SidecarModel(cache)
    req = await kit.serve(cache, model, TOKENS, finish=False)
    dev = np.asarray(req.slots[:24])
    cache.cache_finished_req(req)
    await asyncio.wait_for(cache.flush(), kit.TIMEOUT)
    m = cache.match_prefix(TOKENS)
    assert m.device_prefix_len == 24
    host = cache.tree.host_slots_of(m.best_node)  # one node: the request's whole pages
    assert host is not None and len(host) == 24
    for sc in cache.sidecars:
        kit.assert_bits_equal(sc.host.read_slots(host), sc.device.read_slots(dev),
                              f"host copy of {sc.name}")
        kit.assert_bits_equal(sc.host.read_slots(host), model.expected(sc.name, TOKENS, 0, 24),
                              f"host copy of {sc.name} vs model")


async def begin_evicted_load(make_cache, kit):
    """TOKENS served, backed up, evicted and the device pools clobbered; a layer-wise load of
    them just begun: (cache, model, load-back)."""
    cache = await make_cache(write_policy="write_through")
    cache_model = kit.SidecarModel(cache)
    await kit.serve(cache, cache_model, TOKENS)
    await asyncio.wait_for(cache.flush(), kit.TIMEOUT)
    await cache.evict_async(10_000)
    cache_model.clobber()
    lb = cache.begin_load_back(cache.match_prefix(TOKENS))
    assert lb is not None and set(lb.sidecars) == {"draft", "indexer"}
    return cache, cache_model, lb


async def test_layerwise_load_of_the_draft_sidecar(make_cache, kit):
    cache, cache_model, lb = await begin_evicted_load(make_cache, kit)
    await asyncio.wait_for(lb.layer(1), kit.TIMEOUT)
    await asyncio.wait_for(lb.sidecar_layer("draft", 0), kit.TIMEOUT)
    await asyncio.wait_for(lb.sidecar_layer("indexer", 0), kit.TIMEOUT)
    await asyncio.wait_for(lb.wait(), kit.TIMEOUT)
    cache_model.check(TOKENS, lb.device_indices, "layer-wise load")
    cache.release_load(lb)


async def test_a_forward_waits_on_every_model_layer_with_fewer_layered_sidecars(make_cache, kit):
    """The draft and indexer sidecars have one layer, the KV two: ``lb.wait_layer(i)`` from
    the forward's thread works for every model layer (it waits for the KV's layer ``i`` and
    for layer ``i`` of each rider that has one), and ``wait_sidecar_layer`` waits for a rider's
    own layer (a name the load does not copy: the whole load, like ``sidecar_layer``); then
    every byte read is the cached one."""
    cache, cache_model, lb = await begin_evicted_load(make_cache, kit)
    assert cache.shape.num_layers == 2
    assert {n: h.num_layers for n, h in lb.sidecars.items()} == {"draft": 1, "indexer": 1}

    def forward() -> None:
        for i in range(cache.shape.num_layers):
            lb.wait_layer(i, timeout=kit.TIMEOUT)
        for name in lb.sidecars:
            lb.wait_sidecar_layer(name, 0, timeout=kit.TIMEOUT)
        with pytest.raises(InvalidInputError, match=r"sidecar 'draft': layer 1 out of range"):
            lb.wait_sidecar_layer("draft", 1)
        lb.wait_sidecar_layer("nope", 0, timeout=kit.TIMEOUT)  # not in this load: all of it

    await asyncio.wait_for(asyncio.to_thread(forward), kit.TIMEOUT)
    await asyncio.wait_for(lb.wait(), kit.TIMEOUT)
    cache_model.check(TOKENS, lb.device_indices, "layer-wise load")
    cache.release_load(lb)


async def test_failed_sidecar_backup_fails_the_backup(make_cache, kit):
    """A rider copy that fails fails its whole backup: the node keeps no host copy (its host
    slots are given back), and a later backup of it carries the sidecars again."""
    cache = await make_cache(write_policy="write_through")
    model = kit.SidecarModel(cache)
    faults = copy_faults(cache.sidecar("indexer").engine, fail={0})
    try:
        await kit.serve(cache, model, TOKENS)
        await asyncio.wait_for(cache.flush(), kit.TIMEOUT)
    finally:
        faults.remove()
    assert faults.failed == 1
    assert cache.tree.host_size == 0 and cache.host_in_flight == 0
    cache.sanity_check()
    await kit.serve(cache, model, TOKENS)  # hit again: backed up now
    await asyncio.wait_for(cache.flush(), kit.TIMEOUT)
    assert cache.tree.host_size == 24
    await cache.evict_async(10_000)
    model.clobber()
    req = await kit.serve(cache, model, TOKENS)
    assert req.prefix_len == 24
