"""Fixtures of the buffer-only host mode tests.

Everything is real: CPU torch pools, the real copy thread, a real :class:`asynccache.storage.file.FileBackend`
under ``tmp_path`` (optionally wrapped in the real :class:`asynccache.storage.faults.FaultInjectingBackend`)
and, for the S3 test, a real SeaweedFS server on 127.0.0.1 (skipped with the reason when the
``weed`` binary is missing).

The KV, key and serving helpers are the L3 tests' (``tests/l3/conftest.py``, loaded as a plain
module); the ``kit`` here adds the buffer-mode at-rest checks. ``make_cache(**overrides)``
builds and starts a buffer-only cache; at teardown (unless ``strict=False``) every cache it made
is drained, checked at rest, detached and closed with both pools back to zero.
"""

from __future__ import annotations

import asyncio
import faulthandler
import importlib.util
import secrets
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from asynccache import CacheConfig, HierarchicalCache

_spec = importlib.util.spec_from_file_location(
    "_asynccache_l3_test_helpers", Path(__file__).parent.parent / "l3" / "conftest.py")
assert _spec is not None and _spec.loader is not None
l3 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(l3)

TIMEOUT = l3.TIMEOUT
PS = l3.PS

BASE: dict[str, Any] = {**l3.BASE, "host_mode": "buffer_only", "device_tokens": 1024,
                        "host_tokens": 1024}


def config(**overrides: Any) -> CacheConfig:
    return CacheConfig(**{**BASE, **overrides})


def assert_at_rest(cache: HierarchicalCache, *, own_receipts: int = 0) -> None:
    """Nothing in flight, no staging held, accounting balances, only ``own_receipts`` locks."""
    assert cache.in_flight == 0
    assert cache.tree.pending_ops == 0
    cache.sanity_check()
    assert cache.tree.held_locks == own_receipts, (
        f"{cache.tree.held_locks} lock receipts held, expected {own_receipts}")
    assert cache.host_size == 0, "a buffer-only tree never holds host copies"
    p = cache.storage
    if p is not None:
        assert not p.reads.busy and not p._copies and not p._writes
        assert p.write_staged == 0
        assert p.occupied == p.reads.staged_tokens
        assert cache.host_pool.allocator.used_size == p.occupied
    else:
        assert cache.host_pool.allocator.used_size == 0
    assert cache.host_in_flight == cache.host_pool.allocator.used_size


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
    assert cache.host_pool is not None and cache.host_pool.allocator.used_size == 0
    if engine is not None:
        assert not [t.name for t in engine.threads if t.is_alive()]


@pytest.fixture(autouse=True)
def hang_guard() -> Iterator[None]:
    faulthandler.dump_traceback_later(120.0, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
async def make_cache(backends: list[Any], cache_factory: Any,
                     ) -> AsyncIterator[Callable[..., Awaitable[HierarchicalCache]]]:
    async with cache_factory(config, quiesce, close_and_check) as make:
        yield make


async def serve_plain(cache: HierarchicalCache, seq: Any) -> tuple[int, int]:
    """Serve one request with no timeouts around its awaits (so a cancellation sweep reaches
    each of them): prefetch (wait_complete), load back, compute the rest, check every token,
    finish; a failure or cancellation aborts it. Returns (fetched, loaded) tokens."""
    req = cache.admit(seq)
    try:
        got = await cache.prefetch_request(req, policy="wait_complete")
        loaded = await cache.load_back_request(req)
        await l3.compute_rest(cache, req)
        l3.assert_kv(cache, seq, req.slots, "served")
    except BaseException:
        if not req.finished:
            cache.abort_req(req)
        raise
    cache.cache_finished_req(req)
    return got, loaded


@pytest.fixture
def kit() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        PS=PS,
        BASE=BASE,
        TIMEOUT=TIMEOUT,
        tokens=l3.tokens,
        expected=l3.expected,
        assert_kv=l3.assert_kv,
        page_keys=l3.page_keys,
        object_path=l3.object_path,
        counter=l3.counter,
        outcomes=l3.outcomes,
        compute_rest=l3.compute_rest,
        key_tokens=l3._key_tokens,
        write_sequences=l3.write_sequences,
        serve=l3.serve,
        serve_plain=serve_plain,
        assert_at_rest=assert_at_rest,
        quiesce=quiesce,
        config=config,
        new_prefix=lambda: f"buffer-{secrets.token_hex(6)}",
    )
