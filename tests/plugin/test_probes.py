"""The reliability probes users repeat on their own deployments (issue 23, "Tests and figures"):
a slow / silent S3 behind a real TCP proxy, a stuck storage file, the crafted-namespace prompt.

Written as a user would, with the plugin's fixtures.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import struct
import time

import pytest

from asynccache import HierarchicalCache
from asynccache.l3 import StoragePolicy
from asynccache.storage import FileBackend, StorageLayout
from asynccache.testing import (
    CacheFactory,
    KVFactory,
    TcpProxy,
    crafted_namespace,
    storage_keys,
    stuck_pages,
)
from asynccache.tree.hashing import chain_digests, chain_seed
from asynccache.tree.keys import Namespace

LAYOUT = StorageLayout(model="probe", page_size=16)
PAGE = 8192


def pages(n: int) -> tuple[list[str], list[bytes]]:
    keys = [hashlib.sha256(f"probe{i}".encode()).hexdigest() for i in range(n)]
    return keys, [hashlib.sha256(k.encode()).digest() * (PAGE // 32) for k in keys]


async def test_s3_behind_a_proxy_that_slows_goes_silent_and_resets(
    asynccache_s3_proxy: TcpProxy,
) -> None:
    proxy = asynccache_s3_proxy
    assert proxy.s3 is not None and proxy.s3.endpoint == proxy.endpoint
    backend = proxy.s3.backend(LAYOUT, timeout_s=1.0, exists_cache_ttl_s=0)
    keys, data = pages(4)
    assert await backend.set_batch(keys, data) == [True] * 4
    bufs = [bytearray(PAGE) for _ in keys]
    assert await backend.get_batch(keys, bufs) == [True] * 4
    assert proxy.stats.bytes_down > 4 * PAGE

    proxy.delay(0.15)  # a slow link: answers come, late (a delay each way, within 1 s)
    started = time.monotonic()
    assert await backend.get_batch(keys[:1], bufs[:1]) == [True]
    assert time.monotonic() - started >= 0.15

    proxy.black_hole()  # silence: every page of the call times out at its deadline
    started = time.monotonic()
    assert await backend.get_batch(keys, bufs) == [False] * 4
    elapsed = time.monotonic() - started
    assert 0.9 <= elapsed < 8.0  # the call's deadline (1 s), not the store's retries
    assert backend.stats()["faults"] == {"get.timeout": 4}
    assert proxy.stats.swallowed > 0

    proxy.pass_through()  # the broken connections are reset; new ones work
    assert await backend.get_batch(keys, bufs) == [True] * 4
    assert [bytes(b) for b in bufs] == data

    proxy.reset()  # pooled connections die under the client: misses at worst, never wrong data
    await asyncio.sleep(0.05)
    bufs = [bytearray(PAGE) for _ in keys]
    ok = await backend.get_batch(keys, bufs)
    assert all(bytes(b) == d for b, d, good in zip(bufs, data, ok, strict=True) if good)
    assert await backend.get_batch(keys, bufs) == [True] * 4
    await backend.clear()


def test_the_proxy_alone(tmp_path) -> None:
    """Any TCP service: an echo server on a real socket."""
    import socket
    import threading

    srv = socket.create_server(("127.0.0.1", 0))

    def echo() -> None:
        conn, _ = srv.accept()
        with conn, contextlib.suppress(OSError):  # the proxy resets it at the end
            while data := conn.recv(1024):
                conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    with TcpProxy(f"127.0.0.1:{srv.getsockname()[1]}") as proxy:
        assert proxy.endpoint == proxy.address
        with socket.create_connection((proxy.host, proxy.port), timeout=2) as c:
            c.sendall(b"ping")
            assert c.recv(16) == b"ping"
            proxy.black_hole()
            c.sendall(b"lost")
            c.settimeout(0.3)
            with pytest.raises(TimeoutError):
                c.recv(16)
            proxy.reset()
            c.settimeout(2)
            with pytest.raises(ConnectionResetError):
                c.recv(16)
    srv.close()


@pytest.mark.asynccache_config(write_policy="write_through")
async def test_a_stuck_storage_file_costs_one_deadline_then_is_written_again(
    asynccache_cache: HierarchicalCache, asynccache_cache_factory: CacheFactory,
    asynccache_kv: KVFactory, tmp_path,
) -> None:
    policy = StoragePolicy(prefetch_threshold=0, prefetch_policy="wait_complete")
    backend = FileBackend(tmp_path / "store", asynccache_cache.storage_layout(),
                          timeout_s=0.5, timeout_per_gib_s=0)
    asynccache_cache.attach_storage(backend, policy)
    prompt = asynccache_kv.prompt(32)
    await asynccache_kv.serve(asynccache_cache, prompt)
    await asynccache_cache_factory.close(asynccache_cache)

    keys = storage_keys(prompt, asynccache_cache.page_size)
    fresh = await asynccache_cache_factory()
    fresh.attach_storage(backend, policy)
    with stuck_pages(backend, keys[2:3]):
        started = time.monotonic()
        first = await asynccache_kv.serve(fresh, prompt, prefetch=True)
        first_s = time.monotonic() - started
        timeouts = backend.stats()["faults"]["get.timeout"]
        await asynccache_cache_factory.close(fresh)
        again = await asynccache_cache_factory()
        again.attach_storage(backend, policy)
        second = await asynccache_kv.serve(again, prompt, prefetch=True)
    # The pages before the stuck one are served (KV checked bit for bit), the rest recomputed
    # after one deadline; the stuck page is quarantined, and the engine's backup writes it
    # again (over the FIFO): the next engine gets the whole prompt, at once.
    assert (first.fetched, first.computed) == (8, 24) and first_s >= 0.45
    assert (second.fetched, second.computed) == (32, 0)
    assert backend.stats()["faults"]["get.timeout"] == timeouts == 1  # no second deadline
    for _ in range(200):
        if not backend.stats()["stuck_threads"]:
            break
        await asyncio.sleep(0.02)
    await asynccache_cache_factory.close(again)
    await backend.aclose()


def test_the_crafted_prompt_spells_the_namespace_seed() -> None:
    crafted = crafted_namespace(16)
    assert len(crafted.extra_key or "") == 29  # the figure at page size 16
    page = struct.pack("<16I", *crafted.first_page)
    assert hashlib.sha256(page).digest() == crafted.seed
    assert crafted.seed == chain_seed(Namespace(crafted.extra_key, crafted.cache_salt))
    # storage_keys: the engine's own keys (a namespaced and a default prompt).
    tokens = list(range(1, 41))
    for ns in (Namespace(), Namespace("lora-1", "salt")):
        engine = [d.hex() for d in chain_digests(ns, None, struct.pack("<32I", *tokens[:32]), 64)]
        assert storage_keys(tokens, 16, extra_key=ns.extra_key, cache_salt=ns.cache_salt) == engine
    salted = crafted_namespace(64, cache_salt="tenant-7")
    assert len(salted.first_page) == 64 and salted.cache_salt == "tenant-7"
    assert hashlib.sha256(struct.pack("<64I", *salted.first_page)).digest() == salted.seed
    with pytest.raises(ValueError, match="29 bytes"):
        crafted_namespace(16, extra_key="too short")
    with pytest.raises(ValueError, match="cannot hold"):
        crafted_namespace(8)


@pytest.mark.asynccache_config(page_size=16, write_policy="write_through")
async def test_a_crafted_prompt_gets_no_other_tenants_kv(
    asynccache_cache: HierarchicalCache, asynccache_cache_factory: CacheFactory,
    asynccache_file_storage: FileBackend, asynccache_kv: KVFactory,
) -> None:
    """The probe: a tenant's prompt and the crafted page reach storage; a fresh engine serves
    the crafted prompt with prefetch. serve() checks every token's KV bit for bit against the
    default namespace, so another tenant's KV would fail the test."""
    crafted = crafted_namespace(16)
    policy = StoragePolicy(prefetch_threshold=0, prefetch_policy="wait_complete")
    body = asynccache_kv.prompt(48)
    asynccache_cache.attach_storage(asynccache_file_storage, policy)
    await asynccache_kv.serve(asynccache_cache, body, extra_key=crafted.extra_key)
    await asynccache_kv.serve(asynccache_cache, crafted.prompt([]))
    await asynccache_cache_factory.close(asynccache_cache)

    fresh = await asynccache_cache_factory()
    fresh.attach_storage(asynccache_file_storage, policy)
    served = await asynccache_kv.serve(fresh, crafted.prompt(body), prefetch=True)
    assert (served.fetched, served.computed) == (16, 48)  # its own first page only
