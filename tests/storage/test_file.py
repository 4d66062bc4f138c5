"""FileBackend: exact round trips, prefix queries, restart, corruption, LRU, concurrency, faults."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from asynccache.errors import ClosedError, InvalidInputError, StorageError
from asynccache.storage.base import StorageLayout
from asynccache.storage.faults import FaultInjectingBackend, FaultKind, FaultRule
from asynccache.storage.file import FileBackend
from asynccache.storage.pageformat import HEADER_SIZE

PAGE = 4096


def obj_path(backend: FileBackend, key: str) -> Path:
    return Path(backend._path(key))


async def read(
    backend: object, keys: list[str], size: int = PAGE
) -> tuple[list[bool], list[bytes]]:
    bufs = [bytearray(size) for _ in keys]
    ok = await backend.get_batch(keys, bufs)  # type: ignore[attr-defined]
    return ok, [bytes(b) for b in bufs]


def fault_count(backend: FileBackend, op: str, reason: str) -> int:
    return backend.stats()["faults"].get(f"{op}.{reason}", 0)


async def test_round_trip_is_bit_exact_for_every_buffer_kind(tmp_path, layout, make_keys) -> None:
    b = FileBackend(tmp_path, layout)
    keys = make_keys(4)
    rng = np.random.default_rng(1)
    src = [
        bytearray(rng.bytes(PAGE)),
        np.frombuffer(rng.bytes(PAGE), dtype=np.uint8).copy(),
        torch.from_numpy(np.frombuffer(rng.bytes(PAGE), dtype=np.uint8).copy()),
        torch.randn(PAGE // 2).to(torch.bfloat16),  # 2 bytes per element
    ]
    assert await b.set_batch(keys, src) == [True] * 4
    dst = [
        bytearray(PAGE),
        np.zeros(PAGE, dtype=np.uint8),
        torch.zeros(PAGE, dtype=torch.uint8),
        torch.zeros(PAGE // 2, dtype=torch.bfloat16),
    ]
    assert await b.get_batch(keys, dst) == [True] * 4
    assert bytes(dst[0]) == bytes(src[0])
    assert np.array_equal(dst[1], src[1])
    assert torch.equal(dst[2], src[2])
    assert torch.equal(dst[3].view(torch.int16), src[3].view(torch.int16))
    assert obj_path(b, keys[0]).stat().st_size == HEADER_SIZE + PAGE
    s = b.stats()
    assert s["pages"] == {"set.written": 4, "get.hit": 4}
    assert s["bytes_read"] == s["bytes_written"] == 4 * PAGE
    assert s["objects"] == 4 and s["used_bytes"] == 4 * (HEADER_SIZE + PAGE)


async def test_exists_prefix_counts_leading_stored_keys(tmp_path, layout, make_keys, make_pages):
    b = FileBackend(tmp_path, layout)
    k = make_keys(5)
    await b.set_batch([k[0], k[1], k[3]], make_pages(3, 64))
    assert await b.exists_prefix(k) == 2
    assert await b.exists_prefix([k[0], k[1], k[2], k[3]]) == 2
    assert await b.exists_prefix([k[3], k[0]]) == 2
    assert await b.exists_prefix([k[2], k[0]]) == 0
    assert await b.exists_prefix([]) == 0
    with pytest.raises(InvalidInputError, match=r"keys\[1\]"):
        await b.exists_prefix([k[0], "nothex"])


async def test_restart_keeps_objects_and_recency(tmp_path, layout, make_keys, make_pages) -> None:
    keys, pages = make_keys(3), make_pages(3, PAGE)
    b1 = FileBackend(tmp_path, layout)
    assert await b1.set_batch(keys, pages) == [True] * 3
    now = time.time()
    for age, key in zip((3000, 2000, 1000), keys, strict=True):  # written long ago, in order
        os.utime(obj_path(b1, key), (now - age, now - age))
    ok, _ = await read(b1, [keys[0]])  # a hit on an old file refreshes its mtime
    assert ok == [True]
    await b1.aclose()

    size = HEADER_SIZE + PAGE
    b2 = FileBackend(tmp_path, layout, capacity_bytes=3 * size)
    await b2.start()
    assert b2.stats()["objects"] == 3
    assert await b2.exists_prefix(keys) == 3
    # The index order comes from the files' mtimes: keys[1] is now the least recently used.
    assert await b2.set_batch(make_keys(1, "new"), make_pages(1, PAGE, seed=9)) == [True]
    assert [await b2.exists_prefix([k]) for k in keys] == [1, 0, 1]
    ok, got = await read(b2, [keys[0], keys[2]])
    assert ok == [True, True] and got == [pages[0], pages[2]]

    # A restart with a smaller capacity trims to it, least recent first: b2's hit refreshed
    # keys[2]'s old mtime, so it is the newest file now (keys[0]'s was fresh: not touched).
    assert obj_path(b2, keys[2]).stat().st_mtime > now - 60  # refreshed by the hit
    for key in (keys[0], make_keys(1, "new")[0]):  # file times are coarse: avoid ties
        os.utime(obj_path(b2, key), (now - 500, now - 500))
    b3 = FileBackend(tmp_path, layout, capacity_bytes=size)
    await b3.start()
    assert b3.stats()["objects"] == 1
    assert await b3.exists_prefix([keys[2]]) == 1


async def test_corrupt_file_is_detected_removed_and_counted(
    tmp_path, layout, make_keys, make_pages
):
    reg = CollectorRegistry()
    b = FileBackend(tmp_path, layout, registry=reg, metrics_label="disk0")
    keys, pages = make_keys(3), make_pages(3, PAGE)
    await b.set_batch(keys, pages)
    p = obj_path(b, keys[1])
    raw = bytearray(p.read_bytes())
    raw[HEADER_SIZE + 1234] ^= 0x01  # one bit, at rest
    p.write_bytes(bytes(raw))

    ok, got = await read(b, keys)
    assert ok == [True, False, True]
    assert got[0] == pages[0] and got[2] == pages[2]
    assert got[1] == bytes(PAGE)  # a miss never fills the buffer with what was read
    assert not p.exists()
    assert await b.exists_prefix(keys) == 1
    assert fault_count(b, "get", "corrupt") == 1
    labels = {"backend": "disk0", "op": "get", "reason": "corrupt"}
    assert reg.get_sample_value("asynccache_storage_faults_total", labels) == 1.0
    assert b.stats()["objects"] == 2


async def test_partial_and_misplaced_objects_are_misses(tmp_path, layout, make_keys, make_pages):
    b = FileBackend(tmp_path, layout)
    keys, pages = make_keys(3), make_pages(3, PAGE)
    await b.set_batch(keys[:2], pages[:2])
    p0 = obj_path(b, keys[0])
    with open(p0, "r+b") as f:  # a torn write: the tail never reached the disk
        f.truncate(HEADER_SIZE + PAGE // 2)
    # a good object of another key copied under keys[2]'s name
    obj_path(b, keys[2]).parent.mkdir(exist_ok=True)
    shutil.copy(obj_path(b, keys[1]), obj_path(b, keys[2]))
    ok, got = await read(b, keys)
    assert ok == [False, True, False]
    assert got[1] == pages[1]
    assert fault_count(b, "get", "partial") == 1
    assert fault_count(b, "get", "corrupt") == 1  # name mismatch
    assert not p0.exists() and not obj_path(b, keys[2]).exists()


async def test_wrong_buffer_size_is_a_miss_but_keeps_the_object(tmp_path, layout, make_keys):
    b = FileBackend(tmp_path, layout)
    key = make_keys(1)
    await b.set_batch(key, [bytes(PAGE)])
    ok, _ = await read(b, key, size=PAGE * 2)
    assert ok == [False]
    assert fault_count(b, "get", "size_mismatch") == 1
    assert obj_path(b, key[0]).exists()
    assert (await read(b, key))[0] == [True]


async def test_lru_capacity_evicts_in_exact_order(tmp_path, layout, make_keys, make_pages) -> None:
    size = HEADER_SIZE + PAGE
    b = FileBackend(tmp_path, layout, capacity_bytes=3 * size)
    k = make_keys(6)
    pages = make_pages(6, PAGE)
    assert await b.set_batch(k[:3], pages[:3]) == [True] * 3  # LRU: 0 1 2
    assert (await read(b, [k[0]]))[0] == [True]  # LRU: 1 2 0
    assert await b.set_batch([k[1]], [pages[1]]) == [True]  # refresh only: 2 0 1
    assert await b.set_batch([k[3]], [pages[3]]) == [True]  # evicts 2: 0 1 3
    assert [await b.exists_prefix([x]) for x in k[:4]] == [1, 1, 0, 1]
    assert await b.set_batch(k[4:6], pages[4:6]) == [True, True]  # evicts 0, 1: 3 4 5
    assert [await b.exists_prefix([x]) for x in k] == [0, 0, 0, 1, 1, 1]
    s = b.stats()
    assert s["evictions"] == 3 and s["objects"] == 3 and s["used_bytes"] == 3 * size
    assert sorted(p.name for p in tmp_path.glob("[0-9a-f][0-9a-f]/*")) == sorted(
        obj_path(b, x).name for x in k[3:]
    )
    # a page larger than the whole capacity is skipped, nothing else evicted
    assert await b.set_batch(make_keys(1, "big"), [bytes(4 * size)]) == [False]
    assert fault_count(b, "set", "capacity") == 1
    assert await b.exists_prefix(k[3:]) == 3


async def test_set_of_an_existing_key_keeps_the_original(tmp_path, layout, make_keys) -> None:
    b = FileBackend(tmp_path, layout)
    key = make_keys(1)
    await b.set_batch(key, [b"a" * PAGE])
    assert await b.set_batch(key, [b"b" * PAGE]) == [True]
    assert (await read(b, key))[1] == [b"a" * PAGE]
    assert b.stats()["bytes_written"] == PAGE


async def test_concurrent_writers_and_readers_of_the_same_keys(
    tmp_path, layout, make_keys, make_pages
):
    keys, pages = make_keys(8), make_pages(8, 64 * 1024)
    backends = [FileBackend(tmp_path, layout, io_threads=3) for _ in range(3)]

    async def reader(b: FileBackend) -> None:
        for _ in range(10):
            bufs = [bytearray(64 * 1024) for _ in keys]
            ok = await b.get_batch(keys, bufs)
            for hit, buf, page in zip(ok, bufs, pages, strict=True):
                assert not hit or bytes(buf) == page  # a hit is always the exact page

    writes = [b.set_batch(keys, pages) for b in backends for _ in range(3)]
    results = await asyncio.gather(*writes, *(reader(b) for b in backends))
    assert all(r == [True] * 8 for r in results[: len(writes)])
    for b in backends:
        ok, got = await read(b, keys, 64 * 1024)
        assert ok == [True] * 8 and got == pages
    assert not [p for p in tmp_path.rglob(".*.tmp")], "temp files left behind"


async def test_objects_of_other_instances_are_adopted(tmp_path, layout, make_keys, make_pages):
    a = FileBackend(tmp_path, layout)
    b = FileBackend(tmp_path, layout)
    await b.start()  # started (scanned) before a writes
    keys, pages = make_keys(3), make_pages(3, PAGE)
    await a.set_batch(keys[:2], pages[:2])
    assert await b.exists_prefix(keys) == 2
    assert b.stats()["objects"] == 2
    ok, got = await read(b, keys[:2])
    assert ok == [True, True] and got == pages[:2]
    no_adopt = FileBackend(tmp_path, layout, adopt_external=False)
    await no_adopt.start()
    await a.set_batch(keys[2:], pages[2:])
    assert await no_adopt.exists_prefix(keys) == 2


async def test_delete_and_clear_touch_only_this_layout(tmp_path, layout, make_keys, make_pages):
    other = StorageLayout(model="test/model", page_size=16, tp_rank=1, tp_size=2)
    a, b = FileBackend(tmp_path, layout), FileBackend(tmp_path, other)
    keys, pages = make_keys(4), make_pages(4, PAGE)
    await a.set_batch(keys, pages)
    await b.set_batch(keys, pages)
    assert await a.delete([keys[0], keys[0], keys[1]]) == 2
    assert await a.delete([keys[0]]) == 0
    assert await a.exists_prefix(keys[1:]) == 0 and await a.exists_prefix(keys[2:]) == 2
    assert await a.clear() == 2
    assert a.stats()["objects"] == 0 and a.stats()["used_bytes"] == 0
    assert await a.exists_prefix(keys) == 0
    assert await b.exists_prefix(keys) == 4


async def test_timeout_on_a_slow_disk_returns_misses_and_never_writes_late(
    tmp_path, layout, make_keys, short_deadline
):
    inner = FileBackend(tmp_path, layout, io_threads=2)
    keys = make_keys(4)
    assert await inner.set_batch(keys, [b"x" * PAGE] * 4) == [True] * 4
    fb = FaultInjectingBackend(
        inner, [FaultRule(FaultKind.DELAY, ops=frozenset({"read"}), delay_s=0.4)]
    )
    bufs = [bytearray(PAGE) for _ in keys]
    with short_deadline(inner, 0.1):
        assert await fb.get_batch(keys, bufs) == [False] * 4
    assert fault_count(inner, "get", "timeout") == 4
    for _ in range(100):  # the abandoned threads wake up and finish their reads ...
        await asyncio.sleep(0.05)
        if inner.stats()["stuck_threads"] == 0:
            break
    assert inner.stats()["stuck_threads"] == 0
    assert all(b == bytearray(PAGE) for b in bufs)  # ... but never touch the buffers
    fb.clear_rules()
    ok, got = await read(fb, keys)
    assert ok == [True] * 4 and got == [b"x" * PAGE] * 4


async def test_too_many_stuck_threads_fail_fast_then_recover(
    tmp_path, layout, make_keys, short_deadline
):
    inner = FileBackend(tmp_path, layout, io_threads=1, max_stuck_threads=1)
    keys = make_keys(2)
    assert await inner.set_batch(keys, [b"y" * PAGE] * 2) == [True] * 2
    fb = FaultInjectingBackend(
        inner, [FaultRule(FaultKind.DELAY, ops=frozenset({"read"}), times=1, delay_s=2.0)]
    )
    with short_deadline(inner, 0.05):
        assert (await read(fb, keys[:1]))[0] == [False]  # times out, leaves one thread stuck
    assert inner.stats()["stuck_threads"] == 1
    assert (await read(fb, keys[1:]))[0] == [False]  # fails fast: no new thread
    assert fault_count(inner, "get", "unavailable") == 1
    for _ in range(100):
        if inner.stats()["stuck_threads"] == 0:
            break
        await asyncio.sleep(0.05)
    assert (await read(fb, keys))[0] == [True, True]


async def test_cancelling_a_call_leaves_buffers_alone(tmp_path, layout, make_keys) -> None:
    inner = FileBackend(tmp_path, layout, io_threads=2)
    keys = make_keys(6)
    await inner.set_batch(keys, [b"z" * PAGE] * 6)
    fb = FaultInjectingBackend(
        inner, [FaultRule(FaultKind.DELAY, ops=frozenset({"read"}), delay_s=0.2)]
    )
    bufs = [bytearray(PAGE) for _ in keys]
    task = asyncio.ensure_future(fb.get_batch(keys, bufs))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.5)
    assert all(b == bytearray(PAGE) for b in bufs)


async def test_enospc_skips_the_write_and_leaves_no_temp_file(tmp_path, layout, make_keys):
    inner = FileBackend(tmp_path, layout)
    keys = make_keys(3)
    fb = FaultInjectingBackend(inner, [FaultRule(FaultKind.ENOSPC, keys=frozenset({keys[1]}))])
    assert await fb.set_batch(keys, [b"q" * PAGE] * 3) == [True, False, True]
    assert fault_count(inner, "set", "no_space") == 1
    assert await fb.exists_prefix(keys) == 1
    assert not [p for p in tmp_path.rglob(".*.tmp")]
    assert inner.stats()["used_bytes"] == 2 * (HEADER_SIZE + PAGE)
    fb.clear_rules()
    assert await fb.set_batch(keys, [b"q" * PAGE] * 3) == [True] * 3
    assert await fb.exists_prefix(keys) == 3


async def test_unusable_root_raises_on_start_and_degrades_otherwise(tmp_path, layout, make_keys):
    root = tmp_path / "not-a-dir"
    root.write_bytes(b"")
    with pytest.raises(StorageError, match="not-a-dir"):
        await FileBackend(root, layout).start()
    b = FileBackend(root, layout)
    keys = make_keys(2)
    assert await b.set_batch(keys, [bytes(8)] * 2) == [False, False]
    assert (await read(b, keys, 8))[0] == [False, False]
    assert await b.exists_prefix(keys) == 0
    assert fault_count(b, "set", "io_error") == 2


async def test_closed_backend_and_bad_config(tmp_path, layout, make_keys) -> None:
    b = FileBackend(tmp_path, layout)
    await b.aclose()
    with pytest.raises(ClosedError):
        await b.get_batch(make_keys(1), [bytearray(1)])
    with pytest.raises(ValueError, match="capacity_bytes"):
        FileBackend(tmp_path, layout, capacity_bytes=0)
    with pytest.raises(ValueError, match="io_threads"):
        FileBackend(tmp_path, layout, io_threads=0)
    with pytest.raises(ValueError, match="timeout_s"):
        FileBackend(tmp_path, layout, timeout_s=-1)


async def test_fsync_mode_round_trips(tmp_path, layout, make_keys, make_pages) -> None:
    b = FileBackend(tmp_path, layout, fsync=True)
    keys, pages = make_keys(3), make_pages(3, PAGE)
    assert await b.set_batch(keys, pages) == [True] * 3
    ok, got = await read(b, keys)
    assert ok == [True] * 3 and got == pages
    assert os.listdir(tmp_path)
