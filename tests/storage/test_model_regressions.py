"""Races of the file backend's bookkeeping found by tests/storage/test_file_model.py, each
ordered here with a fault hook that holds a worker thread at a chosen raw operation.

* Two calls take pages of one segment and both fail to unlink them: the pages go back into
  the index as one file, counted once (they were two units of the same bytes).
* A set waiting for one key another call keeps busy wrote a key that a delete or an eviction
  took meanwhile: it must wait for that call too (it wrote the new page, then the other
  call's unlink removed it, and the index kept a page that was gone).
* A ``clear`` listing the directory while a set writes counted the set's own temp files as
  another writer's (capacity taken for up to ``tmp_recheck_s``).
* An ``exists_prefix`` adopting the files it found indexed a page whose eviction or delete
  unlinked it while the stat ran (the key was busy then, no longer at the end).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

import anyio
import pytest

from asynccache.storage.faults import Fault, FaultKind
from asynccache.storage.file import FileBackend
from asynccache.storage.segment import file_bytes
from tests.storage.test_evict_faults import FILE, PAGE, consistent, disk_bytes, suffix_of, until


class Hold:
    """Unlinks of the keys in ``held`` wait until their event is set (then fail with EIO if
    the key is in ``eio``); other unlinks of ``eio`` keys fail at once."""

    def __init__(self, held: dict[str, threading.Event], eio: Iterable[str] = ()) -> None:
        self.held = held
        self.eio = set(eio)
        self.reached = {k: threading.Event() for k in held}

    def decide(self, op: str, key: str) -> Fault | None:
        if op != "delete":
            return None
        if key in self.held:
            self.reached[key].set()
            self.held[key].wait(10)
        return Fault(FaultKind.EIO) if key in self.eio else None


async def test_segment_pages_two_deletes_fail_to_unlink_are_counted_once(
    tmp_path, layout, make_keys, make_pages
) -> None:
    """delete([a]) and delete([b]) of one segment's pages: the first takes a (the segment's
    entry keeps b), the second takes b (the entry goes, its bytes with it); both unlinks fail
    (EIO). Both pages go back, into one entry of the segment's bytes: before, the second
    made a second entry, and the index counted the file twice."""
    a, b_, c = make_keys(3)
    b = FileBackend(tmp_path, layout, segment_bytes=1 << 20, io_threads=4)
    assert await b.set_batch([a, b_, c], make_pages(3, PAGE)) == [True] * 3
    size = file_bytes([PAGE] * 3, False)
    assert b.stats()["used_bytes"] == size
    assert await b.delete([c]) == 1  # the segment still holds a and b
    go = threading.Event()
    hook = Hold({a: go}, eio={a, b_})
    b.set_fault_hook(hook)
    async with anyio.create_task_group() as tg:
        tg.start_soon(b.delete, [a])  # takes a; its unlink waits
        assert await until(hook.reached[a].is_set)
        assert await b.delete([b_]) == 0  # takes b (the last page: the unit goes); EIO
        go.set()  # a's unlink fails too
    st = b.stats()
    assert (st["objects"], st["files"]) == (2, 1)
    assert st["used_bytes"] == disk_bytes(tmp_path, suffix_of(b)) == size
    assert consistent(b, tmp_path)
    b.set_fault_hook(None)
    assert await b.delete([a, b_]) == 2
    assert b.stats()["used_bytes"] == disk_bytes(tmp_path, suffix_of(b)) == 0


async def test_a_set_waiting_for_one_key_also_waits_for_a_key_taken_meanwhile(
    tmp_path, layout, make_keys, make_pages
) -> None:
    """set([x, k]) finds x indexed (present) and k busy (a delete unlinking it) and waits for
    k. Meanwhile a delete (or an eviction) takes x and its unlink waits. When k is free, x
    is no longer indexed: the set must wait for x's unlink too before writing x, else the
    unlink removes the page the set just published and the index keeps it."""
    x, k = make_keys(2)
    pages = make_pages(4, PAGE)
    b = FileBackend(tmp_path, layout, io_threads=4)
    assert await b.set_batch([x, k], pages[:2]) == [True, True]
    k_go, x_go = threading.Event(), threading.Event()
    hook = Hold({k: k_go, x: x_go})
    b.set_fault_hook(hook)
    done: list[list[bool]] = []

    async def set_x_and_k() -> None:
        done.append(await b.set_batch([x, k], pages[2:4]))

    async with anyio.create_task_group() as tg:
        tg.start_soon(b.delete, [k])  # k busy: its unlink waits
        assert await until(hook.reached[k].is_set)
        tg.start_soon(set_x_and_k)  # x indexed (present), k busy: waits for k
        await anyio.sleep(0.05)
        tg.start_soon(b.delete, [x])  # takes x; its unlink waits
        assert await until(hook.reached[x].is_set)
        k_go.set()  # the delete of k ends: the waiting set goes on (and must wait for x)
        await until(lambda: bool(done), 40)
        x_go.set()  # the unlink of (the old) x
    assert done == [[True, True]]
    assert os.path.exists(b.path(x)) and x in b._index  # the new x, written after the unlink
    assert consistent(b, tmp_path)
    bufs = [bytearray(PAGE), bytearray(PAGE)]
    assert await b.get_batch([x, k], bufs) == [True, True]
    assert [bytes(v) for v in bufs] == pages[2:4]


async def test_clear_during_a_write_does_not_count_the_writers_own_temp_files(
    tmp_path, layout, make_keys, make_pages
) -> None:
    keys = make_keys(3)
    b = FileBackend(tmp_path, layout, capacity_bytes=2 * FILE)
    await b.start()
    assert b.writer_id is not None
    # One of this backend's writes in flight: its temp file, named with its writer id.
    sub = tmp_path / keys[2][:2]
    sub.mkdir(exist_ok=True)
    tmp = sub / f".{b.writer_id}.{keys[2]}.abcd.tmp"
    tmp.write_bytes(b"\0" * FILE)
    assert await b.clear() == 0
    assert tmp.exists()  # its own in-flight write: left alone ...
    st = b.stats()
    assert (st["temp_files"], st["temp_bytes"]) == (0, 0)  # ... and counted as reserved only
    tmp.unlink()  # the write ends
    assert await b.set_batch(keys[:2], make_pages(2, PAGE)) == [True, True]  # room for two


class HoldStat:
    """The stat ``exists_prefix`` makes of ``key`` waits until ``go`` is set; unlinks of
    ``unlink`` wait until ``unlink_go`` is set."""

    def __init__(self, key: str, unlink: str) -> None:
        self.key, self.unlink = key, unlink
        self.go, self.unlink_go = threading.Event(), threading.Event()
        self.reached, self.unlink_reached = threading.Event(), threading.Event()

    def decide(self, op: str, key: str) -> Fault | None:
        if op == "exists" and key == self.key:
            self.reached.set()
            self.go.wait(10)
        elif op == "delete" and key == self.unlink:
            self.unlink_reached.set()
            self.unlink_go.wait(10)
        return None


@pytest.mark.parametrize("how", ["evict", "delete"])
async def test_exists_does_not_adopt_a_page_unlinked_while_it_looked(
    tmp_path, layout, make_keys, make_pages, how
) -> None:
    """k is being evicted (or deleted): out of the index, its unlink running. exists([k, j])
    (j another instance's page) stats k, still there, then j, whose stat waits; meanwhile the
    unlink of k ends. When j's stat returns, k must not be adopted: its file is gone. (It was:
    the key was busy when stat'd but no longer at the end, and the index counted a file that
    was not there.)"""
    k, j, x = make_keys(3)
    pages = make_pages(3, PAGE)
    b = FileBackend(tmp_path, layout, capacity_bytes=FILE, io_threads=4)
    assert await b.set_batch([k], pages[:1]) == [True]
    other = FileBackend(tmp_path, layout)
    assert await other.set_batch([j], pages[1:2]) == [True]  # unknown to b
    hook = HoldStat(j, unlink=k)
    b.set_fault_hook(hook)
    found: list[int] = []

    async def exists() -> None:
        found.append(await b.exists_prefix([k, j]))

    async with anyio.create_task_group() as tg:
        if how == "evict":
            tg.start_soon(b.set_batch, [x], pages[2:])  # evicts k
        else:
            tg.start_soon(b.delete, [k])
        assert await until(hook.unlink_reached.is_set)
        assert k not in b._index and k in b._busy
        tg.start_soon(exists)
        assert await until(hook.reached.is_set)  # k stat'd (its file still there), j waits
        hook.unlink_go.set()
        assert await until(lambda: k not in b._busy)  # k unlinked
        hook.go.set()
    assert not os.path.exists(b.path(k))
    assert found == [0]  # the prefix stops at k
    indexed = [x] if how == "evict" else []
    assert b._index.keys() == indexed
    assert b.stats()["used_bytes"] == FILE * len(indexed)
    b.set_fault_hook(None)
    assert await b.exists_prefix([j]) == 1  # adopted now
