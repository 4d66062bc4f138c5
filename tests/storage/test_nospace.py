"""A full disk is capacity pressure (issue 23 item 5).

With no capacity configured, or one larger than the filesystem, the LRU bound never evicts, so
once the disk was full every later write failed. A write that fails with ENOSPC now evicts
least recently used objects of this backend and is retried once.
"""

from __future__ import annotations

import os

import pytest

from asynccache.storage.faults import FaultInjectingBackend, FaultKind, FaultRule
from asynccache.storage.file import FileBackend
from asynccache.storage.pageformat import HEADER_SIZE

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
