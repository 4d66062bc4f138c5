"""Prometheus metrics of the cache (exact counts) and KV events through the msgpack encoder."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from asynccache import RadixKey
from asynccache.kvevents import decode_batch, encode_batch, event_from_wire, event_to_wire
from asynccache.metrics import CacheMetrics
from asynccache.tree import AllBlocksCleared, BlockRemoved, BlockStored, Medium


def val(cache, name, labels=None):
    return cache.metrics.registry.get_sample_value(name, labels or {})


async def test_write_back_host_pressure_drops_are_counted(make_cache, kit):
    cache = await make_cache(write_policy="write_back", device_tokens=16, host_tokens=8)
    model = kit.KVModel.of(cache)
    a, b = list(range(1, 9)), list(range(101, 109))
    await kit.serve(cache, model, a)
    await kit.serve(cache, model, b)
    await asyncio.wait_for(cache.evict_async(16), kit.TIMEOUT)
    assert cache.device_available == 16
    # a was written back (the host holds 8 tokens), b found no host room and was dropped.
    assert cache.host_size == 8
    assert cache.match_prefix(a).host_hit_length == 8
    assert cache.match_prefix(b).host_hit_length == 0
    assert val(cache, "asynccache_evicted_tokens_total") == 16
    assert val(cache, "asynccache_dropped_tokens_total", {"reason": "host_pressure"}) == 8
    assert val(cache, "asynccache_dropped_tokens_total", {"reason": "backup_failed"}) == 0
    assert val(cache, "asynccache_backup_tokens_total") == 8
    assert val(cache, "asynccache_backup_bytes_total") == 8 * cache.shape.bytes_per_token
    await kit.quiesce_and_check(cache)


async def test_write_back_under_host_pressure_evicts_host_leaves_first(make_cache, kit):
    """One victim at a time: the second write-back evicts the first's host copy instead of
    dropping anything."""
    cache = await make_cache(write_policy="write_back", device_tokens=16, host_tokens=8)
    model = kit.KVModel.of(cache)
    a, b = list(range(1, 9)), list(range(101, 109))
    await kit.serve(cache, model, a)
    await kit.serve(cache, model, b)
    assert await cache.evict_async(8) == 8  # a (least recently used) written back
    assert await cache.evict_async(8) == 8  # b written back, a's host copy evicted for it
    assert cache.match_prefix(a).host_hit_length == 0
    assert cache.match_prefix(b).host_hit_length == 8
    assert val(cache, "asynccache_dropped_tokens_total", {"reason": "host_pressure"}) == 0
    assert val(cache, "asynccache_backup_tokens_total") == 16
    assert val(cache, "asynccache_evicted_tokens_total") == 16
    req = cache.admit(b)
    assert await cache.load_back_request(req) == 8
    model.check(cache, b, req.slots)
    cache.cache_finished_req(req)
    await kit.quiesce_and_check(cache)


async def test_gauges(make_cache, kit):
    cache = await make_cache(write_policy="write_through", host_tokens=128)
    model = kit.KVModel.of(cache)
    await kit.serve(cache, model, list(range(1, 17)))
    held = await kit.serve(cache, model, list(range(1, 9)) + list(range(50, 62)), finish=False)
    await cache.flush()
    cache.refresh_gauges()
    # the running request pins its cached prefix [1..8]; its own 12 tokens are not cached yet
    assert val(cache, "asynccache_protected_tokens") == 8
    assert val(cache, "asynccache_evictable_tokens") == 8  # [9..16]
    assert val(cache, "asynccache_host_used_tokens") == 16
    assert val(cache, "asynccache_host_total_tokens") == 128
    cache.cache_finished_req(held)
    cache.refresh_gauges()
    # its new leaf [50..61] and (as for any lock) the leaf's ancestors [1..8] stay pinned by
    # the write-through copy until it is committed
    assert val(cache, "asynccache_protected_tokens") == 20
    await cache.flush()
    cache.refresh_gauges()
    assert val(cache, "asynccache_host_used_tokens") == 28
    assert val(cache, "asynccache_protected_tokens") == 0
    assert val(cache, "asynccache_evictable_tokens") == 28
    await kit.quiesce_and_check(cache)


async def test_each_cache_has_its_own_registry(make_cache, kit):
    one = await make_cache(write_policy="write_through")
    two = await make_cache(write_policy="write_through")
    assert one.metrics.registry is not two.metrics.registry
    await kit.serve(one, kit.KVModel.of(one), list(range(1, 9)))
    await one.flush()
    assert val(one, "asynccache_backup_tokens_total") == 8
    assert val(two, "asynccache_backup_tokens_total") == 0
    shared = CacheMetrics()
    from asynccache import HierarchicalCache

    three = HierarchicalCache(kit.config(), metrics=shared)
    assert three.metrics is shared
    await kit.quiesce_and_check(one)
    await kit.quiesce_and_check(two)


async def _event_flow(make_cache, kit):
    """A flow that emits every kind of event, in the default and in two other namespaces."""
    cache = await make_cache(write_policy="write_through", page_size=2, enable_kv_events=True)
    model = kit.KVModel.of(cache)
    await kit.serve(cache, model, [1, 2, 3, 4, 5])
    await kit.serve(cache, model, [1, 2, 7, 8])
    for key in (RadixKey([1, 2, 3, 4], extra_key="lora-a"),
                RadixKey([1, 2, 3, 4], extra_key="lora-a", cache_salt="s1"),
                RadixKey([9, 9], cache_salt="s2")):
        req = cache.admit(key)
        new = await cache.extend(req, len(key))
        cache.write_kv(new, model.expected(key.tokens))
        cache.cache_finished_req(req)
    await cache.flush()
    await cache.evict_async(10**6)
    r = cache.admit([1, 2, 3, 4, 5])
    await cache.load_back_request(r)
    cache.cache_finished_req(r)
    cache.evict_host(10**6)
    events = cache.take_events()
    await kit.quiesce_and_check(cache)
    await cache.aclose()
    events += cache.take_events()
    return events


async def test_events_cover_every_transition_and_namespace(make_cache, kit):
    events = await _event_flow(make_cache, kit)
    kinds = {(type(e).__name__, getattr(e, "medium", None)) for e in events}
    assert kinds == {
        ("BlockStored", Medium.GPU), ("BlockStored", Medium.CPU_PINNED),
        ("BlockRemoved", Medium.GPU), ("BlockRemoved", Medium.CPU_PINNED),
        ("AllBlocksCleared", None),
    }
    assert isinstance(events[-1], AllBlocksCleared)
    first = events[0]
    assert first == BlockStored(block_hashes=kit.event_hashes([1, 2, 3, 4], 2),
                                parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
                                medium=Medium.GPU)
    gpu = [e for e in events if isinstance(e, BlockStored) and e.medium is Medium.GPU]
    names = {(e.lora_name, e.cache_salt) for e in gpu}
    assert names == {(None, None), ("lora-a", None), ("lora-a", "s1"), (None, "s2")}
    default = set(kit.event_hashes([1, 2, 3, 4], 2))
    for e in gpu:
        if e.lora_name or e.cache_salt:  # namespaced: never the default namespace's hashes
            assert not default & set(e.block_hashes), e
    lora_a = next(e for e in gpu if (e.lora_name, e.cache_salt) == ("lora-a", None))
    lora_s = next(e for e in gpu if (e.lora_name, e.cache_salt) == ("lora-a", "s1"))
    assert set(lora_a.block_hashes).isdisjoint(lora_s.block_hashes)


async def test_kv_events_msgpack_round_trip(make_cache, kit):
    events = await _event_flow(make_cache, kit)
    assert len(events) >= 8
    data = encode_batch(events, ts=1234.5, attn_dp_rank=3)
    ts, back, rank = decode_batch(data)
    assert (ts, rank) == (1234.5, 3)
    assert back == events
    for a, b in zip(back, events, strict=True):
        assert type(a) is type(b)
        if hasattr(b, "medium"):
            assert a.medium is b.medium
    # The documented wire shape: [ts, [tagged map, ...], rank]; None optionals left out.
    raw = msgpack.unpackb(data, raw=False)
    assert raw[0] == 1234.5 and raw[2] == 3
    stored = next(e for e in events if isinstance(e, BlockStored) and e.cache_salt == "s1")
    wire = next(w for w in raw[1] if w["type"] == "BlockStored" and w.get("cache_salt") == "s1")
    assert wire == {"type": "BlockStored", "block_hashes": stored.block_hashes,
                    "parent_block_hash": stored.parent_block_hash,
                    "token_ids": stored.token_ids, "block_size": 2, "lora_id": None,
                    "medium": "GPU", "cache_salt": "s1", "lora_name": "lora-a"}
    assert {"type": "AllBlocksCleared"} in raw[1]
    removed = next(w for w in raw[1] if w["type"] == "BlockRemoved")
    assert set(removed) == {"type", "block_hashes", "medium"}
    assert removed["medium"] in ("GPU", "CPU_PINNED")


def test_encode_batch_edge_cases():
    ts, evs, rank = decode_batch(encode_batch([]))
    assert evs == [] and rank is None and isinstance(ts, float)
    big = BlockStored(block_hashes=[-(2**63), 2**63 - 1], parent_block_hash=-1,
                      token_ids=[0, 2**32 - 1], block_size=1, medium=Medium.DISK, lora_id=7,
                      session_id="sess")
    batch = [big, BlockRemoved([5], Medium.EXTERNAL), AllBlocksCleared()]
    assert decode_batch(encode_batch(batch, ts=0.0, attn_dp_rank=0)) == (0.0, batch, 0)
    assert event_from_wire(event_to_wire(big)) == big
    with pytest.raises(TypeError):
        event_to_wire("BlockStored")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Bogus"):
        event_from_wire({"type": "Bogus"})
    with pytest.raises(ValueError, match="tagged map"):
        event_from_wire(["BlockRemoved", [5], "GPU"])  # type: ignore[arg-type]


def _sglang_kv_events():
    """SGLang's own event classes (the real package, installed CPU-only by
    scripts/install_sglang_cpu.sh); skipped with the reason when it cannot be imported."""
    try:
        from sglang.srt.disaggregation import kv_events
    except Exception as exc:  # not installed, or a dependency of its import chain is missing
        pytest.skip(f"SGLang's kv_events does not import here ({exc!r}); "
                    "run scripts/install_sglang_cpu.sh")
    return kv_events


async def test_sglang_decodes_our_events_field_by_field(make_cache, kit):
    sg = _sglang_kv_events()
    import msgspec

    events = await _event_flow(make_cache, kit)
    data = encode_batch(events, ts=99.5, attn_dp_rank=2)
    batch = msgspec.msgpack.decode(data, type=sg.KVEventBatch)
    assert (batch.ts, batch.attn_dp_rank, len(batch.events)) == (99.5, 2, len(events))
    fields = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                              "lora_id", "cache_salt", "session_id", "lora_name"),
              "BlockRemoved": ("block_hashes",), "AllBlocksCleared": ()}
    for theirs, ours in zip(batch.events, events, strict=True):
        name = type(ours).__name__
        assert type(theirs).__name__ == name
        for f in fields[name]:
            assert getattr(theirs, f) == getattr(ours, f), (name, f)
        if name != "AllBlocksCleared":
            assert theirs.medium == ours.medium.value
    # and back: SGLang's encoder's bytes decode to the same events here
    assert decode_batch(msgspec.msgpack.encode(batch)) == (99.5, events, 2)
