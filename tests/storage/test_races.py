"""Races and cancellation of the file backend, ordered by gates in the fault hook (a worker
thread blocks at a chosen raw operation until the test opens the gate): whatever overlaps,
the index agrees with the directory (``stats()`` used bytes and objects are what is on
disk), capacity holds, a deleted page is a miss and a set after a race really stores."""

from __future__ import annotations

import os
import threading

import anyio
import pytest

from asynccache.storage.faults import Fault
from asynccache.storage.file import FileBackend
from asynccache.storage.pageformat import HEADER_SIZE

PAGE = 4096
FILE = HEADER_SIZE + PAGE


class Gate:
    """A fault hook: the first ``(op, key)`` in ``at`` blocks its worker thread until opened."""

    def __init__(self, *at: tuple[str, str]) -> None:
        self.at = set(at)
        self.reached = threading.Event()
        self.opened = threading.Event()

    def decide(self, op: str, key: str) -> Fault | None:
        if (op, key) in self.at:
            self.at.discard((op, key))
            self.reached.set()
            self.opened.wait(10)
        return None


async def until(cond, limit: int = 500) -> bool:
    """Let the loop run until ``cond()`` holds (False if it never does)."""
    for _ in range(limit):
        if cond():
            return True
        await anyio.sleep(0.005)
    return False


async def reached(gate: Gate) -> None:
    assert await until(gate.reached.is_set)


def on_disk(b: FileBackend) -> tuple[int, int]:
    """(bytes of distinct page files, page names) of this layout under the root."""
    inodes: dict[int, int] = {}
    names = 0
    for dp, _dn, fn in os.walk(b.root):
        for f in fn:
            if f.endswith(b._suffix) and not f.startswith("."):
                st = os.stat(os.path.join(dp, f))
                inodes[st.st_ino] = st.st_size
                names += 1
    return sum(inodes.values()), names


def assert_consistent(b: FileBackend) -> None:
    used, names = on_disk(b)
    st = b.stats()
    assert (st["used_bytes"], st["objects"]) == (used, names)
    if b.capacity_bytes is not None:
        assert used <= b.capacity_bytes


def page(i: int) -> bytes:
    return bytes([i % 251]) * PAGE


async def read(b: FileBackend, keys: list[str]) -> tuple[list[bool], list[bytes]]:
    bufs = [bytearray(PAGE) for _ in keys]
    ok = await b.get_batch(keys, bufs)
    return ok, [bytes(x) for x in bufs]


@pytest.mark.parametrize("segment", [None, 1 << 20])
async def test_cancelled_set_indexes_what_it_published_and_unlinks_its_victims(
    tmp_path, layout, make_keys, segment
) -> None:
    keys = make_keys(7)
    old, new = keys[:3], keys[3:6]
    b = FileBackend(tmp_path, layout, capacity_bytes=3 * FILE, io_threads=4, segment_bytes=segment)
    await b.start()
    for i, k in enumerate(old):  # one file each
        await b.set_batch([k], [page(i)])
    gate = Gate(("write", new[2]), ("delete", old[1]))
    b.set_fault_hook(gate)
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.set_batch, new, [page(10), page(11), page(12)])
            await reached(gate)
            if segment is None:  # the other pages are published while one write hangs
                assert await until(lambda: all(os.path.exists(b.path(k)) for k in new[:2]))
            scope.cancel()
            gate.opened.set()  # the victim's unlink still runs (shielded); the write may
    b.set_fault_hook(None)
    assert await until(lambda: b._runner.stuck == 0)
    assert_consistent(b)
    if segment is None:
        assert (await read(b, new[:2]))[0] == [True, True]
    assert await b.set_batch([keys[6]], [page(6)]) == [True]
    assert_consistent(b)
    assert (await read(b, [keys[6]])) == ([True], [page(6)])


async def test_delete_overlapping_set_of_the_same_key(tmp_path, layout, make_keys) -> None:
    (k,) = make_keys(1)
    b = FileBackend(tmp_path, layout, io_threads=4)
    await b.start()
    await b.set_batch([k], [page(1)])
    gate = Gate(("delete", k))
    b.set_fault_hook(gate)
    results: dict[str, object] = {}

    async def setter() -> None:
        results["set"] = await b.set_batch([k], [page(2)])

    async with anyio.create_task_group() as tg:
        tg.start_soon(b.delete, [k])
        await reached(gate)
        tg.start_soon(setter)
        await until(lambda: "set" in results, 40)  # done (unordered) or waiting (ordered)
        gate.opened.set()
    assert (k in b._index) == os.path.exists(b.path(k))
    assert_consistent(b)
    assert await b.set_batch([k], [page(3)]) == [True]
    assert os.path.exists(b.path(k)) and await b.exists_prefix([k]) == 1
    ok, data = await read(b, [k])
    assert ok == [True] and data[0] in (page(2), page(3))
    assert_consistent(b)


async def test_eviction_overlapping_set_of_the_victim(tmp_path, layout, make_keys) -> None:
    k, x = make_keys(2)
    y = make_keys(3)[2]
    b = FileBackend(tmp_path, layout, capacity_bytes=2 * FILE, io_threads=4)
    await b.start()
    await b.set_batch([k], [page(1)])
    await b.set_batch([y], [page(5)])
    gate = Gate(("delete", k))  # the victim's unlink hangs
    b.set_fault_hook(gate)
    results: dict[str, object] = {}

    async def setter() -> None:
        results["set"] = await b.set_batch([k], [page(2)])

    async with anyio.create_task_group() as tg:
        tg.start_soon(b.set_batch, [x], [page(3)])  # evicts k
        await reached(gate)
        tg.start_soon(setter)
        await until(lambda: "set" in results, 40)
        gate.opened.set()
    assert (k in b._index) == os.path.exists(b.path(k))
    assert_consistent(b)
    assert await b.set_batch([k], [page(4)]) == [True]
    assert os.path.exists(b.path(k)) and await b.exists_prefix([k]) == 1
    assert (await read(b, [k]))[0] == [True]
    assert_consistent(b)


async def test_get_miss_racing_set_keeps_the_fresh_page(tmp_path, layout, make_keys) -> None:
    k, j = make_keys(2)
    b = FileBackend(tmp_path, layout, io_threads=1)  # k's read, then j's
    await b.start()
    await b.set_batch([j], [page(2)])
    gate = Gate(("read", j))
    b.set_fault_hook(gate)
    got: dict[str, object] = {}

    async def getter() -> None:
        got["get"] = await read(b, [k, j])

    async with anyio.create_task_group() as tg:
        tg.start_soon(getter)
        await reached(gate)  # k's miss is in
        b.set_fault_hook(None)
        assert b._runner._limiter is not None
        b._runner._limiter.total_tokens = 2  # a thread for the set meanwhile
        assert await b.set_batch([k], [page(1)]) == [True]
        gate.opened.set()
    assert k in b._index and os.path.exists(b.path(k))
    assert_consistent(b)
    assert await read(b, [k]) == ([True], [page(1)])


async def test_segment_page_deleted_by_another_instance_is_a_miss(
    tmp_path, layout, make_keys
) -> None:
    keys = make_keys(4)
    a = FileBackend(tmp_path, layout, segment_bytes=1 << 20)
    await a.start()
    assert await a.set_batch(keys, [page(i) for i in range(4)]) == [True] * 4
    os.unlink(a.path(keys[1]))  # another instance's delete: the name is gone
    ok, data = await read(a, keys)
    assert ok == [True, False, True, True]
    assert [data[0], data[2], data[3]] == [page(0), page(2), page(3)]
    assert keys[1] not in a._index and await a.exists_prefix(keys) == 1
    assert_consistent(a)


async def test_a_key_held_by_a_stuck_unlink_fails_later_calls_at_their_deadline(
        tmp_path, layout, make_keys, short_deadline) -> None:
    # A delete whose unlink hangs (a dead disk) keeps its key busy until the thread returns;
    # a set or delete of that key waits for it at most timeout_s, then fails (counted), not
    # for ever.
    (k,) = make_keys(1)
    b = FileBackend(tmp_path, layout, io_threads=4)
    await b.start()
    assert await b.set_batch([k], [page(1)]) == [True]
    gate = Gate(("delete", k))
    b.set_fault_hook(gate)
    try:
        with short_deadline(b, 0.2):  # every call here is meant to time out
            assert await b.delete([k]) == 0  # its unlink outlives the deadline
            with anyio.fail_after(5):
                assert await b.set_batch([k], [page(2)]) == [False]
                assert await b.delete([k]) == 0
        faults = b.stats()["faults"]
        assert (faults.get("delete.timeout"), faults.get("set.timeout")) == (2, 1)
    finally:
        gate.opened.set()
    assert await until(lambda: k not in b._busy)
    assert await b.set_batch([k], [page(3)]) == [True]
    assert (await read(b, [k])) == ([True], [page(3)])
    assert_consistent(b)
    await b.aclose()
