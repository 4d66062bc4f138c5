"""Fixtures of the L3 (storage tier inside the engine) tests.

Everything is real: CPU torch pools, the real copy thread, a real :class:`asynccache.storage.file.FileBackend`
on a directory under ``tmp_path`` (optionally wrapped in the real
:class:`asynccache.storage.faults.FaultInjectingBackend`) and, for the S3 tests, a real SeaweedFS server on
127.0.0.1 (skipped with the reason when the ``weed`` binary is missing).

The tests run with ``--import-mode=importlib``, so helpers are handed out through the ``kit``
fixture rather than imported from a sibling module.

``make_cache(**overrides)`` builds and starts a cache; at teardown, for every cache it made
(unless ``strict=False``):

* ``flush()`` and ``storage.drain()`` complete, ``sanity_check()`` passes (tree invariants and
  pool accounting), no lock receipt is held, no prefetch is in flight and the prefetch
  occupancy is back to zero;
* ``detach_storage()`` and ``aclose()`` complete, both allocators are back to ``used_size == 0``
  and no copy thread of the cache is alive.

Backends made by ``make_file_backend`` / ``make_s3_backend`` are closed after the caches.
"""

from __future__ import annotations

import asyncio
import faulthandler
import hashlib
import secrets
import struct
import threading
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from asynccache import CacheConfig, HierarchicalCache
from asynccache.replay.kvgen import expected_kv, mismatched_tokens, same_bits
from asynccache.storage.file import FileBackend
from asynccache.tree import RadixKey

TIMEOUT = 20.0  # seconds: a hang fails the test instead of blocking the run
HANG_GUARD = 120.0  # seconds per test: past it, dump every thread's stack and exit
PS = 4  # page size of every cache here

BASE: dict[str, Any] = {
    "page_size": PS,
    "num_layers": 2,
    "num_heads": 2,
    "head_dim": 8,
    "dtype": "float16",
    "device_tokens": 1024,
    "host_tokens": 2048,
    "host_layout": "page_first",
    "write_policy": "write_through",
    "load_back_threshold": 1,
}


# -- KV and keys ----------------------------------------------------------------------------------


def tokens(seed: int, n: int) -> np.ndarray:
    """``n`` deterministic token ids (distinct seeds give unrelated sequences)."""
    return np.random.default_rng(seed).integers(0, 50_000, size=n).astype(np.uint32)


def expected(cache: HierarchicalCache, toks: Sequence[int], start: int = 0,
             end: int | None = None) -> torch.Tensor:
    """The deterministic KV of ``toks[start:end]`` at their positions."""
    arr = np.asarray(toks, dtype=np.uint32)
    end = len(arr) if end is None else end
    return expected_kv(cache.shape, arr[start:end], np.arange(start, end))


def assert_kv(cache: HierarchicalCache, toks: Sequence[int], slots: Any, what: str) -> None:
    """The device KV in ``slots`` is bit for bit the KV of ``toks[:len(slots)]``."""
    slots = np.asarray(slots)
    got = cache.read_kv(slots)
    want = expected(cache, toks, 0, len(slots))
    if not same_bits(got, want):
        bad = mismatched_tokens(got, want)
        raise AssertionError(f"{what}: wrong KV at token positions {bad[:8].tolist()}")


def page_keys(toks: Sequence[int], page_size: int = PS, namespace: str | None = None) -> list[str]:
    """Storage keys computed independently of the tree (behavior.md §1.14): a SHA-256 chain
    over whole pages of uint32-LE tokens; in a namespace every page hashes the namespace digest,
    the previous digest (32 zero bytes before the first page) and the page."""
    if namespace is None:
        seed = prev = b""
    else:
        raw = namespace.encode()
        part = b"\x01" + len(raw).to_bytes(8, "little") + raw
        seed = hashlib.sha256(b"sglang-cache-namespace-v1" + part + b"\x00").digest()
        prev = bytes(32)
    out = []
    whole = len(toks) - len(toks) % page_size
    for i in range(0, whole, page_size):
        page = struct.pack(f"<{page_size}I", *(int(t) for t in toks[i : i + page_size]))
        prev = hashlib.sha256(seed + prev + page).digest()
        out.append(prev.hex())
    return out


def object_path(backend: FileBackend, key: str) -> Path:
    """Where the file backend keeps page ``key`` (its documented on-disk layout)."""
    return Path(backend.root) / key[:2] / backend.layout.object_name(key)


def counter(cache: HierarchicalCache, name: str, **labels: str) -> float:
    """The value of counter ``name`` (without ``_total``) in the cache's registry."""
    v = cache.metrics.registry.get_sample_value(f"{name}_total", labels or None)
    return 0.0 if v is None else float(v)


def outcomes(cache: HierarchicalCache) -> dict[str, int]:
    """Non-zero prefetch outcome counters."""
    out = {}
    for o in ("issued", "declined_too_short", "declined_rate_limited", "revoked_insufficient",
              "revoked_rate_limited", "revoked_no_host_memory", "completed", "partial", "aborted"):
        v = int(counter(cache, "asynccache_prefetch_outcomes", outcome=o))
        if v:
            out[o] = v
    return out


# -- serving --------------------------------------------------------------------------------------


async def compute_rest(cache: HierarchicalCache, req: Any) -> None:
    """"Compute" the tokens of ``req`` past its device prefix: allocate and write their KV."""
    start = req.computed
    n = len(req.key)
    if n > start:
        new = await cache.extend(req, n - start)
        cache.write_kv(new, expected(cache, _key_tokens(req.key), start, n))


def _key_tokens(key: RadixKey) -> np.ndarray:
    return np.frombuffer(key.data, dtype="<u4").copy()


async def write_sequences(cache: HierarchicalCache, seqs: Sequence[Any]) -> None:
    """Serve each sequence (reusing what is cached), then wait for host and storage copies."""
    for s in seqs:
        req = cache.admit(s)
        try:
            await cache.load_back_request(req)
            assert_kv(cache, _key_tokens(req.key), req.slots[: req.prefix_len], "write prefix")
            await compute_rest(cache, req)
        except BaseException:
            if not req.finished:
                cache.abort_req(req)
            raise
        cache.cache_finished_req(req)
    await asyncio.wait_for(cache.flush(), TIMEOUT)
    if cache.storage is not None:
        await asyncio.wait_for(cache.storage.drain(), TIMEOUT)


async def serve(cache: HierarchicalCache, seq: Any, *, policy: str | None = "wait_complete",
                ) -> types.SimpleNamespace:
    """Serve one request: admit -> prefetch_request -> load_back_request -> verify every token
    of its device prefix bit for bit -> compute the rest -> finish. Returns the figures."""
    req = cache.admit(seq)
    try:
        dev = req.prefix_len
        host = req.host_hit_length
        fetched = await asyncio.wait_for(cache.prefetch_request(req, policy=policy), TIMEOUT)
        # (the prefetch re-matches: under concurrency the device prefix may have grown here)
        grown = req.prefix_len - dev
        loaded = await asyncio.wait_for(cache.load_back_request(req), TIMEOUT)
        toks = _key_tokens(req.key)
        assert req.prefix_len == dev + grown + loaded
        assert_kv(cache, toks, req.slots[: req.prefix_len], f"served prefix of {req.rid}")
        await compute_rest(cache, req)
        assert_kv(cache, toks, req.slots, f"request slots of {req.rid}")
    except BaseException:
        if not req.finished:
            cache.abort_req(req)
        raise
    cache.cache_finished_req(req)
    return types.SimpleNamespace(device=dev, host=host, fetched=fetched, loaded=loaded, req=req,
                                 prefix=req.prefix_len, grown=grown)


# -- at-rest checks -------------------------------------------------------------------------------


def copy_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("asynccache-copy") and t.is_alive()}


def assert_at_rest(cache: HierarchicalCache, *, own_receipts: int = 0) -> None:
    """Nothing in flight, accounting balances, only ``own_receipts`` lock receipts held."""
    assert cache.in_flight == 0
    assert cache.tree.pending_ops == 0
    cache.sanity_check()
    assert cache.tree.held_locks == own_receipts, (
        f"{cache.tree.held_locks} lock receipts held, expected {own_receipts}")
    tier = cache.storage
    if tier is not None:
        assert not tier._prefetches, f"{len(tier._prefetches)} prefetches still registered"
        assert tier._occupied == 0, f"prefetch occupancy {tier._occupied} != 0"
    if cache.host_pool is not None:
        assert cache.host_in_flight == 0
        assert cache.host_pool.allocator.used_size == cache.tree.host_size


async def quiesce(cache: HierarchicalCache) -> None:
    await asyncio.wait_for(cache.flush(), TIMEOUT)
    if cache.storage is not None:
        await asyncio.wait_for(cache.storage.drain(), TIMEOUT)
    await asyncio.wait_for(cache.flush(), TIMEOUT)
    assert_at_rest(cache)


async def close_and_check(cache: HierarchicalCache) -> None:
    engine = cache.copy_engine
    await asyncio.wait_for(cache.detach_storage(), TIMEOUT)
    await asyncio.wait_for(cache.aclose(), TIMEOUT)
    assert cache.device_pool.allocator.used_size == 0
    if cache.host_pool is not None:
        assert cache.host_pool.allocator.used_size == 0
    if engine is not None:
        assert not [t.name for t in engine.threads if t.is_alive()]


def config(**overrides: Any) -> CacheConfig:
    return CacheConfig(**{**BASE, **overrides})


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def hang_guard() -> Iterator[None]:
    """A test stuck outside an ``asyncio.wait_for`` must not block the run."""
    faulthandler.dump_traceback_later(HANG_GUARD, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
async def make_cache(backends: list[Any], cache_factory: Any,
                     ) -> AsyncIterator[Callable[..., Awaitable[HierarchicalCache]]]:
    """(Depends on ``backends`` so that caches are closed before their backends.)"""
    async with cache_factory(config, quiesce, close_and_check) as make:
        yield make


@pytest.fixture
def kit() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        PS=PS,
        BASE=BASE,
        TIMEOUT=TIMEOUT,
        tokens=tokens,
        expected=expected,
        assert_kv=assert_kv,
        page_keys=page_keys,
        object_path=object_path,
        counter=counter,
        outcomes=outcomes,
        compute_rest=compute_rest,
        key_tokens=_key_tokens,
        write_sequences=write_sequences,
        serve=serve,
        assert_at_rest=assert_at_rest,
        quiesce=quiesce,
        config=config,
        new_prefix=lambda: f"l3-{secrets.token_hex(6)}",
    )
