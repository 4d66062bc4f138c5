"""The replay verifies the KV it serves: a corrupted host page fails the run naming the request;
storage corruption is caught by checksums and costs hits, never correctness."""

from __future__ import annotations

import asyncio
import hashlib
import json
import struct
import threading

import numpy as np
import pytest
import torch

from asynccache import CacheConfig
from asynccache.l3 import StoragePolicy
from asynccache.replay.driver import KVMismatchError, Replayer, ReplayOptions
from asynccache.replay.formats import TraceRequest, read_tokens

TIMEOUT = 60.0


def _config(**kw) -> CacheConfig:
    base = {"page_size": 4, "num_layers": 2, "num_heads": 2, "head_dim": 8, "dtype": "float16",
            "device_tokens": 128, "host_tokens": 512, "write_policy": "write_through",
            "load_back_threshold": 1}
    return CacheConfig(**{**base, **kw})


def _toks(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, size=n).astype(np.uint32)


A, B = _toks(1, 64), _toks(2, 96)
TRACE = [TraceRequest("r1", 0.0, A), TraceRequest("r2", 0.0, B), TraceRequest("r3", 0.0, A)]


def _copy_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("asynccache-copy") and t.is_alive()}


def _run(replayer: Replayer, trace):
    return asyncio.run(asyncio.wait_for(replayer.run(trace), TIMEOUT))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_a_clean_run_verifies_every_loaded_token(layout) -> None:
    """r2 pushes r1's prompt out of the 128-token device pool into host memory; r3 loads it
    back and every loaded token is checked."""
    stats = _run(Replayer(_config(host_layout=layout), ReplayOptions(max_in_flight=1)), TRACE)
    assert (stats.completed, stats.rejected) == (3, 0)
    assert (stats.device_hit_tokens, stats.host_hit_tokens, stats.storage_hit_tokens) == (0, 64, 0)
    assert stats.verified_tokens == 64
    assert stats.computed_tokens == 64 + 96
    assert stats.bound_hit_tokens == 64


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_corrupted_host_page_fails_the_run_naming_the_request(layout) -> None:
    baseline = _copy_threads()
    done = []

    def corrupt_after_r2(n: int) -> None:
        done.append(n)
        if len(done) != 2:
            return
        cache = replayer.cache
        host_only = [n for n in cache.tree.iter_nodes()
                     if n.value is None and n.host_value is not None]
        assert len(host_only) == 1  # r1's prompt, demoted when r2 needed the room
        slots = cache.tree.host_slots_of(host_only[0].id)
        assert len(slots) == 64
        garbage = torch.full((cache.host_pool.page_bytes,), 0x3C, dtype=torch.uint8)
        cache.host_pool.write_page(int(slots[8]), garbage)  # tokens 8..11 of r1's prompt

    replayer = Replayer(_config(host_layout=layout), ReplayOptions(max_in_flight=1),
                        progress=corrupt_after_r2)
    with pytest.raises(KVMismatchError, match=r"request r3: KV served for token position 8 "):
        _run(replayer, TRACE)
    assert replayer.cache.device_pool.allocator.used_size == 0  # the cache still shut down
    assert not (_copy_threads() - baseline)


def test_verify_all_checks_device_hits_too() -> None:
    trace = [TraceRequest("r1", 0.0, A), TraceRequest("r2", 0.0, A)]

    def corrupt_device(n: int) -> None:
        cache = replayer.cache
        node = next(iter(cache.tree.iter_nodes()))
        slots = np.asarray(node.value[:4])
        cache.write_kv(slots, torch.zeros((2, 2, 4, 2, 8), dtype=torch.float16))

    for verify, fails in (("loaded", False), ("all", True)):
        replayer = Replayer(_config(), ReplayOptions(max_in_flight=1, verify=verify),
                            progress=corrupt_device)
        if fails:
            with pytest.raises(KVMismatchError, match=r"request r2: KV served for token position 0"):
                _run(replayer, trace)
        else:  # a device hit is trusted unless asked to check it
            assert _run(replayer, trace).device_hit_tokens == 64


def test_storage_round_trip_between_replays_and_corruption_on_disk(tmp_path) -> None:
    """Replay 1 writes through to a file store; replay 2 (a new cache) is served from it, every
    fetched token verified; a damaged object makes replay 3 fetch less, not wrong KV."""
    root = tmp_path / "l3"
    opts = ReplayOptions(max_in_flight=1, storage_url=f"file://{root}",
                         storage_policy=StoragePolicy(prefetch_threshold=16,
                                                      prefetch_policy="wait_complete"))
    trace = [TraceRequest("a", 0.0, A), TraceRequest("b", 0.0, B[:64])]
    first = _run(Replayer(_config(device_tokens=256), opts), trace)
    assert first.storage_hit_tokens == 0
    assert first.extra["storage_write_tokens"] == 128

    second = _run(Replayer(_config(device_tokens=256), opts), trace)
    assert (second.device_hit_tokens, second.host_hit_tokens, second.storage_hit_tokens) == (
        0, 0, 128)
    assert second.verified_tokens == 128 and second.computed_tokens == 0
    assert second.extra["prefetched_tokens"] == 128

    # Flip one payload byte of page 5 of "a" on disk.
    objects = sorted(p for p in root.rglob("*.kv"))
    assert len(objects) == 32
    prev = b""
    for i in range(6):
        prev = hashlib.sha256(prev + struct.pack("<4I", *A[4 * i : 4 * i + 4].tolist())).digest()
    (victim,) = [p for p in objects if p.name.startswith(prev.hex())]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))

    third = _run(Replayer(_config(device_tokens=256), opts), trace)
    assert third.storage_hit_tokens == 20 + 64
    assert third.verified_tokens == 20 + 64
    assert third.computed_tokens == 64 - 20


def test_namespaces_are_isolated_in_replay(tmp_path) -> None:
    p = tmp_path / "t.jsonl"
    toks = _toks(3, 40).tolist()
    p.write_text("".join(json.dumps(x) + "\n" for x in [
        {"tokens": toks, "namespace": "a"},
        {"tokens": toks, "namespace": "b"},
        {"tokens": toks},
        {"tokens": toks, "namespace": "a"},
    ]))
    stats = _run(Replayer(_config(device_tokens=512), ReplayOptions(max_in_flight=1)),
                 read_tokens(p))
    assert stats.device_hit_tokens == stats.bound_hit_tokens == 40


@pytest.mark.parametrize("host_tokens", [0, 512])
def test_a_replay_keeps_no_request_after_admitting_it(host_tokens) -> None:
    """Page ids hashed ahead (side work) are dropped at admission; nothing is left queued."""
    replayer = Replayer(_config(host_tokens=host_tokens), ReplayOptions(max_in_flight=1))
    stats = _run(replayer, TRACE * 30)
    assert stats.completed == 90
    assert replayer.driver._ids == {} and not replayer.driver._side


def test_a_store_written_with_other_kv_is_never_served_to_the_replay(tmp_path) -> None:
    """Objects of the same tokens, model name and geometry written by a cache that is not this
    replay (an engine, or a replay of an older KV pattern) hold other KV: the replay names its
    objects with its pattern's tag (``kvpattern.STORAGE_TAG``), so it misses them instead of
    failing verification."""
    from asynccache import HierarchicalCache
    from asynccache.storage.factory import open_backend

    root = tmp_path / "l3"
    url = f"file://{root}"
    policy = StoragePolicy(prefetch_threshold=16, prefetch_policy="wait_complete")

    async def write_foreign() -> None:
        async with HierarchicalCache(_config(device_tokens=256)) as cache:
            backend = await open_backend(url, cache.storage_layout())
            try:
                cache.attach_storage(backend, policy)
                req = cache.admit(A.tolist())
                await cache.extend(req, len(A))  # KV left as allocated: not the replay's
                cache.cache_finished_req(req)
                await cache.flush()
                await cache.storage.drain()
                await cache.detach_storage()
            finally:
                await backend.aclose()

    asyncio.run(asyncio.wait_for(write_foreign(), TIMEOUT))
    foreign = sorted(p.name for p in root.rglob("*.kv"))
    assert len(foreign) == 16
    opts = ReplayOptions(max_in_flight=1, storage_url=url, storage_policy=policy)
    stats = _run(Replayer(_config(device_tokens=256), opts), [TraceRequest("a", 0.0, A)])
    assert (stats.storage_hit_tokens, stats.computed_tokens) == (0, 64)
    names = sorted(p.name for p in root.rglob("*.kv"))
    assert len(names) == 32 and set(foreign) < set(names)  # its own 16, named apart
