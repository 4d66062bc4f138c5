"""Eviction victims whose unlink fails stay counted (file backend).

``set_batch`` (and ``start``) choose least recently used files to evict, drop them from the
index and then unlink them. When the unlink does not happen (the backend fails fast with
``unavailable`` because too many threads are stuck, or the unlink fails with an OS error), the
files stay on disk: they must stay in the index too (so their bytes count against
``capacity_bytes`` and a later eviction removes them), must not be told to eviction listeners
as gone, and the failure is logged and counted. The tests count the bytes really on disk.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from asynccache.storage.faults import Fault, FaultInjectingBackend, FaultKind, FaultRule
from asynccache.storage.file import FileBackend
from asynccache.storage.pageformat import HEADER_SIZE
from asynccache.storage.segment import file_bytes
from asynccache.testing import stuck_pages

PAGE = 4096
FILE = HEADER_SIZE + PAGE


def disk_bytes(root: Path, suffix: str) -> int:
    """Bytes of the page files under ``root`` (regular files only; a segment once)."""
    seen: set[int] = set()
    total = 0
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            if name.startswith(".") or not name.endswith(suffix):
                continue
            st = os.lstat(os.path.join(dirpath, name))
            if os.path.stat.S_ISREG(st.st_mode) and st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_size
    return total


def suffix_of(b: FileBackend) -> str:
    return b.object_name("0" * 64)[64:]


def consistent(b: FileBackend, root: Path) -> bool:
    """The index counts exactly the page files on disk."""
    st = b.stats()
    indexed = b._index.keys()
    on_disk = {k for k in indexed if os.path.exists(b.path(k))}
    return st["used_bytes"] == disk_bytes(root, suffix_of(b)) and on_disk == set(indexed)


def evict_failed(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    """The ``storage_evict_failed`` events logged (cause, pages, reasons)."""
    return [
        {k: r.asynccache_event[k] for k in ("cause", "pages", "reasons")}
        for r in caplog.records
        if getattr(r, "asynccache_event", {}).get("event") == "storage_evict_failed"
    ]


def fault_count(b: FileBackend, op: str, reason: str) -> int:
    return b.stats()["faults"].get(f"{op}.{reason}", 0)


async def test_victims_of_a_set_that_fails_fast_stay_on_disk_and_in_the_index(
    tmp_path, layout, make_keys, make_pages, caplog, short_deadline
) -> None:
    """Too many stuck threads: the set fails fast (``unavailable``), and so does the unlink
    of the victims it chose. Their files are still there: the index must still count them."""
    b = FileBackend(
        tmp_path,
        layout,
        capacity_bytes=4 * FILE,
        io_threads=1,
        max_stuck_threads=1,
    )
    heard: list[str] = []
    b.add_eviction_listener(heard.extend)
    keys, pages = make_keys(7), make_pages(7, PAGE)
    assert await b.set_batch(keys[:4], pages[:4]) == [True] * 4
    sfx = suffix_of(b)
    assert disk_bytes(tmp_path, sfx) == b.stats()["used_bytes"] == 4 * FILE

    with stuck_pages(b, keys[6:7]) as stuck:  # a page nobody stored: reads of it hang
        with short_deadline(b, 0.2):
            assert await b.get_batch(keys[6:7], [bytearray(PAGE)]) == [False]
        assert b.stats()["stuck_threads"] == 1  # the backend now fails fast
        assert await b.set_batch(keys[4:6], pages[4:6]) == [False, False]
        stats = b.stats()
        # Nothing was unlinked and nothing written: the four files are all still there ...
        assert disk_bytes(tmp_path, sfx) == 4 * FILE
        assert all(os.path.exists(b.path(k)) for k in keys[:4])
        # ... and counted, known, and not told as gone.
        assert stats["used_bytes"] == 4 * FILE
        assert stats["objects"] == 4
        assert heard == []
        assert stats["removed"] == {}
        assert stats["evictions"] == 0
        assert await b.exists_prefix(keys[:4]) == 4
        # The skipped writes and the failed eviction are counted and logged.
        assert fault_count(b, "set", "unavailable") == 2
        assert fault_count(b, "evict", "unavailable") == 2
        assert evict_failed(caplog) == [
            {"cause": "capacity", "pages": 2, "reasons": {"unavailable": 2}}
        ]
        stuck.release()
    for _ in range(200):  # the stuck read returns once the FIFO is gone
        if b.stats()["stuck_threads"] == 0:
            break
        await anyio.sleep(0.02)
    assert b.stats()["stuck_threads"] == 0

    # Healthy again: the same set evicts the two least recently used files for real.
    assert await b.set_batch(keys[4:6], pages[4:6]) == [True, True]
    assert disk_bytes(tmp_path, sfx) == b.stats()["used_bytes"] == 4 * FILE
    assert sorted(heard) == sorted(keys[:2])
    assert not any(os.path.exists(b.path(k)) for k in keys[:2])


@pytest.mark.parametrize("segmented", [False, True], ids=["pages", "segments"])
async def test_victims_whose_unlink_fails_stay_counted_and_are_evicted_later(
    tmp_path, layout, make_keys, make_pages, segmented, caplog
) -> None:
    """The unlink of a victim fails (EIO) while the writes succeed: the victim's file stays,
    so it stays in the index (least recent first) and the next eviction takes it."""
    batch = file_bytes([PAGE, PAGE], False) if segmented else 2 * FILE  # one set of 2 pages
    inner = FileBackend(
        tmp_path,
        layout,
        capacity_bytes=2 * batch,
        segment_bytes=2 * batch if segmented else None,
    )
    heard: list[str] = []
    inner.add_eviction_listener(heard.extend)
    keys, pages = make_keys(8), make_pages(8, PAGE)
    for i in range(0, 4, 2):
        assert await inner.set_batch(keys[i : i + 2], pages[i : i + 2]) == [True, True]
    sfx = suffix_of(inner)
    assert disk_bytes(tmp_path, sfx) == inner.stats()["used_bytes"] == 2 * batch
    assert inner.stats()["files"] == (2 if segmented else 4)

    fb = FaultInjectingBackend(inner, [FaultRule(FaultKind.EIO, ops=frozenset({"delete"}))])
    assert await fb.set_batch(keys[4:6], pages[4:6]) == [True, True]
    # The victims (keys[0:2]) could not be unlinked: 3 batches' bytes on disk, all counted.
    assert disk_bytes(tmp_path, sfx) == inner.stats()["used_bytes"] == 3 * batch
    assert inner.stats()["objects"] == 6
    assert heard == [] and inner.stats()["removed"] == {}
    assert inner.stats()["evictions"] == 0
    assert fault_count(inner, "evict", "io_error") == 2
    assert evict_failed(caplog) == [{"cause": "capacity", "pages": 2, "reasons": {"io_error": 2}}]
    assert await inner.exists_prefix(keys[:6]) == 6

    # The disk heals: the next set evicts the files still over the bound, oldest first.
    fb.clear_rules()
    assert await fb.set_batch(keys[6:8], pages[6:8]) == [True, True]
    assert disk_bytes(tmp_path, sfx) == inner.stats()["used_bytes"] == 2 * batch
    assert sorted(heard) == sorted(keys[:4])
    assert await inner.exists_prefix(keys[4:8]) == 4
    assert not any(os.path.exists(inner.path(k)) for k in keys[:4])


async def test_start_trimming_to_capacity_keeps_files_it_cannot_unlink(
    tmp_path, layout, make_keys, make_pages, caplog
) -> None:
    """A restart with a smaller capacity trims the index; an unlink that fails keeps its file
    in the index (and the directory's bytes counted)."""
    first = FileBackend(tmp_path, layout)
    keys, pages = make_keys(4), make_pages(4, PAGE)
    assert await first.set_batch(keys, pages) == [True] * 4
    await first.aclose()

    inner = FileBackend(tmp_path, layout, capacity_bytes=2 * FILE)
    heard: list[str] = []
    inner.add_eviction_listener(heard.extend)
    FaultInjectingBackend(inner, [FaultRule(FaultKind.EIO, ops=frozenset({"delete"}))])
    await inner.start()
    sfx = suffix_of(inner)
    assert disk_bytes(tmp_path, sfx) == inner.stats()["used_bytes"] == 4 * FILE
    assert heard == [] and inner.stats()["removed"] == {}
    assert fault_count(inner, "evict", "io_error") == 2
    assert evict_failed(caplog) == [{"cause": "capacity", "pages": 2, "reasons": {"io_error": 2}}]


class Gate:
    """A fault hook: the unlink of ``key`` blocks its worker thread until opened."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.reached = threading.Event()
        self.opened = threading.Event()

    def decide(self, op: str, key: str) -> Fault | None:
        if op == "delete" and key == self.key and not self.reached.is_set():
            self.reached.set()
            self.opened.wait(10)
        return None


async def until(cond: Callable[[], bool], limit: int = 1000) -> bool:
    for _ in range(limit):
        if cond():
            return True
        await anyio.sleep(0.005)
    return False


async def test_a_victim_whose_unlink_outlives_the_deadline_is_counted_until_it_returns(
    tmp_path, layout, make_keys, make_pages, caplog, short_deadline
) -> None:
    """The victim's unlink hangs past the deadline (a dead disk): its file may still be there,
    so it stays counted; when the unlink finally returns and removed it, it is dropped and
    told gone then."""
    b = FileBackend(
        tmp_path,
        layout,
        capacity_bytes=2 * FILE,
        io_threads=2,
    )
    heard: list[str] = []
    b.add_eviction_listener(heard.extend)
    keys, pages = make_keys(3), make_pages(3, PAGE)
    for i in range(2):
        assert await b.set_batch(keys[i : i + 1], pages[i : i + 1]) == [True]
    gate = Gate(keys[0])
    b.set_fault_hook(gate)
    sfx = suffix_of(b)
    try:
        # One call: its write must end within the short deadline, its eviction outlives it.
        with short_deadline(b, 1.0):
            assert await b.set_batch(keys[2:3], pages[2:3]) == [True]  # evicts keys[0]: hangs
        assert gate.reached.is_set()
        assert b.stats()["stuck_threads"] == 1
        assert disk_bytes(tmp_path, sfx) == b.stats()["used_bytes"] == 3 * FILE
        assert heard == [] and fault_count(b, "evict", "timeout") == 1
        assert evict_failed(caplog) == [
            {"cause": "capacity", "pages": 1, "reasons": {"timeout": 1}}
        ]
    finally:
        gate.opened.set()
    assert await until(lambda: keys[0] not in b._busy)
    assert disk_bytes(tmp_path, sfx) == b.stats()["used_bytes"] == 2 * FILE
    assert heard == [keys[0]] and b.stats()["removed"] == {"capacity": 1}
    assert b.stats()["evictions"] == 1
    assert await b.exists_prefix(keys[1:3]) == 2 and await b.exists_prefix(keys[:1]) == 0
