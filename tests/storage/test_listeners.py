"""Eviction listeners (issue 23 item 5): a backend says which pages it no longer has.

The engine's storage tier remembers which keys it wrote and skips writing them again; without
being told, it never re-fills a page the backend evicted (capacity LRU), removed as corrupt, or
found deleted by another writer. ``backend.add_eviction_listener(fn)`` calls ``fn(keys)`` on
the event loop thread whenever that happens.
"""

from __future__ import annotations

import os
import secrets
import threading
from pathlib import Path

import obstore
import pytest

from asynccache.storage.faults import FaultInjectingBackend
from asynccache.storage.file import FileBackend
from asynccache.storage.pageformat import HEADER_SIZE
from asynccache.storage.s3 import S3Backend

PAGE = 4096
SIZE = HEADER_SIZE + PAGE


class Heard:
    """A listener recording each call's keys and the thread it ran on."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.threads: set[int] = set()

    def __call__(self, keys: list[str]) -> None:
        self.calls.append(list(keys))
        self.threads.add(threading.get_ident())

    @property
    def keys(self) -> list[str]:
        return [k for call in self.calls for k in call]


async def test_file_capacity_eviction_is_heard_in_lru_order(tmp_path, layout, make_keys, make_pages):
    b = FileBackend(tmp_path, layout, capacity_bytes=3 * SIZE)
    heard = Heard()
    b.add_eviction_listener(heard)
    keys, pages = make_keys(5), make_pages(5, PAGE)
    assert await b.set_batch(keys[:3], pages[:3]) == [True] * 3
    assert await b.get_batch([keys[0]], [bytearray(PAGE)]) == [True]  # keys[1] is now LRU
    assert heard.calls == []
    assert await b.set_batch(keys[3:], pages[3:]) == [True, True]
    assert heard.keys == [keys[1], keys[2]]
    assert heard.threads == {threading.get_ident()}  # the event loop's thread
    assert b.stats()["removed"] == {"capacity": 2}


async def test_file_corrupt_missing_deleted_and_cleared_pages_are_heard(
    tmp_path, layout, make_keys, make_pages
):
    b = FileBackend(tmp_path, layout)
    heard = Heard()
    b.add_eviction_listener(heard)
    keys, pages = make_keys(6), make_pages(6, PAGE)
    await b.set_batch(keys, pages)
    path = Path(b.path(keys[0]))
    raw = bytearray(path.read_bytes())
    raw[HEADER_SIZE + 9] ^= 1
    path.write_bytes(bytes(raw))
    os.unlink(b.path(keys[1]))  # another writer (or an operator) deleted it
    ok = await b.get_batch(keys[:3], [bytearray(PAGE) for _ in range(3)])
    assert ok == [False, False, True]
    assert heard.keys == [keys[0], keys[1]]
    assert await b.delete([keys[2]]) == 1
    assert heard.calls[-1] == [keys[2]]
    assert await b.clear() == 3
    assert sorted(heard.calls[-1]) == sorted(keys[3:])
    assert b.stats()["removed"] == {"corrupt": 1, "missing": 1, "delete": 1, "clear": 3}
    assert heard.threads == {threading.get_ident()}


async def test_file_start_trim_and_wrappers_and_bad_listeners(
    tmp_path, layout, make_keys, make_pages
):
    keys, pages = make_keys(4), make_pages(4, PAGE)
    first = FileBackend(tmp_path, layout)
    await first.set_batch(keys, pages)
    now = 1_700_000_000
    for age, key in enumerate(keys):  # keys[0] oldest
        os.utime(first.path(key), (now + age, now + age))

    def broken(keys: list[str]) -> None:
        raise RuntimeError("listener bug")

    b = FileBackend(tmp_path, layout, capacity_bytes=2 * SIZE)
    wrapped = FaultInjectingBackend(b)
    heard = Heard()
    wrapped.add_eviction_listener(broken)  # a failing listener is logged, not raised
    wrapped.add_eviction_listener(heard)
    await b.start()  # the restart trims to the capacity: least recent first
    assert heard.keys == keys[:2]
    wrapped.remove_eviction_listener(heard)
    await wrapped.delete(keys[2:])
    assert heard.keys == keys[:2]
    assert b.stats()["listener_errors"] == 2


@pytest.mark.seaweedfs
async def test_s3_removals_are_heard(seaweed, layout, make_keys, make_pages) -> None:
    b = S3Backend(
        seaweed.bucket, layout, prefix=f"t-{secrets.token_hex(6)}", endpoint=seaweed.endpoint,
        access_key_id=seaweed.access_key, secret_access_key=seaweed.secret_key,
    )
    heard = Heard()
    b.add_eviction_listener(heard)
    keys, pages = make_keys(6), make_pages(6, PAGE)
    assert await b.set_batch(keys, pages) == [True] * 6
    raw = seaweed.store(b.prefix)
    name = layout.object_name(keys[0])
    blob = bytearray(await (await obstore.get_async(raw, name)).bytes_async())
    blob[HEADER_SIZE + 5] ^= 1
    await obstore.put_async(raw, name, bytes(blob))
    await obstore.delete_async(raw, layout.object_name(keys[1]))  # behind its back
    ok = await b.get_batch(keys[:3], [bytearray(PAGE) for _ in range(3)])
    assert ok == [False, False, True]
    assert heard.keys == [keys[0], keys[1]]
    await b.delete([keys[2]])
    assert heard.calls[-1] == [keys[2]]
    assert await b.clear() == 3
    assert sorted(heard.calls[-1]) == sorted(keys[3:])
    assert heard.threads == {threading.get_ident()}
    assert b.stats()["removed"] == {"corrupt": 1, "missing": 1, "delete": 1, "clear": 3}
