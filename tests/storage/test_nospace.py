"""A full disk is capacity pressure (issue 23 item 5).

With no capacity configured, or one larger than the filesystem, the LRU bound never evicts, so
once the disk was full every later write failed. A write that fails with ENOSPC now evicts
least recently used objects of this backend and is retried once.

The retry is reserved again, like any write: it used to put its bytes back without a check,
so the index could count more than ``capacity_bytes`` (another set took the room while the
victims were unlinked, or the failed pages were planned again as a larger segment).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

import anyio
import pytest

from asynccache.storage.faults import Fault, FaultInjectingBackend, FaultKind, FaultRule
from asynccache.storage.file import FileBackend
from asynccache.storage.pageformat import HEADER_SIZE
from asynccache.storage.segment import file_bytes
from tests.storage.test_evict_faults import FILE as SMALL_FILE
from tests.storage.test_evict_faults import PAGE as SMALL_PAGE
from tests.storage.test_evict_faults import consistent, until

PAGE = 256 * 1024  # a 4 MiB filesystem holds 15 of them


def stat(backend: FileBackend, name: str) -> int:
    return backend.stats()[name]


@pytest.mark.parametrize(
    "options",
    [{}, {"capacity_bytes": 1 << 30}, {"segment_bytes": 1 << 20}],
    ids=["no-capacity", "capacity-above-the-disk", "segments"],
)
async def test_a_full_disk_evicts_and_keeps_storing(small_fs, layout, make_keys, make_pages,
                                                    options) -> None:
    b = FileBackend(small_fs, layout, **options)
    heard: list[str] = []
    b.add_eviction_listener(heard.extend)
    keys, pages = make_keys(64), make_pages(64, PAGE)
    results = []
    for i in range(0, 64, 4):
        results += await b.set_batch(keys[i : i + 4], pages[i : i + 4])
    assert results == [True] * 64  # 64 pages through a disk that holds 15
    assert stat(b, "no_space_retries") > 0
    assert b.stats()["removed"].get("no_space", 0) == len(heard) > 0
    assert b.stats()["faults"] == {}
    # The newest pages are there, bit for bit; what was evicted is told and gone.
    bufs = [bytearray(PAGE) for _ in range(8)]
    assert await b.get_batch(keys[-8:], bufs) == [True] * 8
    assert [bytes(x) for x in bufs] == pages[-8:]
    assert await b.exists_prefix(heard[:1]) == 0
    assert b.stats()["used_bytes"] <= 4 << 20
    assert not [n for _, _, files in os.walk(small_fs) for n in files if n.endswith(".tmp")]


async def test_enospc_evicts_lru_and_retries_once(tmp_path, layout, make_keys, make_pages):
    inner = FileBackend(tmp_path, layout)
    keys, pages = make_keys(6), make_pages(6, 4096)
    assert await inner.set_batch(keys[:4], pages[:4]) == [True] * 4
    assert await inner.get_batch([keys[0]], [bytearray(4096)]) == [True]  # keys[1] is LRU
    fb = FaultInjectingBackend(inner, [FaultRule(FaultKind.ENOSPC, times=1)])
    assert await fb.set_batch(keys[4:5], pages[4:5]) == [True]  # failed, evicted, retried
    # Twice the bytes that did not fit: the two least recently used pages.
    assert [await inner.exists_prefix([k]) for k in keys[:5]] == [1, 0, 0, 1, 1]
    assert stat(inner, "no_space_retries") == 1
    assert inner.stats()["removed"] == {"no_space": 2}
    assert inner.stats()["evictions"] == 2
    assert inner.stats()["used_bytes"] == 3 * (HEADER_SIZE + 4096)

    # A disk that stays full: the retry fails too; the page is a no_space skip.
    fb.add_rule(FaultRule(FaultKind.ENOSPC))
    assert await fb.set_batch(keys[5:], pages[5:]) == [False]
    assert inner.stats()["faults"] == {"set.no_space": 1}
    assert stat(inner, "no_space_retries") == 2


# -- the retry after ENOSPC stays within the capacity ------------------------------------------


class FullOnce:
    """A hook: the first write of each of ``full`` fails with ENOSPC; the unlinks and writes
    of ``held`` keys wait until their event is set (``reached`` says they got there)."""

    def __init__(self, full: Iterable[str], held: dict[tuple[str, str], threading.Event]) -> None:
        self.full = set(full)
        self.held = held
        self.reached = {k: threading.Event() for k in held}

    def decide(self, op: str, key: str) -> Fault | None:
        if (op, key) in self.held:
            self.reached[(op, key)].set()
            self.held[(op, key)].wait(10)
        if op == "write" and key in self.full:
            self.full.discard(key)
            return Fault(FaultKind.ENOSPC)
        return None


async def read_back(b: FileBackend, keys: list[str], size: int) -> tuple[list[bool], list[bytes]]:
    bufs = [bytearray(size) for _ in keys]
    got = await b.get_batch(keys, bufs)
    return got, [bytes(x) for x in bufs]


async def test_a_retried_segment_is_reserved_again_not_made_bigger_than_the_capacity(
    tmp_path, layout, make_keys, make_pages
) -> None:
    """set([a, b]) with segments: the two pages' segment (a 4 KiB table, then the pages) is
    larger than the capacity, so they are written as two single-page files, which fit. Both
    fail with ENOSPC. The retry planned the failed pages again, as one segment, and wrote it
    without a capacity check: 5248 bytes indexed under a capacity of 2304."""
    page = 512
    file = HEADER_SIZE + page
    p1, p2, a, b_ = make_keys(4)
    pages = make_pages(4, page)
    cap = 4 * file
    b = FileBackend(tmp_path, layout, capacity_bytes=cap, segment_bytes=1 << 20)
    heard: list[str] = []
    b.add_eviction_listener(heard.extend)
    assert await b.set_batch([p1], pages[:1]) == [True]
    assert await b.set_batch([p2], pages[1:2]) == [True]
    assert file_bytes([page, page], False) > cap  # the segment of a and b cannot fit
    b.set_fault_hook(FullOnce([a, b_], {}))
    assert await b.set_batch([a, b_], pages[2:]) == [True, True]
    st = b.stats()
    assert st["used_bytes"] == 2 * file <= cap
    assert (st["objects"], st["files"]) == (2, 2)  # written again as two files
    assert consistent(b, tmp_path)
    assert heard == [p1, p2]
    assert st["removed"] == {"no_space": 2}
    assert st["no_space_retries"] == 2
    assert st["faults"] == {}
    assert st["reserved_bytes"] == 0
    got, data = await read_back(b, [a, b_, p1, p2], page)
    assert got == [True, True, False, False]
    assert data[:2] == pages[2:]


async def _three_stored(
    tmp_path, layout, keys: list[str], pages: list[bytes]
) -> tuple[FileBackend, list[str]]:
    """A backend of capacity 4 files holding the first 3 of ``keys``, one set each, and the
    list of keys its eviction listener hears."""
    b = FileBackend(tmp_path, layout, capacity_bytes=4 * SMALL_FILE, io_threads=6)
    heard: list[str] = []
    b.add_eviction_listener(heard.extend)
    for k, p in zip(keys[:3], pages, strict=False):
        assert await b.set_batch([k], [p]) == [True]
    return b, heard


async def test_the_retry_reserves_again_after_another_set_took_the_room(
    tmp_path, layout, make_keys, make_pages
) -> None:
    """set([a]) fails with ENOSPC and evicts p1 and p2 to make room on the disk; while their
    unlink runs, set([b, c, d]) reserves the room they left in the capacity and stores its
    pages. The retry of a put its reservation back without a check: a was written on top,
    5 files indexed under a capacity of 4. It must evict for the capacity, like any write:
    p3, the least recently used."""
    keys, pages = make_keys(7), make_pages(7, SMALL_PAGE)
    p1, p2, p3, a, b_, c, d = keys
    b, heard = await _three_stored(tmp_path, layout, keys, pages)
    go = threading.Event()
    hook = FullOnce([a], {("delete", p1): go})
    b.set_fault_hook(hook)
    got_a: list[list[bool]] = []

    async def set_a() -> None:
        got_a.append(await b.set_batch([a], pages[3:4]))

    async with anyio.create_task_group() as tg:
        tg.start_soon(set_a)  # ENOSPC; p1 and p2 evicted; p1's unlink waits
        assert await until(hook.reached[("delete", p1)].is_set)
        assert await b.set_batch([b_, c, d], pages[4:]) == [True] * 3  # the room p1, p2 left
        assert b.stats()["used_bytes"] == 4 * SMALL_FILE
        go.set()
    assert got_a == [[True]]
    st = b.stats()
    assert st["used_bytes"] == 4 * SMALL_FILE
    assert (st["objects"], st["files"]) == (4, 4)
    assert consistent(b, tmp_path)
    assert heard == [p1, p2, p3]
    assert st["removed"] == {"no_space": 2, "capacity": 1}
    assert st["evictions"] == 3
    assert st["faults"] == {}
    assert st["reserved_bytes"] == 0
    got, data = await read_back(b, [a, b_, c, d, p1, p2, p3], SMALL_PAGE)
    assert got == [True] * 4 + [False] * 3
    assert data[:4] == [pages[3], *pages[4:]]


async def test_a_retry_that_no_longer_fits_the_capacity_is_a_capacity_skip(
    tmp_path, layout, make_keys, make_pages
) -> None:
    """As above, but nothing is left to evict when the retry reserves again: p3 is a page of
    the same batch (protected) and the other set's pages are still being written (busy,
    reserved). The retry must not write a (it was written, 5 files under a capacity of 4):
    a is a ``capacity`` skip, a miss."""
    keys, pages = make_keys(7), make_pages(7, SMALL_PAGE)
    p1, p2, p3, a, b_, c, d = keys
    b, heard = await _three_stored(tmp_path, layout, keys, pages)
    unlink_go, write_go = threading.Event(), threading.Event()
    hook = FullOnce([a], {("delete", p1): unlink_go, ("write", d): write_go})
    b.set_fault_hook(hook)
    got_a: list[list[bool]] = []
    got_b: list[list[bool]] = []

    async def set_a() -> None:
        got_a.append(await b.set_batch([p3, a], [pages[2], pages[3]]))

    async def set_bcd() -> None:
        got_b.append(await b.set_batch([b_, c, d], pages[4:]))

    async with anyio.create_task_group() as tg:
        tg.start_soon(set_a)  # p3 present; a: ENOSPC; p1 and p2 evicted; p1's unlink waits
        assert await until(hook.reached[("delete", p1)].is_set)
        tg.start_soon(set_bcd)  # reserves the room p1 and p2 left; d's write waits
        assert await until(hook.reached[("write", d)].is_set)
        unlink_go.set()  # the retry of a: nothing it may evict
        assert await until(lambda: bool(got_a))
        assert b.stats()["used_bytes"] + b.stats()["reserved_bytes"] <= 4 * SMALL_FILE
        write_go.set()
    assert got_a == [[True, False]]
    assert got_b == [[True] * 3]
    st = b.stats()
    assert st["used_bytes"] == 4 * SMALL_FILE
    assert (st["objects"], st["files"]) == (4, 4)
    assert consistent(b, tmp_path)
    assert heard == [p1, p2]
    assert st["removed"] == {"no_space": 2}
    assert st["faults"] == {"set.capacity": 1}
    assert st["no_space_retries"] == 0  # a was not written again
    assert st["reserved_bytes"] == 0
    got, data = await read_back(b, [p3, b_, c, d, a, p1, p2], SMALL_PAGE)
    assert got == [True] * 4 + [False] * 3
    assert data[:4] == [pages[2], *pages[4:]]
