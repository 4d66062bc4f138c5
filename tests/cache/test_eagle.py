"""EAGLE caches end to end (CacheConfig(eagle=True)): a scheduler passes raw tokens; the cache
keys by bigrams, so a prompt of N + 1 tokens caches N positions of draft KV. Real pools, the
real copy engine, a real file backend."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import struct
from typing import Any

import numpy as np
import pytest

from asynccache import HierarchicalCache
from asynccache.errors import InvalidInputError
from asynccache.kvevents import decode_batch, encode_batch
from asynccache.l3 import StoragePolicy
from asynccache.storage.file import FileBackend
from asynccache.tree import BigramKey, RadixKey

PS = 4
EAGLE = {"eagle": True, "write_policy": "write_through", "page_size": PS}


def bigram_ids(raw: list[int]) -> list[int]:
    """One id per position for the KV model: the draft KV at position i depends on t_i and
    t_i+1 (the model chains every position before it too). The last raw token's position has
    no next token yet: it gets its own id (a position the cache never keeps)."""
    nxt = [*raw[1:], 0xFFFFFFFF]
    return [(a * 1_000_003 + b) & 0xFFFFFFFF for a, b in zip(raw, nxt, strict=True)]


def bigram_keys(raw: list[int], page_size: int = PS) -> list[str]:
    """Storage keys of a bigram prompt, computed without the tree: a SHA-256 chain over pages
    of u32le(t_i) u32le(t_i+1) (behavior.md §1.14)."""
    pairs = list(itertools.pairwise(raw))
    out, prev = [], b""
    for p in range(len(pairs) // page_size):
        body = b"".join(struct.pack("<II", a, b)
                        for a, b in pairs[p * page_size : (p + 1) * page_size])
        prev = hashlib.sha256(prev + body).digest()
        out.append(prev.hex())
    return out


async def serve(cache: HierarchicalCache, model: Any, raw: list[int], *,
                chunk: int | None = None) -> tuple[int, int]:
    """A scheduler's request over raw tokens: admit, load back, check the served prefix, compute
    every raw position (in chunks with cache_unfinished_req between), finish. Returns (device
    prefix at admission, prefix after the load-back)."""
    req = cache.admit(raw)
    try:
        admitted = req.prefix_len
        await cache.load_back_request(req)
        ids = bigram_ids(raw)
        model.check(cache, ids, req.slots[: req.prefix_len], "served bigram prefix")
        step = chunk or len(raw)
        while req.computed < len(raw):
            lo = req.computed
            hi = min(len(raw), lo + step)
            new = await cache.extend(req, hi - lo)
            cache.write_kv(new, model.expected(ids, lo, hi))
            if hi < len(raw):
                cache.cache_unfinished_req(req)
                model.check(cache, ids, req.slots, "slots after cache_unfinished_req")
    except BaseException:
        if not req.finished:
            cache.abort_req(req)
        raise
    loaded = req.prefix_len
    cache.cache_finished_req(req)
    return admitted, loaded


async def test_requests_pass_raw_tokens_and_cache_bigram_positions(make_cache, kit) -> None:
    cache = await make_cache(**EAGLE)
    model = kit.KVModel.of(cache)
    a = list(range(100, 118))  # 18 raw tokens: 17 bigrams: 16 cached (4 pages)
    assert await serve(cache, model, a) == (0, 0)
    await cache.flush()  # (the write-through copies pin the nodes until they land)
    assert cache.evictable_size == 16
    req = cache.admit(a)
    assert isinstance(req.key, BigramKey) and len(req.key) == 17 and req.key.tokens == a
    assert req.prefix_len == 16
    model.check(cache, bigram_ids(a), req.slots, "device hit")
    cache.abort_req(req)
    # Raw [100..108] then other tokens: 8 shared bigrams (two pages); a token tree would share 9.
    b = [*a[:9], 7, 8, 9, 10, 11]
    assert await serve(cache, model, b, chunk=3) == (8, 8)
    # Exactly one raw token more than a page of bigrams is needed to cache the page.
    assert cache.match_prefix(a[:5]).device_prefix_len == 4
    assert cache.match_prefix(a[:4]).device_prefix_len == 0
    assert cache.match_prefix(RadixKey(a[:9])).device_prefix_len == 8
    assert cache.match_prefix(BigramKey(a[:9])).device_prefix_len == 8
    cache.sanity_check()


async def test_chunked_prefill_inserts_bigrams_the_request_knows(make_cache, kit) -> None:
    cache = await make_cache(**EAGLE)
    model = kit.KVModel.of(cache)
    raw = list(range(1, 23))  # 22 raw tokens
    req = cache.admit(raw)
    new = await cache.extend(req, 9)
    ids = bigram_ids(raw)
    cache.write_kv(new, model.expected(ids, 0, 9))
    cache.cache_unfinished_req(req)  # 9 positions computed: bigrams 0..8 known; 8 cached
    assert (req.prefix_len, req.computed) == (8, 9)
    model.check(cache, ids, req.slots, "after the first chunk")
    new = await cache.extend(req, 13)
    cache.write_kv(new, model.expected(ids, 9, 22))
    cache.cache_finished_req(req)  # 21 bigrams: 20 cached; slots 20, 21 freed
    await cache.flush()
    assert cache.evictable_size == 20
    m = cache.match_prefix(raw)
    assert m.device_prefix_len == 20
    model.check(cache, ids, m.device_indices, "cached prompt")
    cache.sanity_check()


async def test_host_tier_demotes_and_loads_back_bigram_pages(make_cache, kit) -> None:
    cache = await make_cache(**EAGLE)
    model = kit.KVModel.of(cache)
    raw = list(range(500, 526))  # 25 bigrams: 24 cached
    await serve(cache, model, raw)
    await cache.flush()
    assert cache.host_size == 24
    assert cache.evict(10**6) == 24
    cache.device_pool.kv.zero_()  # what comes back must come from the host copy
    req = cache.admit(raw)
    assert (req.prefix_len, req.host_hit_length) == (0, 24)
    assert await cache.load_back_request(req) == 24
    model.check(cache, bigram_ids(raw), req.slots, "loaded back")
    cache.abort_req(req)
    # The same prompt in a namespace: nothing shared.
    req = cache.admit(BigramKey(raw, cache_salt="t"))
    assert req.prefix_len + req.host_hit_length == 0
    cache.abort_req(req)


async def test_insert_takes_raw_tokens_with_a_slot_per_token(make_cache) -> None:
    cache = await make_cache(**EAGLE)
    raw = list(range(40, 49))  # 8 bigrams
    slots = await cache.alloc_device(12)
    res = cache.insert(raw, slots[:9])  # one slot per raw token: the last stays ours
    assert (res.prefix_len, res.cached_len) == (0, 8)
    assert cache.match_prefix(raw).device_indices.tolist() == slots[:8].tolist()
    cache.free_device(slots[8:])
    cache.sanity_check()
    plain = await make_cache(page_size=PS)
    with pytest.raises(InvalidInputError, match="bigram key"):
        plain.match_prefix(BigramKey(raw))


async def test_kv_events_and_storage_keys_hash_the_bigram_view(make_cache) -> None:
    cache = await make_cache(**EAGLE, enable_kv_events=True, enable_page_hashes=True)
    raw = list(range(7, 16))  # 8 bigrams: 2 pages
    slots = await cache.alloc_device(8)
    res = cache.insert(BigramKey(raw), slots)
    want = bigram_keys(raw)
    assert cache.tree.page_hashes(res.last_node) == want
    stored = [e for e in cache.take_events() if type(e).__name__ == "BlockStored"]
    assert [h for e in stored for h in e.block_hashes] == [
        int.from_bytes(bytes.fromhex(k)[:8], "big", signed=True) for k in want]
    assert stored[0].token_ids[:2] == [(7, 8), (8, 9)]
    # On the wire the pairs are arrays; decoded, tuples again.
    _, back, _ = decode_batch(encode_batch(stored, ts=1.0))
    assert back == stored
    await cache.flush()


@pytest.mark.parametrize("host_mode", ["cache", "buffer_only"])
async def test_prefetch_of_a_bigram_prompt_from_file_storage(make_cache, kit, tmp_path,
                                                             host_mode) -> None:
    raw = np.random.default_rng(7).integers(0, 50_000, 34).tolist()  # 33 bigrams: 32 stored
    cache = await make_cache(**EAGLE, device_tokens=128, host_tokens=128, host_mode=host_mode)
    backend = FileBackend(tmp_path, cache.storage_layout())
    await backend.start()
    try:
        cache.attach_storage(backend, StoragePolicy(prefetch_threshold=PS,
                                                    prefetch_policy="wait_complete"))
        model = kit.KVModel.of(cache)
        await serve(cache, model, raw)
        await cache.flush()
        await asyncio.wait_for(cache.storage.drain(), kit.TIMEOUT)
        keys = bigram_keys(raw)
        assert len(keys) == 8
        assert await backend.exists_prefix(keys) == 8
        # Storage holds the bigram pages; a token chain over the same prompt names none.
        token_chain = [hashlib.sha256(struct.pack(f"<{PS}I", *raw[:PS])).hexdigest()]
        assert await backend.exists_prefix(token_chain) == 0
        cache.evict(10**6)
        cache.evict_host(10**6)
        assert (cache.tree.node_count, cache.host_size) == (0, 0)
        cache.device_pool.kv.zero_()  # what comes back must come from storage
        req = cache.admit(raw)
        assert req.prefix_len + req.host_hit_length == 0
        assert await cache.prefetch_request(req) == 32
        await cache.load_back_request(req)
        assert req.prefix_len == 32
        model.check(cache, bigram_ids(raw), req.slots, "prefetched from storage")
        cache.abort_req(req)
        cache.sanity_check()
    finally:
        await cache.detach_storage()
        await backend.aclose()


async def test_streaming_session_appends_raw_tokens(make_cache, kit) -> None:
    cache = await make_cache(**EAGLE)
    model = kit.KVModel.of(cache)
    s = cache.stream("conv")
    first = list(range(10, 19))  # 9 raw tokens
    req = s.turn(first)
    new = await cache.extend(req, 9)
    cache.write_kv(new, model.expected(bigram_ids(first), 0, 9))
    s.end_turn()
    second = [30, 31, 32, 33]
    req = s.turn(second)
    assert req.key.tokens == first + second and len(req.key) == 12
    conv = first + second
    ids = bigram_ids(conv)
    # The first turn's last position had no next token; now (18, 30) is known: the draft
    # recomputes that position, as an EAGLE scheduler does.
    cache.write_kv(req.slots[8:9], model.expected(ids, 8, 9))
    new = await cache.extend(req, 4)
    cache.write_kv(new, model.expected(ids, 9, 13))
    s.end_turn()
    s.close()
    m = cache.match_prefix(conv)
    assert m.device_prefix_len == 12
    model.check(cache, ids, m.device_indices, "conversation")


HYBRID = {"eagle": True, "host_tokens": 0, "page_size": 2, "device_tokens": 64,
          "mamba_state_shape": (3,)}


def used(cache: HierarchicalCache) -> tuple[int, int, int]:
    hy = cache.hybrid
    swa = hy.swa_pool.allocator.used_size if hy.swa_pool is not None else 0
    mamba = hy.mamba_pool.used_size if hy.mamba_pool is not None else 0
    return cache.device_pool.allocator.used_size, swa, mamba


async def test_hybrid_swa_mamba_request_flow_on_bigrams(make_cache, kit) -> None:
    """A chunk ends where the request's key still has the next token: the state after its
    computed positions is checkpointed there. The finish caches one bigram fewer than the
    positions computed, so no state lands on the last node (its own state is freed)."""
    cache = await make_cache(**HYBRID, mamba_states=4, sliding_window=4)
    model = kit.KVModel.of(cache)
    raw = list(range(100, 117))  # 17 raw tokens: 16 bigrams
    ids = bigram_ids(raw)
    req = cache.admit(raw)
    new = await cache.extend(req, 8)
    cache.write_kv(new, model.expected(ids, 0, 8))
    cache.cache_unfinished_req(req)  # 8 positions, key[:8] = 8 bigrams: the state fits
    assert (req.prefix_len, used(cache)) == ((8, (8, 8, 2)))
    new = await cache.extend(req, 9)
    cache.write_kv(new, model.expected(ids, 8, 17))
    cache.cache_finished_req(req)  # 16 bigrams cached of 17 positions; slot 16 freed
    assert used(cache) == (16, 16, 1)
    m = cache.match_prefix(raw)
    assert (m.device_prefix_len, m.full_kv_hit_length, m.mamba_branching_seqlen) == (8, 16, 16)
    again = cache.admit([*raw[:9], 1, 2])  # 8 shared bigrams, a state there
    assert again.prefix_len == 8 and again.mamba_state is not None
    model.check(cache, ids, again.slots, "hybrid bigram prefix")
    cache.abort_req(again)
    cache.sanity_check()


async def test_a_state_after_the_last_position_is_not_cached_at_the_bigram_floor(
        make_cache, kit) -> None:
    cache = await make_cache(**HYBRID, mamba_states=4)
    model = kit.KVModel.of(cache)
    raw = list(range(200, 216))  # 16 raw tokens: 15 bigrams, 14 cached
    req = cache.admit(raw)
    new = await cache.extend(req, 16)
    cache.write_kv(new, model.expected(bigram_ids(raw), 0, 16))
    cache.cache_finished_req(req)  # the state is after 16 positions, the insert ends at 14
    assert used(cache) == (14, 0, 0)
    m = cache.match_prefix(raw)
    assert (m.device_prefix_len, m.full_kv_hit_length) == (0, 14)
    cache.sanity_check()


async def test_a_token_past_max_token_id_is_named_at_its_raw_position(make_cache) -> None:
    cache = await make_cache(**EAGLE, max_token_id=1000)
    with pytest.raises(InvalidInputError, match="token id 5000 at position 2 exceeds"):
        cache.admit([1, 2, 5000, 3])
    with pytest.raises(InvalidInputError, match="token id 5000 at position 3 exceeds"):
        cache.match_prefix([1, 2, 3, 5000])
    assert cache.tree.node_count == 0
