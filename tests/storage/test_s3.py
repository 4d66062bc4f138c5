"""S3Backend against a real SeaweedFS server on 127.0.0.1 (and misbehaving fake servers)."""

from __future__ import annotations

import asyncio
import secrets

import obstore
import pytest
from obstore.store import MemoryStore, S3Store

from asynccache.errors import StorageError
from asynccache.storage.base import StorageLayout
from asynccache.storage.factory import open_backend
from asynccache.storage.faults import FaultInjectingBackend, FaultKind, FaultRule
from asynccache.storage.pageformat import HEADER_SIZE
from asynccache.storage.s3 import S3Backend

pytestmark = pytest.mark.seaweedfs


def backend_for(server, layout: StorageLayout, prefix: str | None = None, **kw) -> S3Backend:
    return S3Backend(
        server.bucket,
        layout,
        prefix=prefix or f"t-{secrets.token_hex(6)}",
        endpoint=server.endpoint,
        access_key_id=server.access_key,
        secret_access_key=server.secret_key,
        **kw,
    )


def raw_store(server, prefix: str) -> S3Store:
    return server.store(prefix)


async def read(backend, keys: list[str], size: int) -> tuple[list[bool], list[bytes]]:
    bufs = [bytearray(size) for _ in keys]
    ok = await backend.get_batch(keys, bufs)
    return ok, [bytes(b) for b in bufs]


def faults(backend: S3Backend) -> dict[str, int]:
    return backend.stats()["faults"]


@pytest.mark.parametrize("size", [4096, 1 << 20])
async def test_round_trip_exact_and_restart(seaweed, layout, make_keys, make_pages, size) -> None:
    b = backend_for(seaweed, layout)
    await b.check()
    keys, pages = make_keys(6), make_pages(6, size)
    assert await b.set_batch(keys, pages) == [True] * 6
    ok, got = await read(b, keys, size)
    assert ok == [True] * 6 and got == pages
    # A fresh instance (no positive cache) on the same bucket/prefix sees everything.
    b2 = backend_for(seaweed, layout, prefix=b.prefix)
    assert await b2.exists_prefix(keys) == 6
    ok, got = await read(b2, keys, size)
    assert ok == [True] * 6 and got == pages
    meta = await obstore.head_async(raw_store(seaweed, b.prefix), layout.object_name(keys[0]))
    assert meta["size"] == HEADER_SIZE + size
    assert b.stats()["bytes_written"] == 6 * size and b2.stats()["bytes_read"] == 6 * size


async def test_exists_prefix_and_set_of_existing(seaweed, layout, make_keys, make_pages) -> None:
    b = backend_for(seaweed, layout, exists_cache_ttl_s=0, max_concurrency=4)
    k = make_keys(12)
    pages = make_pages(12, 512)
    stored = k[:9] + k[10:]  # k[9] missing
    assert all(await b.set_batch(stored, [pages[k.index(x)] for x in stored]))
    assert await b.exists_prefix(k) == 9  # spans several HEAD windows of 4
    assert await b.exists_prefix(k[9:]) == 0
    assert await b.exists_prefix([]) == 0
    cached = backend_for(seaweed, layout, prefix=b.prefix)
    assert await cached.set_batch(k[:2], pages[:2]) == [True, True]  # written again (unknown)
    assert await cached.set_batch(k[:2], [b"x" * 512] * 2) == [True, True]  # known: skipped
    assert cached.stats()["pages"]["set.present"] == 2
    ok, got = await read(b, k[:2], 512)
    assert ok == [True, True] and got == pages[:2]


async def test_corrupt_and_partial_objects_are_misses_and_removed(
    seaweed, layout, make_keys, make_pages
):
    b = backend_for(seaweed, layout, exists_cache_ttl_s=0)
    keys, pages = make_keys(3), make_pages(3, 8192)
    await b.set_batch(keys, pages)
    raw = raw_store(seaweed, b.prefix)
    n1, n2 = layout.object_name(keys[1]), layout.object_name(keys[2])
    blob = bytearray(await (await obstore.get_async(raw, n1)).bytes_async())
    blob[HEADER_SIZE + 77] ^= 0x10
    await obstore.put_async(raw, n1, bytes(blob))
    blob2 = bytes(await (await obstore.get_async(raw, n2)).bytes_async())
    await obstore.put_async(raw, n2, blob2[: HEADER_SIZE + 100])
    ok, got = await read(b, keys, 8192)
    assert ok == [True, False, False] and got[0] == pages[0]
    assert got[1] == bytes(8192)
    assert faults(b) == {"get.corrupt": 1, "get.partial": 1}
    assert await b.exists_prefix(keys) == 1
    with pytest.raises(FileNotFoundError):
        await obstore.head_async(raw, n1)


async def test_wrong_credentials_are_rejected(seaweed, layout, make_keys) -> None:
    good = backend_for(seaweed, layout)
    keys = make_keys(2)
    assert await good.set_batch(keys, [b"k" * 100] * 2) == [True, True]
    bad = S3Backend(
        seaweed.bucket,
        layout,
        prefix=good.prefix,
        endpoint=seaweed.endpoint,
        access_key_id=seaweed.access_key,
        secret_access_key="not-the-secret",
        exists_cache_ttl_s=0,
    )
    with pytest.raises(StorageError, match="credentials rejected"):
        await bad.check()
    assert await bad.set_batch(make_keys(1, "other"), [b"x" * 10]) == [False]
    assert (await read(bad, keys, 100))[0] == [False, False]
    assert await bad.exists_prefix(keys) == 0
    f = faults(bad)
    assert f["set.permission"] == 1 and f["get.permission"] == 2 and f["exists.permission"] == 1
    unknown = S3Backend(
        seaweed.bucket,
        layout,
        endpoint=seaweed.endpoint,
        access_key_id="nobody",
        secret_access_key="nothing",
    )
    with pytest.raises(StorageError, match="credentials rejected"):
        await unknown.check()


async def test_layouts_do_not_collide_and_clear_is_scoped(seaweed, layout, make_keys, make_pages):
    other = StorageLayout(model="test/model", page_size=32)
    a = backend_for(seaweed, layout, exists_cache_ttl_s=0)
    b = backend_for(seaweed, other, prefix=a.prefix, exists_cache_ttl_s=0)
    keys = make_keys(3)
    await a.set_batch(keys, make_pages(3, 64, seed=1))
    await b.set_batch(keys, make_pages(3, 64, seed=2))
    assert (await read(a, keys, 64))[1] == make_pages(3, 64, seed=1)
    assert (await read(b, keys, 64))[1] == make_pages(3, 64, seed=2)
    assert await a.delete(keys[:1]) == 1
    assert await a.exists_prefix(keys) == 0 and await a.exists_prefix(keys[1:]) == 2
    assert await a.clear() == 2
    assert await a.exists_prefix(keys[1:]) == 0
    assert await b.exists_prefix(keys) == 3


async def test_concurrent_writers_of_the_same_keys(seaweed, layout, make_keys, make_pages) -> None:
    prefix = f"t-{secrets.token_hex(6)}"
    writers = [backend_for(seaweed, layout, prefix=prefix) for _ in range(3)]
    keys, pages = make_keys(8), make_pages(8, 32 * 1024)
    results = await asyncio.gather(*(w.set_batch(keys, pages) for w in writers))
    assert results == [[True] * 8] * 3
    ok, got = await read(backend_for(seaweed, layout, prefix=prefix), keys, 32 * 1024)
    assert ok == [True] * 8 and got == pages


async def test_injected_faults_never_serve_wrong_bytes(seaweed, layout, make_keys, make_pages):
    inner = backend_for(seaweed, layout, exists_cache_ttl_s=0)
    kinds = [FaultKind.FLIP_BYTES, FaultKind.PARTIAL_WRITE, FaultKind.SHORT_READ, FaultKind.DROP]
    fb = FaultInjectingBackend(inner, [FaultRule(k, rate=0.15) for k in kinds], seed=3)
    keys, pages = make_keys(24), make_pages(24, 16 * 1024)
    hits = 0
    for _ in range(4):
        await fb.set_batch(keys, pages)
        bufs = [bytearray(16 * 1024) for _ in keys]
        for ok, buf, page in zip(await fb.get_batch(keys, bufs), bufs, pages, strict=True):
            assert not ok or bytes(buf) == page
            hits += ok
    assert hits > 24
    assert {k for (_op, k) in fb.injected} == {k.value for k in kinds}


async def test_dead_server_degrades_to_misses(refused_endpoint, layout, make_keys) -> None:
    b = S3Backend(
        "bucket",
        layout,
        endpoint=refused_endpoint,
        access_key_id="a",
        secret_access_key="b",
        retries=0,
        timeout_s=2.0,
    )
    keys = make_keys(3)
    assert await b.set_batch(keys, [b"x" * 10] * 3) == [False] * 3
    assert (await read(b, keys, 10))[0] == [False] * 3
    assert await b.exists_prefix(keys) == 0
    assert faults(b)["set.connection"] == 3 and faults(b)["get.connection"] == 3
    with pytest.raises(StorageError, match="endpoint is unreachable"):
        await b.check()


async def test_silent_server_times_out(silent_endpoint, layout, make_keys) -> None:
    b = S3Backend(
        "bucket",
        layout,
        endpoint=silent_endpoint,
        access_key_id="a",
        secret_access_key="b",
        retries=0,
        timeout_s=0.3,
        timeout_per_gib_s=0,
    )
    keys = make_keys(4)
    assert await b.set_batch(keys, [b"x" * 10] * 4) == [False] * 4
    assert (await read(b, keys, 10))[0] == [False] * 4
    assert await b.exists_prefix(keys) == 0
    assert faults(b)["set.timeout"] == 4 and faults(b)["get.timeout"] == 4
    assert faults(b)["exists.timeout"] >= 1


async def test_open_backend_from_url_with_env_credentials(seaweed, layout, make_keys, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.secret_key)
    url = f"s3://{seaweed.bucket}/url-{secrets.token_hex(4)}?endpoint={seaweed.endpoint}&concurrency=8"
    b = await open_backend(url, layout)
    assert isinstance(b, S3Backend) and b.max_concurrency == 8
    keys = make_keys(2)
    assert await b.set_batch(keys, [b"u" * 64] * 2) == [True, True]
    assert (await read(b, keys, 64))[1] == [b"u" * 64] * 2
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(StorageError, match="credentials rejected"):
        await open_backend(url, layout)


async def test_memory_store_round_trip_without_a_server(layout, make_keys, make_pages) -> None:
    b = S3Backend("mem", layout, store=MemoryStore())
    keys, pages = make_keys(4), make_pages(4, 300 * 1024)
    assert await b.set_batch(keys, pages) == [True] * 4
    ok, got = await read(b, keys, 300 * 1024)
    assert ok == [True] * 4 and got == pages
    assert await b.exists_prefix(keys) == 4


async def test_a_corrupt_object_whose_delete_fails_is_counted_and_never_served(
    layout, make_keys, make_pages
) -> None:
    store = MemoryStore()
    inner = S3Backend("mem", layout, store=store, exists_cache_ttl_s=0)
    fb = FaultInjectingBackend(inner, [FaultRule(FaultKind.EIO, ops=frozenset({"delete"}))])
    keys, pages = make_keys(2), make_pages(2, 8192)
    assert await fb.set_batch(keys, pages) == [True, True]
    name = layout.object_name(keys[1])
    blob = bytearray(await (await obstore.get_async(store, name)).bytes_async())
    blob[HEADER_SIZE + 5] ^= 0x01
    await obstore.put_async(store, name, bytes(blob))
    for attempt in (1, 2):  # the object stays; each read finds it corrupt and tries again
        ok, got = await read(fb, keys, 8192)
        assert ok == [True, False] and got == [pages[0], bytes(8192)]
        assert faults(inner) == {"get.corrupt": attempt, "remove_corrupt.io_error": attempt}
        await obstore.head_async(store, name)  # still there
