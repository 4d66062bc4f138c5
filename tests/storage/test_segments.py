"""FileBackend segments: several pages per file, published under each page's name (hard links).

Exact layouts, restart, corruption of one page, eviction of whole segments, torn segments,
a page present in two segments, foreign readers and concurrent writers.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from asynccache.storage import fileio
from asynccache.storage.faults import FaultInjectingBackend, FaultKind, FaultRule
from asynccache.storage.file import FileBackend
from asynccache.storage.pageformat import HEADER_SIZE, name_hash
from asynccache.storage.segment import MAX_PAGES, parse_table, table_bytes

PAGE = 4096
REC = HEADER_SIZE + PAGE  # one page record in a segment
SEG4 = 4 * REC  # segment_bytes that packs four pages per file


def path(b: FileBackend, key: str) -> Path:
    return Path(b._path(key))


def fault_count(b: FileBackend, op: str, reason: str) -> int:
    return b.stats()["faults"].get(f"{op}.{reason}", 0)


async def read(b: object, keys: list[str], size: int = PAGE) -> tuple[list[bool], list[bytes]]:
    bufs = [bytearray(size) for _ in keys]
    ok = await b.get_batch(keys, bufs)  # type: ignore[attr-defined]
    return ok, [bytes(x) for x in bufs]


def offset_of(b: FileBackend, key: str) -> int:
    """Where ``key``'s page record starts inside the file its name points to."""
    data = path(b, key).read_bytes()
    return parse_table(data[:4096], key + b._suffix)[name_hash(key + b._suffix)].offset


async def test_a_batch_is_packed_into_segments_with_one_name_per_page(
    tmp_path, layout, make_keys, make_pages
) -> None:
    b = FileBackend(tmp_path, layout, segment_bytes=SEG4)
    keys, pages = make_keys(10), make_pages(10, PAGE)
    assert await b.set_batch(keys, pages) == [True] * 10
    inodes = [path(b, k).stat().st_ino for k in keys]
    assert [inodes.index(i) for i in inodes] == [0] * 4 + [4] * 4 + [8] * 2  # files of 4, 4, 2
    assert [path(b, k).stat().st_nlink for k in keys] == [4] * 8 + [2] * 2
    sizes = [table_bytes(4) + 4 * REC] * 2 + [table_bytes(2) + 2 * REC]
    assert [path(b, keys[i]).stat().st_size for i in (0, 4, 8)] == sizes
    assert offset_of(b, keys[5]) == table_bytes(4) + REC
    s = b.stats()
    assert s["objects"] == 10 and s["files"] == 3 and s["used_bytes"] == sum(sizes)
    assert s["pages"] == {"set.written": 10}
    assert not [p for p in tmp_path.rglob(".*.tmp")], "temp files left behind"
    ok, got = await read(b, keys)
    assert ok == [True] * 10 and got == pages
    order = [5, 2, 9, 3, 4, 0]  # out of order, across segments
    ok, got = await read(b, [keys[i] for i in order])
    assert ok == [True] * 6 and got == [pages[i] for i in order]
    assert b.stats()["bytes_read"] == 16 * PAGE


async def test_large_pages_stay_one_file_each(tmp_path, layout, make_keys, make_pages) -> None:
    b = FileBackend(tmp_path, layout, segment_bytes=REC)  # a page alone fills a segment
    keys, pages = make_keys(3), make_pages(3, PAGE)
    assert await b.set_batch(keys, pages) == [True] * 3
    assert [path(b, k).stat().st_nlink for k in keys] == [1, 1, 1]
    assert [path(b, k).stat().st_size for k in keys] == [REC] * 3
    assert b.stats()["files"] == 3 and b.stats()["used_bytes"] == 3 * REC
    assert (await read(b, keys))[1] == pages


async def test_restart_rebuilds_segments_from_the_directory(
    tmp_path, layout, make_keys, make_pages
) -> None:
    keys, pages = make_keys(8), make_pages(8, PAGE)
    b1 = FileBackend(tmp_path, layout, segment_bytes=SEG4)
    await b1.set_batch(keys[:4], pages[:4])
    await b1.set_batch(keys[4:], pages[4:])
    old = os.stat(path(b1, keys[0])).st_mtime - 1000  # the first segment is the older one
    os.utime(path(b1, keys[0]), (old, old))
    seg_bytes = table_bytes(4) + 4 * REC

    b2 = FileBackend(tmp_path, layout, segment_bytes=SEG4)
    await b2.start()
    s = b2.stats()
    assert s["objects"] == 8 and s["files"] == 2 and s["used_bytes"] == 2 * seg_bytes
    ok, got = await read(b2, keys)
    assert ok == [True] * 8 and got == pages

    # b2's hit refreshed the old segment's mtime: it is the newer one now. A restart with
    # room for one segment keeps it, whole, and removes every name of the other.
    assert path(b2, keys[3]).stat().st_mtime > old + 900
    newer = os.stat(path(b1, keys[4])).st_mtime - 500
    os.utime(path(b1, keys[4]), (newer, newer))  # file times are coarse: avoid ties
    b3 = FileBackend(tmp_path, layout, segment_bytes=SEG4, capacity_bytes=seg_bytes)
    await b3.start()
    assert b3.stats()["objects"] == 4 and b3.stats()["used_bytes"] == seg_bytes
    assert await b3.exists_prefix(keys[:4]) == 4
    assert [path(b3, k).exists() for k in keys] == [True] * 4 + [False] * 4


async def test_a_corrupt_page_in_a_segment_is_a_miss_and_only_its_name_goes(
    tmp_path, layout, make_keys, make_pages
) -> None:
    b = FileBackend(tmp_path, layout, segment_bytes=SEG4)
    keys, pages = make_keys(4), make_pages(4, PAGE)
    await b.set_batch(keys, pages)
    used = b.stats()["used_bytes"]
    at = offset_of(b, keys[2]) + HEADER_SIZE + 100
    with open(path(b, keys[0]), "r+b") as f:  # any name opens the one file
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))
    ok, got = await read(b, keys)
    assert ok == [True, True, False, True]
    assert got[2] == bytes(PAGE)  # a miss never fills the buffer
    assert [got[i] for i in (0, 1, 3)] == [pages[i] for i in (0, 1, 3)]
    assert [path(b, k).exists() for k in keys] == [True, True, False, True]
    assert path(b, keys[0]).stat().st_nlink == 3
    assert fault_count(b, "get", "corrupt") == 1
    s = b.stats()
    assert s["objects"] == 3 and s["files"] == 1
    assert s["used_bytes"] == used  # the file stays on disk while its other pages live
    assert await b.exists_prefix(keys) == 2
    # the page can be written again: it becomes a file of its own
    assert await b.set_batch([keys[2]], [pages[2]]) == [True]
    assert (await read(b, keys))[1] == pages
    assert path(b, keys[2]).stat().st_nlink == 1


async def test_eviction_removes_whole_segments_least_recent_first(
    tmp_path, layout, make_keys, make_pages
) -> None:
    seg = table_bytes(4) + 4 * REC
    b = FileBackend(tmp_path, layout, segment_bytes=SEG4, capacity_bytes=2 * seg)
    k, p = make_keys(12), make_pages(12, PAGE)
    assert await b.set_batch(k[0:4], p[0:4]) == [True] * 4  # A
    assert await b.set_batch(k[4:8], p[4:8]) == [True] * 4  # B
    assert (await read(b, [k[1]]))[0] == [True]  # a hit on one page refreshes A: LRU is B
    assert await b.set_batch(k[8:12], p[8:12]) == [True] * 4  # C evicts B, whole
    assert [await b.exists_prefix([x]) for x in k] == [1] * 4 + [0] * 4 + [1] * 4
    assert not any(path(b, x).exists() for x in k[4:8])
    s = b.stats()
    assert s["evictions"] == 4 and s["files"] == 2 and s["used_bytes"] == 2 * seg
    assert sorted(p.name for p in tmp_path.glob("[0-9a-f][0-9a-f]/*")) == sorted(
        path(b, x).name for x in k[0:4] + k[8:12]
    )
    # A segment that does not fit is written page by page: 2 pages fit after evicting A.
    small = FileBackend(tmp_path / "s", layout, segment_bytes=SEG4, capacity_bytes=2 * REC)
    assert await small.set_batch(k[:3], p[:3]) == [True, True, False]
    assert fault_count(small, "set", "capacity") == 1
    assert [path(small, x).stat().st_nlink for x in k[:2]] == [1, 1]
    assert small.stats()["used_bytes"] == 2 * REC


async def test_torn_segments_are_misses_never_wrong_bytes(
    tmp_path, layout, make_keys, make_pages
) -> None:
    b = FileBackend(tmp_path, layout, segment_bytes=SEG4)
    keys, pages = make_keys(4), make_pages(4, PAGE)
    await b.set_batch(keys, pages)
    cut = offset_of(b, keys[2]) + HEADER_SIZE + PAGE // 2  # the tail never reached the disk
    os.truncate(path(b, keys[0]), cut)
    ok, got = await read(b, keys)
    assert ok == [True, True, False, False]
    assert got[:2] == pages[:2] and got[2:] == [bytes(PAGE)] * 2
    assert fault_count(b, "get", "partial") == 2
    assert [path(b, k).exists() for k in keys] == [True, True, False, False]

    # A file torn inside its table: every page of it is a miss, every name goes.
    keys2 = make_keys(4, "t")
    await b.set_batch(keys2, pages)
    os.truncate(path(b, keys2[0]), 100)
    assert (await read(b, keys2))[0] == [False] * 4
    assert not any(path(b, k).exists() for k in keys2)
    assert fault_count(b, "get", "partial") == 6


async def test_a_page_present_in_two_segments(tmp_path, layout, make_keys, make_pages) -> None:
    keys, pages = make_keys(5), make_pages(5, PAGE)
    x = FileBackend(tmp_path, layout, segment_bytes=SEG4)
    y = FileBackend(tmp_path, layout, segment_bytes=SEG4)
    await x.start()
    await y.start()
    assert await x.set_batch(keys[:3], pages[:3]) == [True] * 3  # segment S1: 0 1 2
    assert await y.set_batch(keys[2:], pages[2:]) == [True] * 3  # segment S2: 2 3 4
    s1, s2 = path(x, keys[0]).stat().st_ino, path(y, keys[3]).stat().st_ino
    assert path(x, keys[2]).stat().st_ino == s2  # the last publish wins the name
    assert [path(x, k).stat().st_nlink for k in (keys[0], keys[3])] == [2, 3]
    ok, got = await read(x, keys[:3])  # page 2 from S1's copy (one read of S1)
    assert ok == [True] * 3 and got == pages[:3]
    ok, got = await read(y, keys[2:])
    assert ok == [True] * 3 and got == pages[2:]
    # A restart sees each file once, with the names that point to it.
    z = FileBackend(tmp_path, layout, segment_bytes=SEG4)
    await z.start()
    assert z.stats()["objects"] == 5 and z.stats()["files"] == 2
    ok, got = await read(z, keys)
    assert ok == [True] * 5 and got == pages
    assert s1 != s2


async def test_another_instance_reads_and_adopts_segments(
    tmp_path, layout, make_keys, make_pages
) -> None:
    writer = FileBackend(tmp_path, layout, segment_bytes=SEG4)
    reader = FileBackend(tmp_path, layout)  # one file per page itself, reads both formats
    await reader.start()
    keys, pages = make_keys(6), make_pages(6, PAGE)
    await writer.set_batch(keys, pages)
    ok, got = await read(reader, keys)  # not indexed yet: found by name
    assert ok == [True] * 6 and got == pages
    assert await reader.exists_prefix(keys) == 6
    s = reader.stats()
    seg = table_bytes(4) + 4 * REC
    assert s["files"] == 2 and s["used_bytes"] == seg + table_bytes(2) + 2 * REC
    ok, got = await read(reader, keys[1:])
    assert ok == [True] * 5 and got == pages[1:]
    ok, _ = await read(reader, keys[:1], size=PAGE * 2)
    assert ok == [False] and fault_count(reader, "get", "size_mismatch") == 1
    assert path(reader, keys[0]).exists()


async def test_concurrent_segment_writers_and_readers(
    tmp_path, layout, make_keys, make_pages
) -> None:
    keys, pages = make_keys(12), make_pages(12, 16 * 1024)
    backends = [
        FileBackend(tmp_path, layout, io_threads=3, segment_bytes=s)
        for s in (3 * (HEADER_SIZE + 16 * 1024), 64 * 1024, None)
    ]

    async def reader(b: FileBackend) -> None:
        for _ in range(10):
            bufs = [bytearray(16 * 1024) for _ in keys]
            ok = await b.get_batch(keys, bufs)
            for hit, buf, page in zip(ok, bufs, pages, strict=True):
                assert not hit or bytes(buf) == page  # a hit is always the exact page

    writes = [b.set_batch(keys[i:], pages[i:]) for b in backends for i in (0, 2, 5)]
    results = await asyncio.gather(*writes, *(reader(b) for b in backends))
    assert all(r == [True] * len(r) for r in results[: len(writes)])
    for b in backends:
        ok, got = await read(b, keys, 16 * 1024)
        assert ok == [True] * 12 and got == pages
    assert not [p for p in tmp_path.rglob(".*.tmp")], "temp files left behind"


async def test_write_faults_fail_the_whole_segment_and_publish_nothing(
    tmp_path, layout, make_keys, make_pages
) -> None:
    inner = FileBackend(tmp_path, layout, segment_bytes=SEG4)
    keys, pages = make_keys(8), make_pages(8, PAGE)
    fb = FaultInjectingBackend(inner, [FaultRule(FaultKind.ENOSPC, keys=frozenset({keys[1]}))])
    assert await fb.set_batch(keys, pages) == [False] * 4 + [True] * 4
    assert fault_count(inner, "set", "no_space") == 4
    assert [path(inner, k).exists() for k in keys] == [False] * 4 + [True] * 4
    assert not [p for p in tmp_path.rglob(".*.tmp")]
    assert inner.stats()["used_bytes"] == table_bytes(4) + 4 * REC
    fb.clear_rules()
    # A torn write (published): pages from the torn one on are misses, and removed.
    fb.add_rule(FaultRule(FaultKind.PARTIAL_WRITE, keys=frozenset({keys[2]}), times=1))
    assert await fb.set_batch(keys[:4], pages[:4]) == [True] * 4
    ok, got = await read(fb, keys[:4])
    assert ok == [True, True, False, False] and got[:2] == pages[:2]
    assert await fb.exists_prefix(keys) == 2


async def test_reads_of_a_segment_time_out_without_touching_buffers(
    tmp_path, layout, make_keys, make_pages, short_deadline
) -> None:
    inner = FileBackend(tmp_path, layout, segment_bytes=SEG4)
    keys, pages = make_keys(4), make_pages(4, PAGE)
    assert await inner.set_batch(keys, pages) == [True] * 4
    fb = FaultInjectingBackend(
        inner, [FaultRule(FaultKind.DELAY, ops=frozenset({"read"}), delay_s=0.3)]
    )
    bufs = [bytearray(PAGE) for _ in keys]
    with short_deadline(inner, 0.1):
        assert await fb.get_batch(keys, bufs) == [False] * 4
    assert fault_count(inner, "get", "timeout") == 4
    for _ in range(100):
        await asyncio.sleep(0.05)
        if inner.stats()["stuck_threads"] == 0:
            break
    assert all(x == bytearray(PAGE) for x in bufs)
    fb.clear_rules()
    assert (await read(fb, keys))[1] == pages


async def test_fsync_mode_and_segment_limits(tmp_path, layout, make_keys, make_pages) -> None:
    b = FileBackend(tmp_path, layout, segment_bytes=1 << 30, fsync=True)
    n = MAX_PAGES + 3
    keys, pages = make_keys(n), make_pages(n, 64)
    assert await b.set_batch(keys, pages) == [True] * n
    assert path(b, keys[0]).stat().st_nlink == MAX_PAGES  # a table fits one 4 KiB block
    assert path(b, keys[-1]).stat().st_nlink == 3
    ok, got = await read(b, keys, 64)
    assert ok == [True] * n and got == pages
    with pytest.raises(ValueError, match="segment_bytes"):
        FileBackend(tmp_path, layout, segment_bytes=0)


def _padded(n: int, payload: int) -> int:
    size = table_bytes(n) + n * (HEADER_SIZE + payload)
    return -(-size // 4096) * 4096


async def test_direct_io_segments(tmp_path, layout, make_keys, make_pages) -> None:
    size = 1000  # records at unaligned offsets: reads take the aligned range around them
    seg = 4 * (HEADER_SIZE + size)
    b = FileBackend(tmp_path, layout, segment_bytes=seg, direct_io=True, fsync=True)
    keys, pages = make_keys(6), make_pages(6, size)
    assert await b.set_batch(keys, pages) == [True] * 6
    if not b.stats()["direct_io"]:
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    assert [path(b, keys[i]).stat().st_size for i in (0, 4)] == [_padded(4, size), _padded(2, size)]
    assert b.stats()["used_bytes"] == _padded(4, size) + _padded(2, size)
    ok, got = await read(b, keys, size)
    assert ok == [True] * 6 and got == pages
    ok, got = await read(b, keys[3:], size)
    assert ok == [True] * 3 and got == pages[3:]
    at = offset_of(b, keys[2]) + HEADER_SIZE + 7
    with open(path(b, keys[0]), "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 1]))
    ok, got = await read(b, keys, size)
    assert ok == [True, True, False, True, True, True]
    assert fault_count(b, "get", "corrupt") == 1 and not path(b, keys[2]).exists()
    plain = FileBackend(tmp_path, layout, segment_bytes=seg)  # same format, buffered reads
    await plain.start()
    assert plain.stats()["objects"] == 5 and plain.stats()["files"] == 2
    ok, got = await read(plain, keys, size)
    assert ok == [True, True, False, True, True, True]
    assert [got[i] for i in (0, 1, 3, 4, 5)] == [pages[i] for i in (0, 1, 3, 4, 5)]
    # A torn O_DIRECT write: the cut page and the ones after it are misses.
    fb = FaultInjectingBackend(b, [FaultRule(FaultKind.PARTIAL_WRITE, keys=frozenset({keys[1]}))])
    keys2 = make_keys(3, "torn")
    fb_keys = [keys2[0], keys[1], keys2[1]]
    await fb.delete([keys[1]])
    assert await fb.set_batch(fb_keys, pages[:3]) == [True] * 3
    fb.clear_rules()
    assert (await read(fb, fb_keys, size))[0] == [True, False, False]


@pytest.mark.parametrize("direct", [False, True])
async def test_a_name_republished_as_a_single_file_is_read_as_one(
    tmp_path, layout, make_keys, make_pages, direct
) -> None:
    size = 3 * PAGE  # larger than the table block a segment reader fetches first
    seg = 4 * (HEADER_SIZE + size)
    b = FileBackend(tmp_path, layout, segment_bytes=seg, direct_io=direct)
    keys, pages = make_keys(4), make_pages(4, size)
    assert await b.set_batch(keys, pages) == [True] * 4
    other = FileBackend(tmp_path, layout)  # one file per page
    await other.start()
    assert await other.delete([keys[0]]) == 1
    assert await other.set_batch([keys[0]], [pages[0]]) == [True]
    assert path(b, keys[0]).stat().st_nlink == 1
    ok, got = await read(b, keys, size)  # b still takes keys[0] for a segment page
    assert ok == [True] * 4 and got == pages
    assert b.stats()["faults"] == {}


@pytest.mark.parametrize("direct", [False, True])
async def test_a_segment_is_read_front_to_back_by_one_reader(
    tmp_path, layout, make_keys, make_pages, monkeypatch, direct
) -> None:
    """One open per segment run, its pages read in order, a buffered read in steps of at
    most READ_STEP: the file streams. (Split over the threads in 1 MiB jobs, each read whole,
    cold 1 MiB pages read at half the rate.)"""
    size = 512 * 1024
    b = FileBackend(tmp_path, layout, segment_bytes=4 * (HEADER_SIZE + size), direct_io=direct)
    keys, pages = make_keys(4), make_pages(4, size)
    assert await b.set_batch(keys, pages) == [True] * 4
    assert b.stats()["files"] == 1
    if direct and not b.stats()["direct_io"]:
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    opened: dict[int, str] = {}
    reads: list[tuple[int, int, int]] = []  # (fd, offset, bytes asked)
    real_open, real_preadv = os.open, os.preadv

    def spy_open(p, flags, *args, **kwargs):  # type: ignore[no-untyped-def]
        fd = real_open(p, flags, *args, **kwargs)
        if str(p).startswith(str(tmp_path)) and not flags & (os.O_WRONLY | os.O_RDWR):
            opened[fd] = str(p)
        return fd

    def spy_preadv(fd, bufs, offset, *args):  # type: ignore[no-untyped-def]
        if fd in opened:
            reads.append((fd, offset, sum(memoryview(x).nbytes for x in bufs)))
        return real_preadv(fd, bufs, offset, *args)

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "preadv", spy_preadv)
    ok, got = await read(b, keys, size)
    monkeypatch.undo()
    assert ok == [True] * 4 and got == pages
    assert len(opened) == 1, opened  # one reader, one open
    offsets = [off for _, off, _ in reads]
    assert offsets == sorted(offsets) and offsets[-1] > 3 * size  # in order, to the end
    if not direct:
        assert max(n for _, _, n in reads) <= fileio.READ_STEP
