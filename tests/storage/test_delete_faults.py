"""Pages whose unlink fails in ``delete`` stay counted (file backend).

``delete`` takes pages out of the LRU index and unlinks their files (``clear`` too:
test_clear_faults.py). When an unlink does not happen (it fails with an OS error, the backend
fails fast with ``unavailable`` because too many threads are stuck, or it is still running at
the deadline), the file is still on disk and ``get_batch`` still reads it: the page must stay
in the index with its file's bytes (so they count against ``capacity_bytes`` and a later
delete, clear or eviction removes it), must not be told to the listeners as removed, and the
call must say it was not removed (its count leaves it out) and count and log the failure.
The tests count the bytes really on disk.
"""

from __future__ import annotations

import os

import pytest

from asynccache.storage.faults import FaultInjectingBackend, FaultKind, FaultRule
from asynccache.storage.file import FileBackend
from asynccache.storage.segment import file_bytes
from asynccache.testing import stuck_pages
from tests.storage.test_evict_faults import (
    FILE,
    PAGE,
    Gate,
    disk_bytes,
    fault_count,
    suffix_of,
    until,
)


def logged(caplog: pytest.LogCaptureFixture, event: str, *fields: str) -> list[dict[str, object]]:
    """The ``event`` events logged (the given fields of each)."""
    return [
        {k: r.asynccache_event.get(k) for k in fields}
        for r in caplog.records
        if getattr(r, "asynccache_event", {}).get("event") == event
    ]


def delete_faults(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [e for e in logged(caplog, "storage_faults", "op", "faults") if e["op"] == "delete"]


async def read(b: FileBackend, keys: list[str]) -> tuple[list[bool], list[bytes]]:
    bufs = [bytearray(PAGE) for _ in keys]
    ok = await b.get_batch(keys, bufs)
    return ok, [bytes(x) for x in bufs]


def eio_on(keys: list[str] | None = None) -> list[FaultRule]:
    """Unlinks (of ``keys``, else of every page) fail with EIO."""
    only = frozenset(keys) if keys is not None else None
    return [FaultRule(FaultKind.EIO, ops=frozenset({"delete"}), keys=only)]


async def wait_unstuck(b: FileBackend) -> None:
    assert await until(lambda: b.stats()["stuck_threads"] == 0, 4000)


@pytest.mark.parametrize("segmented", [False, True], ids=["pages", "segments"])
async def test_a_page_whose_unlink_fails_is_not_deleted_stays_counted_and_goes_later(
    tmp_path, layout, make_keys, make_pages, segmented, caplog
) -> None:
    """The unlink of one page fails (EIO): its file is still there and still readable, so
    the page stays indexed with its file's bytes, is not told removed, and delete's count
    leaves it out; once the disk is healthy a delete removes it."""
    inner = FileBackend(tmp_path, layout, segment_bytes=1 << 20 if segmented else None)
    heard: list[str] = []
    inner.add_eviction_listener(heard.extend)
    keys, pages = make_keys(3), make_pages(3, PAGE)
    assert await inner.set_batch(keys, pages) == [True] * 3
    sfx = suffix_of(inner)
    size = file_bytes([PAGE] * 3, False) if segmented else 3 * FILE
    assert disk_bytes(tmp_path, sfx) == inner.stats()["used_bytes"] == size
    fb = FaultInjectingBackend(inner, eio_on(keys[1:2]))

    # Alone: a segment's page goes back into its segment, a page file back into the index.
    assert await fb.delete(keys[1:2]) == 0
    st = inner.stats()
    assert disk_bytes(tmp_path, sfx) == st["used_bytes"] == size
    assert (st["objects"], st["files"]) == (3, 1 if segmented else 3)
    assert heard == [] and st["removed"] == {}
    assert fault_count(inner, "delete", "io_error") == 1
    assert delete_faults(caplog) == [{"op": "delete", "faults": {"io_error": 1}}]

    # With the others: they go, it stays (a segment's file stays whole while it links it).
    assert await fb.delete(keys) == 2
    st = inner.stats()
    kept = size if segmented else FILE
    assert disk_bytes(tmp_path, sfx) == st["used_bytes"] == kept
    assert (st["objects"], st["files"]) == (1, 1)
    assert sorted(heard) == sorted([keys[0], keys[2]]) and st["removed"] == {"delete": 2}
    assert fault_count(inner, "delete", "io_error") == 2
    assert os.path.exists(inner.path(keys[1]))
    assert not any(os.path.exists(inner.path(k)) for k in (keys[0], keys[2]))
    ok, got = await read(inner, keys)
    assert ok == [False, True, False] and got[1] == pages[1]  # deleted ones are misses
    assert await inner.exists_prefix(keys[1:2]) == 1

    fb.clear_rules()  # healthy again: the next delete removes it
    assert await fb.delete(keys[1:2]) == 1
    st = inner.stats()
    assert disk_bytes(tmp_path, sfx) == st["used_bytes"] == 0
    assert (st["objects"], st["files"]) == (0, 0)
    assert sorted(heard) == sorted(keys) and st["removed"] == {"delete": 3}
    assert (await read(inner, keys))[0] == [False] * 3
    assert await inner.exists_prefix(keys) == 0


async def test_a_page_whose_delete_failed_counts_against_the_capacity_and_goes_first(
    tmp_path, layout, make_keys, make_pages
) -> None:
    """The failed delete's file still takes room: the next set must evict to stay within
    capacity_bytes, and the page the caller wanted gone is the first victim."""
    inner = FileBackend(tmp_path, layout, capacity_bytes=2 * FILE)
    heard: list[str] = []
    inner.add_eviction_listener(heard.extend)
    keys, pages = make_keys(3), make_pages(3, PAGE)
    for i in range(2):  # keys[0] least recent
        assert await inner.set_batch(keys[i : i + 1], pages[i : i + 1]) == [True]
    fb = FaultInjectingBackend(inner, eio_on())
    assert await fb.delete(keys[1:2]) == 0
    fb.clear_rules()
    assert await fb.set_batch(keys[2:3], pages[2:3]) == [True]
    sfx = suffix_of(inner)
    assert disk_bytes(tmp_path, sfx) == inner.stats()["used_bytes"] <= inner.capacity_bytes
    assert heard == [keys[1]] and inner.stats()["removed"] == {"capacity": 1}
    assert not os.path.exists(inner.path(keys[1]))
    ok, got = await read(inner, [keys[0], keys[2]])
    assert ok == [True, True] and got == [pages[0], pages[2]]


async def test_a_delete_that_fails_fast_keeps_its_pages(
    tmp_path, layout, make_keys, make_pages, short_deadline
) -> None:
    """Too many stuck threads: the delete fails fast (``unavailable``) and unlinks nothing."""
    b = FileBackend(tmp_path, layout, io_threads=1, max_stuck_threads=1)
    heard: list[str] = []
    b.add_eviction_listener(heard.extend)
    keys, pages = make_keys(3), make_pages(3, PAGE)
    assert await b.set_batch(keys[:2], pages[:2]) == [True, True]
    sfx = suffix_of(b)
    with stuck_pages(b, keys[2:3]) as stuck:  # a page nobody stored: reads of it hang
        with short_deadline(b, 0.2):
            assert (await read(b, keys[2:3]))[0] == [False]
        assert b.stats()["stuck_threads"] == 1  # the backend now fails fast
        assert await b.delete(keys[:2]) == 0
        st = b.stats()
        assert disk_bytes(tmp_path, sfx) == st["used_bytes"] == 2 * FILE
        assert st["objects"] == 2 and heard == [] and st["removed"] == {}
        assert fault_count(b, "delete", "unavailable") == 2
        assert await b.exists_prefix(keys[:2]) == 2
        stuck.release()
    await wait_unstuck(b)
    ok, got = await read(b, keys[:2])
    assert ok == [True, True] and got == pages[:2]
    assert await b.delete(keys[:2]) == 2
    assert disk_bytes(tmp_path, sfx) == b.stats()["used_bytes"] == 0
    assert sorted(heard) == sorted(keys[:2]) and b.stats()["removed"] == {"delete": 2}
    assert (await read(b, keys[:2]))[0] == [False, False]


async def test_a_delete_whose_unlink_outlives_the_deadline_counts_the_page_until_it_returns(
    tmp_path, layout, make_keys, make_pages, short_deadline
) -> None:
    """The unlink hangs past the deadline (a dead disk): the delete says the page was not
    removed, it stays counted; when the unlink returns and removed it, it is dropped and told
    removed then."""
    b = FileBackend(tmp_path, layout, io_threads=2)
    heard: list[str] = []
    b.add_eviction_listener(heard.extend)
    keys, pages = make_keys(2), make_pages(2, PAGE)
    assert await b.set_batch(keys, pages) == [True, True]
    gate = Gate(keys[0])
    b.set_fault_hook(gate)
    sfx = suffix_of(b)
    try:
        # One call: keys[1]'s unlink must end within the short deadline, keys[0]'s outlives it.
        with short_deadline(b, 1.0):
            assert await b.delete(keys) == 1  # keys[1] goes; keys[0]'s unlink hangs
        assert gate.reached.is_set()
        st = b.stats()
        assert disk_bytes(tmp_path, sfx) == st["used_bytes"] == FILE
        assert st["objects"] == 1 and heard == [keys[1]]
        assert fault_count(b, "delete", "timeout") == 1
    finally:
        gate.opened.set()
    assert await until(lambda: keys[0] not in b._busy)
    assert disk_bytes(tmp_path, sfx) == b.stats()["used_bytes"] == 0
    assert heard == [keys[1], keys[0]] and b.stats()["removed"] == {"delete": 2}
    assert (await read(b, keys))[0] == [False, False]
    await wait_unstuck(b)
