"""A corrupt page found by ``get_batch`` while other calls change the same key (file backend).

A read that finds a bad page removes its name and tells the listeners (cause ``corrupt``). Its
key may have changed while the read ran: it may have been evicted or deleted (that call unlinks
it and tells it), put back into the index under a new unit after an unlink that failed, or
written again. Whatever overlapped, the index must still agree with the directory (no page
indexed whose name is gone, no page told removed twice, none told removed that is still
indexed). Found by tests/storage/test_file_model.py; ordered here with a fault hook that
holds the read's worker thread until the other calls are done.
"""

from __future__ import annotations

import os
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

from asynccache.storage.faults import Fault, FaultKind
from asynccache.storage.file import FileBackend
from tests.storage.test_evict_faults import FILE, PAGE, consistent, until


class HeldRead:
    """The first read of ``key`` waits until :meth:`open` and then sees a byte flipped in
    flight (a corrupt page); the first unlink of each of ``eio`` fails with EIO."""

    def __init__(self, key: str, eio: frozenset[str] = frozenset()) -> None:
        self.key = key
        self.eio = set(eio)
        self.reached = threading.Event()
        self.opened = threading.Event()
        self._held = False

    def open(self) -> None:
        self.opened.set()

    def decide(self, op: str, key: str) -> Fault | None:
        if op == "delete" and key in self.eio:
            self.eio.discard(key)
            return Fault(FaultKind.EIO)
        if op == "read" and key == self.key and not self._held:
            self._held = True
            self.reached.set()
            self.opened.wait(10)
            return Fault(FaultKind.FLIP_BYTES, position=0.9)
        return None


@asynccontextmanager
async def held_get(
    b: FileBackend, key: str, eio: frozenset[str] = frozenset()
) -> AsyncIterator[list[list[bool]]]:
    """Run ``get_batch([key])`` under a :class:`HeldRead` hook (``eio`` as there): the body
    runs while the read is held, which goes on (and finds the page corrupt) when the body
    ends. Yields the list the get's result is appended to (filled once the block exits)."""
    hook = HeldRead(key, eio=eio)
    b.set_fault_hook(hook)
    got: list[list[bool]] = []

    async def get() -> None:
        got.append(await b.get_batch([key], [bytearray(PAGE)]))

    async with anyio.create_task_group() as tg:
        tg.start_soon(get)
        assert await until(hook.reached.is_set)
        try:
            yield got
        finally:
            hook.open()


async def test_a_key_read_twice_in_one_batch_is_told_removed_once(
    tmp_path, layout, make_keys, make_pages
) -> None:
    """``get_batch([k, k])``: the first read finds the name gone (a miss: the index drops the
    page and tells it ``missing``), the second finds the page corrupt (``corrupt``). It is one
    page, gone once: the listeners hear it once."""
    (k,) = make_keys(1)
    b = FileBackend(tmp_path, layout, io_threads=1)  # the two reads in order
    heard: list[str] = []
    b.add_eviction_listener(heard.extend)
    assert await b.set_batch([k], make_pages(1, PAGE)) == [True]
    path, aside = b.path(k), str(tmp_path / "aside")
    reads = [0]

    class Hook:
        def decide(self, op: str, key: str) -> Fault | None:
            if op != "read":
                return None
            reads[0] += 1
            if reads[0] == 1:  # another writer moves the page away ...
                os.rename(path, aside)
                return None
            os.rename(aside, path)  # ... and back, and this read finds it corrupt
            return Fault(FaultKind.FLIP_BYTES, position=0.9)

    b.set_fault_hook(Hook())
    assert await b.get_batch([k, k], [bytearray(PAGE), bytearray(PAGE)]) == [False, False]
    assert not os.path.exists(path)
    assert heard == [k]
    assert sum(b.stats()["removed"].values()) == 1
    assert k not in b._index and consistent(b, tmp_path)


async def test_a_corrupt_read_of_a_page_whose_delete_failed_drops_it(
    tmp_path, layout, make_keys, make_pages
) -> None:
    """A get reads a page while a delete of it fails (EIO): the page goes back into the index
    (a new unit: it was a file of its own). The read then finds the page corrupt and removes
    its name: the index must drop it too, not keep counting a file that is gone."""
    keys = make_keys(2)
    k = keys[0]
    b = FileBackend(tmp_path, layout, io_threads=4)
    heard: list[str] = []
    b.add_eviction_listener(heard.extend)
    assert await b.set_batch(keys, make_pages(2, PAGE)) == [True, True]
    async with held_get(b, k, eio=frozenset({k})) as got:
        assert await b.delete([k]) == 0  # the unlink failed: still there, still indexed
        assert k in b._index and heard == []
    assert got == [[False]]
    assert not os.path.exists(b.path(k))  # removed as corrupt
    assert heard == [k] and b.stats()["removed"] == {"corrupt": 1}
    assert k not in b._index
    assert consistent(b, tmp_path)
    assert b.stats()["used_bytes"] == FILE  # keys[1] only


async def test_a_corrupt_read_of_a_page_written_again_meanwhile_drops_it(
    tmp_path, layout, make_keys, make_pages
) -> None:
    """A get's read waits while the page is deleted and written again; then it reads the new
    file, finds it corrupt and removes the name: the index must drop the new file too."""
    (k,) = make_keys(1)
    b = FileBackend(tmp_path, layout, io_threads=4)
    heard: list[str] = []
    b.add_eviction_listener(heard.extend)
    old, new = make_pages(2, PAGE)
    assert await b.set_batch([k], [old]) == [True]
    async with held_get(b, k) as got:
        assert await b.delete([k]) == 1
        assert await b.set_batch([k], [new]) == [True]
    assert got == [[False]]
    assert not os.path.exists(b.path(k))
    assert heard == [k, k]  # the old file deleted, the new one removed as corrupt
    assert b.stats()["removed"] == {"delete": 1, "corrupt": 1}
    assert k not in b._index
    assert consistent(b, tmp_path)


async def test_a_corrupt_read_of_a_page_being_evicted_leaves_it_to_the_eviction(
    tmp_path, layout, make_keys, make_pages
) -> None:
    """A get finds a page corrupt while a set evicts it and its unlink is still running: the
    eviction unlinks it and tells it gone; the get must not tell it as well."""
    keys = make_keys(3)
    a, x, y = keys
    b = FileBackend(tmp_path, layout, capacity_bytes=2 * FILE, io_threads=4)
    heard: list[str] = []
    b.add_eviction_listener(heard.extend)
    pages = make_pages(3, PAGE)
    assert await b.set_batch([a], pages[:1]) == [True]
    assert await b.set_batch([x], pages[1:2]) == [True]
    unlink_held = threading.Event()
    unlink_go = threading.Event()
    hook = HeldRead(a)
    read_decide = hook.decide

    class Hook:
        def decide(self, op: str, key: str) -> Fault | None:
            if op == "delete" and key == a:  # the victim's unlink waits for the read
                unlink_held.set()
                unlink_go.wait(10)
                return None
            return read_decide(op, key)

    b.set_fault_hook(Hook())
    async with anyio.create_task_group() as tg:
        got: list[list[bool]] = []

        async def get() -> None:
            got.append(await b.get_batch([a], [bytearray(PAGE)]))

        async def evict() -> None:
            assert await b.set_batch([y], pages[2:3]) == [True]  # evicts a, the LRU

        tg.start_soon(get)
        assert await until(hook.reached.is_set)
        tg.start_soon(evict)
        assert await until(unlink_held.is_set)
        hook.open()  # the get finds a corrupt while its eviction is unlinking it
        assert await until(lambda: bool(got))
        unlink_go.set()
    assert await until(lambda: a not in b._busy)
    assert got == [[False]]
    assert not os.path.exists(b.path(a))
    assert heard == [a]  # once
    assert sum(b.stats()["removed"].values()) == 1
    assert a not in b._index
    assert consistent(b, tmp_path)
