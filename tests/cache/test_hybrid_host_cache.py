"""HierarchicalCache with SWA / Mamba components and a host (L2) tier: backups, demotion and
load-back carry the SWA window KV and the Mamba state bit for bit; a load-back or backup that
any component pool cannot serve is skipped as a whole; cancellation leaks nothing."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch

from asynccache.errors import PoolExhaustedError
from tests.hybrid_driver import randomize

COMBOS = {
    "full+swa": {"sliding_window": 4, "swa_tokens": 32},
    "full+mamba": {"mamba_states": 4, "mamba_state_shape": (3, 5)},
    "full+swa+mamba": {"sliding_window": 4, "swa_tokens": 32, "mamba_states": 4,
                       "mamba_state_shape": (3, 5)},
}
BASE = {"page_size": 2, "device_tokens": 32, "host_tokens": 64, "write_policy": "write_through",
        "load_back_threshold": 0}
TOKENS = list(range(100, 112))


def zero_device(cache: Any) -> None:
    hy = cache.hybrid
    cache.device_pool.kv.zero_()
    if hy.swa_pool is not None:
        hy.swa_pool.kv.zero_()
    if hy.mamba_pool is not None:
        hy.mamba_pool.states.zero_()


async def cache_and_write(make_cache: Any, combo: str, **kw: Any) -> tuple[Any, dict[str, Any]]:
    """A hybrid cache holding TOKENS (backed up to host); returns the KV it must serve."""
    cache = await make_cache(**{**BASE, **COMBOS[combo], **kw})
    randomize(cache, 7)
    hy = cache.hybrid
    slots = cache.try_alloc_device(len(TOKENS))
    state = cache.alloc_mamba_state() if hy.mamba_pool is not None else None
    want: dict[str, Any] = {"full": cache.device_pool.read_slots(slots).clone()}
    if hy.swa_map is not None:
        want["swa"] = hy.swa_pool.read_slots(hy.swa_map.translate(slots)).clone()
    if state is not None:
        want["mamba"] = hy.mamba_pool.states[state].clone()
    res = cache.insert(TOKENS, slots, mamba_value=state)
    assert res.cached_len == len(TOKENS)
    await cache.flush()
    cache.sanity_check()
    return cache, want


def served(cache: Any, device_indices: np.ndarray, swa_tail: int = 0) -> dict[str, Any]:
    """The KV the cache serves for TOKENS; ``swa_tail``: only the SWA of the last tokens (the
    rest was out of the window and evicted)."""
    hy = cache.hybrid
    out: dict[str, Any] = {"full": cache.device_pool.read_slots(device_indices)}
    if hy.swa_map is not None:
        swa_idx = device_indices[len(device_indices) - swa_tail :] if swa_tail else device_indices
        out["swa"] = hy.swa_pool.read_slots(hy.swa_map.translate(swa_idx))
    if hy.mamba_pool is not None:
        m = cache.match_prefix(TOKENS, cow_mamba=True)
        assert m.device_prefix_len == len(TOKENS)
        out["mamba"] = hy.mamba_pool.states[m.mamba_cow_slot]
    return out


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype
        assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), name


@pytest.mark.parametrize("combo", sorted(COMBOS))
async def test_backup_evict_load_back_round_trip_is_bit_exact(make_cache: Any, combo: str) -> None:
    cache, want = await cache_and_write(make_cache, combo)
    tier = cache.hybrid.tier
    assert cache.host_size == len(TOKENS)
    if "swa" in want:
        assert tier.swa_host.allocator.used_size == len(TOKENS)
    if "mamba" in want:
        assert tier.mamba_host.used_size == 1
    assert cache.evict(len(TOKENS)) == len(TOKENS)  # backed up: demoted to host
    cache.sanity_check()
    assert cache.device_pool.allocator.used_size == 0
    zero_device(cache)
    m = cache.match_prefix(TOKENS)
    assert (m.device_prefix_len, m.host_hit_length) == (0, len(TOKENS))
    lb = await cache.load_back(m)
    assert lb is not None and lb.error is None and len(lb.device_indices) == len(TOKENS)
    cache.sanity_check()
    assert_same(served(cache, lb.device_indices), want)
    cache.release_load(lb)
    # Host copies stay as duplicates (write-through keeps them unless asked); reclaiming them
    # frees the component copies too.
    assert cache.evict_host(len(TOKENS)) == 0
    assert cache.evict_host(len(TOKENS), reclaim_duplicates=True) == len(TOKENS)
    cache.sanity_check()
    assert (cache.host_pool.allocator.used_size, len(cache.tree.component_host_slots(
        cache.tree.components[1]))) == (0, 0)
    # Back up and demote again, then close: every pool of every tier is empty.
    cache.evict(len(TOKENS))
    hy = cache.hybrid
    pools = [cache.device_pool.allocator, cache.host_pool.allocator]
    if hy.swa_pool is not None:
        pools += [hy.swa_pool.allocator, tier.swa_host.allocator]
    if hy.mamba_pool is not None:
        pools += [hy.mamba_pool.allocator, tier.mamba_host.allocator]
    await cache.flush()
    cache.sanity_check()
    await cache.aclose()
    assert [p.used_size for p in pools] == [0] * len(pools)


@pytest.mark.parametrize("threshold", [0, 100])
async def test_swa_only_on_host_is_loaded_back_alone(make_cache: Any, threshold: int) -> None:
    """(A component transfer is loaded even under ``load_back_threshold``, as the reference
    skips only short hits without one.)"""
    cache, want = await cache_and_write(make_cache, "full+swa", load_back_threshold=threshold)
    hy = cache.hybrid
    assert cache.evict(0, swa_num_tokens=100) == 0
    cache.sanity_check()
    assert hy.swa_pool.allocator.used_size == 0
    hy.swa_pool.kv.zero_()
    m = cache.match_prefix(TOKENS)
    assert (m.device_prefix_len, m.host_hit_length) == (0, len(TOKENS))
    assert cache.tree.load_back_sizes(m.best_node) == {"full": 0, "swa": len(TOKENS)}
    lb = await cache.load_back(m)
    assert lb is not None
    cache.sanity_check()
    assert hy.swa_pool.allocator.used_size == len(TOKENS)
    assert_same(served(cache, lb.device_indices), want)
    cache.release_load(lb)


async def test_a_short_component_host_pool_skips_the_whole_backup(make_cache: Any) -> None:
    cache = await make_cache(**{**BASE, **COMBOS["full+swa"], "swa_host_tokens": 4})
    slots = cache.try_alloc_device(len(TOKENS))
    cache.insert(TOKENS, slots)  # cap-split: 8 + 4 tokens, the 8-token node first
    await cache.flush()
    cache.sanity_check()
    skipped = cache.metrics.hybrid_skipped.labels(op="backup")._value.get()
    assert skipped == 1
    # Root first: the first node could not be backed up, so neither was its child.
    assert cache.host_size == 0
    assert cache.host_pool.allocator.used_size == 0
    assert cache.hybrid.tier.swa_host.allocator.used_size == 0


async def test_a_short_mamba_pool_skips_the_whole_load_back(make_cache: Any) -> None:
    cache, want = await cache_and_write(make_cache, "full+mamba")
    hy = cache.hybrid
    cache.evict(len(TOKENS))
    taken = [cache.alloc_mamba_state() for _ in range(4)]  # the request side holds every state
    assert None not in taken
    m = cache.match_prefix(TOKENS)
    assert await cache.load_back(m) is None
    assert cache.metrics.hybrid_skipped.labels(op="load_back")._value.get() == 1
    cache.sanity_check()
    assert cache.device_pool.allocator.used_size == 0  # nothing taken for FULL either
    for s in taken:
        cache.free_mamba_state(s)
    zero_device(cache)
    lb = await cache.load_back(cache.match_prefix(TOKENS))
    assert lb is not None
    assert_same(served(cache, lb.device_indices), want)
    cache.release_load(lb)
    assert hy.mamba_outstanding == 0


@pytest.mark.parametrize("combo", sorted(COMBOS))
async def test_cancelling_a_load_back_at_every_await_point_leaks_nothing(
    make_cache: Any, combo: str
) -> None:
    cache, want = await cache_and_write(make_cache, combo)
    for k in range(8):
        cache.evict(len(TOKENS))
        cache.sanity_check()
        m = cache.match_prefix(TOKENS)
        assert m.host_hit_length == len(TOKENS)
        task = asyncio.ensure_future(cache.load_back(m))
        for _ in range(k):
            await asyncio.sleep(0)
        task.cancel()
        try:
            lb = await task
        except asyncio.CancelledError:
            lb = None
        if lb is not None:
            cache.release_load(lb)
        await cache.flush()
        cache.sanity_check()
        assert cache.tree.held_locks == 0
        assert cache.tree.pending_ops == 0
    zero_device(cache)
    cache.evict(len(TOKENS))
    lb = await cache.load_back(cache.match_prefix(TOKENS))
    assert lb is not None
    assert_same(served(cache, lb.device_indices), want)
    cache.release_load(lb)


@pytest.mark.parametrize("combo", sorted(COMBOS))
async def test_write_back_copies_components_at_eviction(make_cache: Any, combo: str) -> None:
    cache, want = await cache_and_write(make_cache, combo, write_policy="write_back")
    assert cache.host_size == 0  # nothing is written before eviction
    assert await cache.evict_async(len(TOKENS)) == len(TOKENS)
    cache.sanity_check()
    assert cache.host_size == len(TOKENS)
    zero_device(cache)
    lb = await cache.load_back(cache.match_prefix(TOKENS))
    assert lb is not None
    cache.sanity_check()
    assert_same(served(cache, lb.device_indices), want)
    cache.release_load(lb)


@pytest.mark.parametrize("combo", sorted(COMBOS))
async def test_reinsert_over_host_only_nodes_serves_the_new_kv(make_cache: Any, combo: str) -> None:
    cache, _ = await cache_and_write(make_cache, combo)
    cache.evict(len(TOKENS))
    randomize(cache, 11)  # the request recomputed the prefix into fresh slots
    hy = cache.hybrid
    longer = [*TOKENS, 7, 8]
    slots = cache.try_alloc_device(len(longer))
    state = cache.alloc_mamba_state() if hy.mamba_pool is not None else None
    want: dict[str, Any] = {"full": cache.device_pool.read_slots(slots[: len(TOKENS)]).clone()}
    if hy.swa_map is not None:
        # Only the last window of the new key keeps its SWA slots; compare those.
        tail = slots[len(longer) - 4 :]
        want_swa = hy.swa_pool.read_slots(hy.swa_map.translate(tail)).clone()
    res = cache.insert(longer, slots, mamba_value=state)
    await cache.flush()
    cache.sanity_check()
    assert (res.prefix_len, res.cached_len) == (len(TOKENS), len(longer))
    m = cache.match_prefix(longer)
    assert (m.device_prefix_len, m.host_hit_length) == (len(longer), 0)
    assert np.array_equal(m.device_indices, slots)
    assert torch.equal(cache.device_pool.read_slots(m.device_indices[: len(TOKENS)]),
                       want["full"])
    if hy.swa_map is not None:
        got = hy.swa_pool.read_slots(hy.swa_map.translate(m.device_indices[len(longer) - 4 :]))
        assert torch.equal(got, want_swa)


async def test_a_request_loads_its_hybrid_host_hit_back(make_cache: Any) -> None:
    cache, want = await cache_and_write(make_cache, "full+swa+mamba")
    cache.evict(len(TOKENS))
    zero_device(cache)
    req = cache.admit([*TOKENS, 1])
    assert (req.prefix_len, req.host_hit_length) == (0, len(TOKENS))
    assert await cache.load_back_request(req) == len(TOKENS)
    assert req.prefix_len == len(TOKENS)
    cache.sanity_check()
    assert_same(served(cache, req.slots), want)
    cache.abort_req(req)
    cache.sanity_check()
    assert cache.tree.held_locks == 0


async def test_admit_without_a_free_mamba_state_keeps_no_host_lock(make_cache: Any) -> None:
    # A host hit is locked at admission; when no Mamba state is free the admission fails and
    # must leave no lock behind, or that host copy can never be evicted again.
    cache, _ = await cache_and_write(make_cache, "full+mamba")
    cache.evict(len(TOKENS))
    assert cache.match_prefix(TOKENS).host_hit_length == len(TOKENS)
    held = [cache.alloc_mamba_state() for _ in range(4)]
    assert None not in held
    with pytest.raises(PoolExhaustedError, match="no Mamba state slot is free"):
        cache.admit(TOKENS)
    assert cache.tree.held_locks == 0
    for state in held:
        cache.free_mamba_state(state)
    cache.sanity_check()
    assert cache.evict_host(len(TOKENS)) == len(TOKENS)
    assert cache.host_size == 0
    cache.sanity_check()


@pytest.mark.parametrize("combo", sorted(COMBOS))
async def test_storage_round_trip_carries_swa_pages_and_states(
    make_cache: Any, combo: str, tmp_path: Any
) -> None:
    from asynccache.l3 import StoragePolicy
    from asynccache.storage.file import FileBackend

    cache = await make_cache(**{**BASE, **COMBOS[combo], "host_tokens": 32})
    backend = FileBackend(tmp_path, cache.storage_layout())
    await backend.start()
    try:
        cache.attach_storage(backend, StoragePolicy(prefetch_threshold=2,
                                                    prefetch_policy="wait_complete"))
        randomize(cache, 5)
        hy = cache.hybrid
        slots = cache.try_alloc_device(len(TOKENS))
        state = cache.alloc_mamba_state() if hy.mamba_pool is not None else None
        want: dict[str, Any] = {"full": cache.device_pool.read_slots(slots).clone()}
        if hy.swa_map is not None:  # what comes back from storage: the last window
            tail = slots[len(TOKENS) - 4 :]
            want["swa"] = hy.swa_pool.read_slots(hy.swa_map.translate(tail)).clone()
        if state is not None:
            want["mamba"] = hy.mamba_pool.states[state].clone()
        cache.insert(TOKENS, slots, mamba_value=state)
        await cache.flush()
        await cache.storage.drain()
        keys = cache.tree.page_hashes(cache.match_prefix(TOKENS).last_device_node)
        names = [*keys]
        if hy.swa_map is not None:
            names += [f"{k}.swa" for k in keys]
        if hy.mamba_pool is not None:
            names.append(f"{keys[-1]}.mamba")
        assert await backend.exists_prefix(names) == len(names)
        # Drop every device and host copy: only storage has the prefix now.
        cache.evict(len(TOKENS))
        cache.evict_host(len(TOKENS))
        cache.sanity_check()
        assert (cache.tree.node_count, cache.host_size) == (0, 0)
        zero_device(cache)
        cache.host_pool.kv.zero_()
        req = cache.admit([*TOKENS, 1])
        assert req.prefix_len + req.host_hit_length == 0
        assert await cache.prefetch_request(req) == len(TOKENS)
        cache.sanity_check()
        assert await cache.load_back_request(req) == len(TOKENS)
        cache.sanity_check()
        assert_same(served(cache, req.slots, swa_tail=4), want)
        cache.abort_req(req)
        cache.sanity_check()
        # A state missing from storage makes the next prefetch insert nothing (all or nothing).
        if hy.mamba_pool is not None:
            await backend.delete([f"{keys[-1]}.mamba"])
            cache.evict(len(TOKENS))
            cache.evict_host(len(TOKENS))
            req = cache.admit([*TOKENS, 1])
            assert await cache.prefetch_request(req) == 0
            cache.sanity_check()
            assert cache.host_size == 0
            cache.abort_req(req)
    finally:
        await cache.aclose()
        await backend.aclose()


async def test_cancelling_a_hybrid_prefetch_at_every_await_point_leaks_nothing(
    make_cache: Any, tmp_path: Any
) -> None:
    from asynccache.l3 import StoragePolicy
    from asynccache.storage.file import FileBackend

    cache = await make_cache(**{**BASE, **COMBOS["full+swa+mamba"], "host_tokens": 32})
    backend = FileBackend(tmp_path, cache.storage_layout())
    await backend.start()
    try:
        cache.attach_storage(backend, StoragePolicy(prefetch_threshold=2,
                                                    prefetch_policy="wait_complete"))
        slots = cache.try_alloc_device(len(TOKENS))
        cache.insert(TOKENS, slots, mamba_value=cache.alloc_mamba_state())
        await cache.flush()
        await cache.storage.drain()
        tier = cache.hybrid.tier
        outcomes = set()
        for k in range(40):
            cache.evict(len(TOKENS))
            cache.evict_host(len(TOKENS))
            req = cache.admit([*TOKENS, 1])
            task = asyncio.ensure_future(cache.prefetch_request(req))
            for _ in range(k):
                await asyncio.sleep(0)
            task.cancel()
            try:
                outcomes.add(await task)
            except asyncio.CancelledError:
                outcomes.add("cancelled")
            cache.abort_req(req)
            await cache.storage.drain()
            cache.sanity_check()
            assert tier.inflight == {"swa": 0, "mamba": 0}
            assert cache.tree.held_locks == 0
        assert "cancelled" in outcomes and outcomes <= {"cancelled", len(TOKENS)}
        # (how far 40 loop turns get depends on the I/O threads; a prefetch left alone lands)
        cache.evict(len(TOKENS))
        cache.evict_host(len(TOKENS))
        req = cache.admit([*TOKENS, 1])
        assert await cache.prefetch_request(req) == len(TOKENS)
        cache.abort_req(req)
        await cache.storage.drain()
        cache.sanity_check()
    finally:
        await cache.aclose()
        await backend.aclose()


async def test_write_back_without_component_host_room_drops_the_victim(make_cache: Any) -> None:
    cache = await make_cache(**{**BASE, **COMBOS["full+swa+mamba"], "write_policy": "write_back",
                                "mamba_host_states": 1})
    hy = cache.hybrid
    for i, base in enumerate((100, 200)):  # two sequences, each ending in a state
        toks = list(range(base, base + 6))
        slots = cache.try_alloc_device(6)
        cache.insert(toks, slots, mamba_value=cache.alloc_mamba_state())
        assert i == 0 or cache.host_size == 0
    cache.sanity_check()
    # Each is cap-split into 2 + 4 tokens, the state on the 4-token leaf. Both leaves need a
    # host state for their write-back; the host state pool holds one. The second leaf is
    # dropped; its stateless parent's copy runs with its child's (the reference's parent
    # chain, SGLang 0.5.23 does the same), so the parent goes to host and is a FULL hit of 2;
    # the first sequence goes to host whole.
    assert await cache.evict_async(12) == 12
    await cache.flush()
    cache.sanity_check()
    assert cache.metrics.hybrid_skipped.labels(op="backup")._value.get() == 1
    assert cache.metrics.dropped_tokens.labels(reason="host_pressure")._value.get() == 4
    assert (cache.host_size, hy.tier.swa_host.allocator.used_size,
            hy.tier.mamba_host.used_size) == (8, 8, 1)
    assert cache.device_pool.allocator.used_size == 0
    m = cache.match_prefix(list(range(100, 106)))
    assert (m.device_prefix_len, m.host_hit_length) == (0, 6)
    assert cache.match_prefix(list(range(200, 206))).full_kv_hit_length == 2


async def test_alloc_device_waits_for_hybrid_write_backs(make_cache: Any) -> None:
    cache, want = await cache_and_write(make_cache, "full+swa+mamba", write_policy="write_back",
                                        device_tokens=12, swa_tokens=12)
    assert cache.device_pool.allocator.available_size == 0
    slots = await cache.alloc_device(12)  # the whole prefix goes to host first
    cache.sanity_check()
    assert cache.host_size == len(TOKENS)
    cache.free_device(slots)
    zero_device(cache)
    lb = await cache.load_back(cache.match_prefix(TOKENS))
    assert lb is not None
    # Making SWA room tombstoned the SWA of the first 8 tokens (out of the window) before
    # their write-back: only the last window has SWA on host, and it is what comes back.
    want["swa"] = want["swa"][:, :, len(TOKENS) - 4 :]
    assert_same(served(cache, lb.device_indices, swa_tail=4), want)
    cache.release_load(lb)


async def begin_hybrid_load(make_cache: Any, **kw: Any) -> tuple[Any, dict[str, Any], Any, Any]:
    """A FULL+SWA+Mamba cache holding TOKENS on host only (device pools zeroed), a request
    for them and its layer-wise load-back, just begun: (cache, the KV it must serve, request,
    load-back)."""
    from asynccache.transfers.handles import LayeredGroup

    cache, want = await cache_and_write(make_cache, "full+swa+mamba", **kw)
    cache.evict(len(TOKENS))
    zero_device(cache)
    req = cache.admit([*TOKENS, 1])
    lb = cache.begin_load_back_request(req)
    assert lb is not None and isinstance(lb.group, LayeredGroup)
    return cache, want, req, lb


async def test_a_forward_waits_for_each_layer_of_a_hybrid_load_back(make_cache: Any) -> None:
    """``lb.wait_layer(i)`` of a FULL+SWA+Mamba load-back from the forward's thread: once it
    returns, the FULL layer i, the SWA window and the Mamba state are in place (CPU pools)."""
    cache, want, req, lb = await begin_hybrid_load(make_cache)
    hy = cache.hybrid
    layers = cache.device_pool.shape.num_layers
    seen: dict[Any, Any] = {}

    def forward() -> None:
        for layer in range(layers):
            lb.wait_layer(layer, timeout=30.0)
            seen[layer] = cache.device_pool.kv[layer].clone()
            if layer == 0:
                seen["swa"] = hy.swa_pool.kv.clone()
                seen["mamba"] = hy.mamba_pool.states.clone()

    await asyncio.wait_for(asyncio.to_thread(forward), 30.0)
    await asyncio.wait_for(cache.finish_load_back_request(req, lb), 30.0)
    assert_same(served(cache, req.slots), want)
    slots = torch.from_numpy(req.slots)
    for layer in range(layers):
        assert torch.equal(seen[layer][:, slots], cache.device_pool.kv[layer][:, slots])
    swa = torch.from_numpy(hy.swa_map.translate(req.slots))
    assert torch.equal(seen["swa"][:, :, swa], hy.swa_pool.kv[:, :, swa])
    m = cache.match_prefix(TOKENS, cow_mamba=True)
    assert torch.equal(seen["mamba"][m.mamba_cow_slot], hy.mamba_pool.states[m.mamba_cow_slot])
    cache.abort_req(req)


async def test_a_layer_mapped_hybrid_load_back_serves_each_model_layer(make_cache: Any) -> None:
    """``CacheConfig.layer_components``: the load-back copies SWA layer by layer, and
    ``lb.layer(i)`` / ``lb.wait_layer(i)`` wait for what model layer ``i`` reads — its own
    FULL or SWA layer, or the whole Mamba state copy; each read is the KV that was cached."""
    from asynccache.transfers.handles import LayerwiseHandle

    layers = ("swa", "full", "mamba", "swa", "full")
    cache, want, req, lb = await begin_hybrid_load(make_cache, swa_layers=2,
                                                   layer_components=layers)
    hy = cache.hybrid
    assert lb.group.num_layers == 5
    swa_load = lb.group.part("swa")
    assert isinstance(swa_load, LayerwiseHandle) and swa_load.num_layers == 2
    swa_slots = torch.from_numpy(hy.swa_map.translate(req.slots[-len(TOKENS):]))
    seen: dict[Any, Any] = {}

    def forward() -> None:
        counts = dict.fromkeys(("full", "swa"), 0)
        for i, kind in enumerate(layers):
            lb.wait_layer(i, timeout=30.0)
            if kind == "mamba":
                seen[kind] = hy.mamba_pool.states.clone()
                continue
            k = counts[kind]
            counts[kind] += 1
            pool = cache.device_pool.kv if kind == "full" else hy.swa_pool.kv
            seen[kind, k] = pool[k].clone()

    await asyncio.wait_for(asyncio.to_thread(forward), 30.0)
    for i in range(len(layers)):
        await asyncio.wait_for(lb.layer(i), 30.0)
    await asyncio.wait_for(cache.finish_load_back_request(req, lb), 30.0)
    assert_same(served(cache, req.slots), want)
    slots = torch.from_numpy(req.slots)
    for k in range(2):
        assert torch.equal(seen["full", k][:, slots], cache.device_pool.kv[k][:, slots])
        assert torch.equal(seen["swa", k][:, swa_slots], hy.swa_pool.kv[k][:, swa_slots])
    m = cache.match_prefix(TOKENS, cow_mamba=True)
    assert torch.equal(seen["mamba"][m.mamba_cow_slot], hy.mamba_pool.states[m.mamba_cow_slot])
    cache.abort_req(req)


async def test_layer_components_must_match_the_pools(make_cache: Any) -> None:
    from asynccache.config import CacheConfig
    from asynccache.errors import ConfigError

    base = {**BASE, **COMBOS["full+swa+mamba"], "num_layers": 2, "swa_layers": 2}
    ok = CacheConfig(**base, layer_components=["swa", "full", "mamba", "swa", "full"])
    assert ok.layer_components == ("swa", "full", "mamba", "swa", "full")
    for bad, msg in (
        (("full", "swa", "mamba", "swa"), r"1 'full' layers; expected 2 \(num_layers=2\)"),
        (("full", "swa", "full", "mamba"), r"1 'swa' layers; expected 2 \(swa_layers=2\)"),
        (("full", "swa", "full", "swa"), "0 'mamba' layers with mamba_states=4"),
        (("full", "swa", "full", "swa", "moe"), "layer 4 is 'moe'"),
        ("fsfs", "a layer map is a non-empty sequence"),
    ):
        with pytest.raises(ConfigError, match=msg):
            CacheConfig(**base, layer_components=bad)
    with pytest.raises(ConfigError, match=r"sliding_window=0: no SWA component"):
        CacheConfig(**{**base, "sliding_window": 0}, layer_components=("full", "swa", "full",
                                                                       "mamba"))


async def test_a_load_of_components_only_checks_the_layer_index(make_cache: Any) -> None:
    """With the FULL KV on device and only the SWA window to load (no layer map), ``layer(i)``
    / ``wait_layer(i)`` wait for the whole load — and still refuse a layer the model does not
    have, naming it, like a load with a FULL part does."""
    from asynccache.errors import InvalidInputError
    from asynccache.transfers.hybrid_copies import GroupHandle

    cache, want = await cache_and_write(make_cache, "full+swa")
    cache.evict(0, swa_num_tokens=len(TOKENS))  # the SWA side goes; FULL stays on device
    req = cache.admit([*TOKENS, 1])
    lb = cache.begin_load_back_request(req)
    assert lb is not None and type(lb.group) is GroupHandle
    for bad in (2, -1, 7):
        with pytest.raises(InvalidInputError, match=rf"layer {bad} out of range \[0, 2\)"):
            lb.layer(bad)
        with pytest.raises(InvalidInputError, match=rf"layer {bad} out of range \[0, 2\)"):
            lb.wait_layer(bad)
    for i in range(2):
        await asyncio.wait_for(lb.layer(i), 30.0)
    await asyncio.wait_for(cache.finish_load_back_request(req, lb), 30.0)
    assert_same(served(cache, req.slots), want)
    cache.abort_req(req)
