"""A corrupt page whose removal fails is counted, kept counted and never served (file backend).

A read that finds a page corrupt (or partial) removes its name after the read. When that
unlink does not happen (it fails with an OS error, or outlives the call's deadline), the file
is still on disk. Before, nothing was counted or logged, and the page stayed an ordinary
indexed page: ``exists_prefix`` said it was there, a ``set_batch`` of it called it present,
and a later read served it again if it verified (a byte flipped in flight). Now, as for
failed eviction, delete and clear unlinks, the page stays indexed with its file's bytes, the
failure is counted (``remove_corrupt.<reason>`` faults) and logged once per call
(``storage_remove_corrupt_failed``); and the page is *kept corrupt*: reads are ``corrupt``
misses that retry the removal (never a hit), ``exists_prefix`` stops there, a ``set_batch``
writes it again, and a delete, clear or eviction that unlinks it ends it.
"""

from __future__ import annotations

import os

import anyio
import pytest

from asynccache.storage.faults import Fault, FaultKind
from asynccache.storage.file import FileBackend
from asynccache.storage.segment import file_bytes
from tests.storage.test_delete_faults import logged
from tests.storage.test_evict_faults import FILE, PAGE, consistent, disk_bytes, suffix_of, until

TIMEOUT_S = 0.2


class BadRead:
    """The first read of each of ``flip`` sees a byte flipped in flight (the file itself is
    sound: read again, it would verify); the first ``eio`` unlinks of each key in ``unlink``
    fail with EIO, or, with ``slow``, take that long (past a deadline)."""

    def __init__(
        self, flip: set[str], unlink: set[str], *, eio: int = 1, slow: float | None = None
    ) -> None:
        self.flip = set(flip)
        self.unlink = dict.fromkeys(unlink, eio)
        self.slow = slow

    def decide(self, op: str, key: str) -> Fault | None:
        if op == "read" and key in self.flip:
            self.flip.discard(key)
            return Fault(FaultKind.FLIP_BYTES, position=0.9)
        if op == "delete" and self.unlink.get(key, 0) > 0:
            self.unlink[key] -= 1
            if self.slow is not None:
                return Fault(FaultKind.DELAY, delay_s=self.slow)
            return Fault(FaultKind.EIO)
        return None


def removal_failed(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return logged(
        caplog, "storage_remove_corrupt_failed", "cause", "pages", "kept_bytes", "reasons"
    )


async def read(b: FileBackend, keys: list[str]) -> tuple[list[bool], list[bytes]]:
    bufs = [bytearray(PAGE) for _ in keys]
    ok = await b.get_batch(keys, bufs)
    return ok, [bytes(x) for x in bufs]


async def test_a_corrupt_page_whose_removal_fails_is_counted_kept_and_never_served(
    tmp_path, layout, make_keys, make_pages, caplog
) -> None:
    k, j = make_keys(2)
    pages = make_pages(2, PAGE)
    b = FileBackend(tmp_path, layout, io_threads=2)
    heard: list[str] = []
    b.add_eviction_listener(heard.extend)
    assert await b.set_batch([k, j], pages) == [True, True]
    b.set_fault_hook(BadRead({k}, {k}))
    ok, data = await read(b, [k, j])
    assert ok == [False, True] and data[1] == pages[1]
    st = b.stats()
    # Counted and logged, like a failed eviction, delete or clear unlink.
    assert st["faults"] == {"get.corrupt": 1, "remove_corrupt.io_error": 1}
    assert removal_failed(caplog) == [
        {"cause": "corrupt", "pages": 1, "kept_bytes": FILE, "reasons": {"io_error": 1}}
    ]
    # Still on disk: still indexed and counted, not told removed.
    assert os.path.exists(b.path(k)) and k in b._index
    assert st["used_bytes"] == 2 * FILE and (st["objects"], st["files"]) == (2, 2)
    assert consistent(b, tmp_path)
    assert heard == [] and st["removed"] == {}
    assert st["corrupt_kept"] == 1
    # Never served: not there for exists, a corrupt miss for a read (the file would verify
    # now: the byte was flipped in flight), whose removal is tried again and now works.
    assert await b.exists_prefix([k]) == 0
    assert await b.exists_prefix([j, k]) == 1
    ok, data = await read(b, [k])
    assert ok == [False] and data == [bytes(PAGE)]  # the buffer untouched
    assert not os.path.exists(b.path(k)) and k not in b._index
    assert heard == [k]
    st = b.stats()
    assert st["removed"] == {"corrupt": 1}
    assert st["faults"] == {"get.corrupt": 2, "remove_corrupt.io_error": 1}
    assert st["corrupt_kept"] == 0
    assert st["used_bytes"] == FILE and consistent(b, tmp_path)
    assert len(removal_failed(caplog)) == 1
    assert await b.get_batch([k], [bytearray(PAGE)]) == [False]  # a plain miss now
    assert b.stats()["faults"] == {"get.corrupt": 2, "remove_corrupt.io_error": 1}


async def test_a_page_kept_corrupt_is_written_again_by_a_set(
    tmp_path, layout, make_keys, make_pages
) -> None:
    """A set of a page kept corrupt does not call it present: it writes it again, and the
    new file is served."""
    (k,) = make_keys(1)
    old, new = make_pages(2, PAGE)
    b = FileBackend(tmp_path, layout)
    assert await b.set_batch([k], [old]) == [True]
    b.set_fault_hook(BadRead({k}, {k}))
    assert await b.get_batch([k], [bytearray(PAGE)]) == [False]
    assert b.stats()["corrupt_kept"] == 1
    assert await b.set_batch([k], [new]) == [True]
    st = b.stats()
    assert st["pages"].get("set.written") == 2 and "set.present" not in st["pages"]
    assert st["corrupt_kept"] == 0
    assert await b.exists_prefix([k]) == 1
    ok, data = await read(b, [k])
    assert ok == [True] and data == [new]
    assert st["used_bytes"] == FILE and consistent(b, tmp_path)


@pytest.mark.parametrize("how", ["delete", "clear", "evict"])
async def test_a_delete_clear_or_eviction_of_a_page_kept_corrupt_ends_it(
    tmp_path, layout, make_keys, make_pages, how
) -> None:
    k, x, y = make_keys(3)
    pages = make_pages(3, PAGE)
    b = FileBackend(tmp_path, layout, capacity_bytes=2 * FILE)
    heard: list[str] = []
    b.add_eviction_listener(heard.extend)
    assert await b.set_batch([k], pages[:1]) == [True]
    assert await b.set_batch([x], pages[1:2]) == [True]
    b.set_fault_hook(BadRead({k}, {k}))
    assert await b.get_batch([k], [bytearray(PAGE)]) == [False]
    assert b.stats()["corrupt_kept"] == 1 and heard == []
    if how == "delete":
        assert await b.delete([k]) == 1
    elif how == "clear":
        assert await b.clear() == 2
    else:
        assert await b.set_batch([y], pages[2:]) == [True]  # k is the least recently used
    cause = {"evict": "capacity"}.get(how, how)
    assert heard[0] == k and b.stats()["removed"][cause] >= 1
    assert not os.path.exists(b.path(k))
    assert b.stats()["corrupt_kept"] == 0
    assert consistent(b, tmp_path)
    # Written again, it is an ordinary page.
    assert await b.set_batch([k], pages[:1]) == [True]
    ok, data = await read(b, [k])
    assert ok == [True] and data == pages[:1]


async def test_a_segment_page_kept_corrupt_keeps_its_segment_counted(
    tmp_path, layout, make_keys, make_pages
) -> None:
    a, b_, c = make_keys(3)
    pages = make_pages(3, PAGE)
    b = FileBackend(tmp_path, layout, segment_bytes=1 << 20)
    heard: list[str] = []
    b.add_eviction_listener(heard.extend)
    assert await b.set_batch([a, b_, c], pages) == [True] * 3
    seg = file_bytes([PAGE] * 3, False)
    b.set_fault_hook(BadRead({b_}, {b_}))
    ok, data = await read(b, [a, b_, c])
    assert ok == [True, False, True] and [data[0], data[2]] == [pages[0], pages[2]]
    st = b.stats()
    assert st["faults"] == {"get.corrupt": 1, "remove_corrupt.io_error": 1}
    assert (st["used_bytes"], st["objects"], st["files"]) == (seg, 3, 1)
    assert consistent(b, tmp_path)
    assert await b.exists_prefix([a, b_, c]) == 1
    ok, data = await read(b, [a, b_, c])  # b's removal is tried again, and works
    assert ok == [True, False, True]
    assert heard == [b_] and not os.path.exists(b.path(b_))
    st = b.stats()
    assert (st["used_bytes"], st["objects"], st["files"]) == (seg, 2, 1)  # a and c live
    assert st["corrupt_kept"] == 0
    assert consistent(b, tmp_path)


async def test_a_corrupt_file_the_index_did_not_know_is_kept_unindexed_and_not_adopted(
    tmp_path, layout, make_keys, make_pages
) -> None:
    """Another instance's page, found corrupt, its removal failed: it stays uncounted (as a
    clear leaves an unindexed file it could not unlink), and exists does not adopt it."""
    (k,) = make_keys(1)
    b = FileBackend(tmp_path, layout)
    await b.start()  # (a start indexes what is on disk)
    other = FileBackend(tmp_path, layout)
    assert await other.set_batch([k], make_pages(1, PAGE)) == [True]
    heard: list[str] = []
    b.add_eviction_listener(heard.extend)
    b.set_fault_hook(BadRead({k}, {k}))
    assert await b.get_batch([k], [bytearray(PAGE)]) == [False]
    st = b.stats()
    assert st["faults"] == {"get.corrupt": 1, "remove_corrupt.io_error": 1}
    assert (st["used_bytes"], st["objects"], st["corrupt_kept"]) == (0, 0, 1)
    assert os.path.exists(b.path(k))
    assert await b.exists_prefix([k]) == 0  # not adopted
    assert b.stats()["objects"] == 0
    assert await b.get_batch([k], [bytearray(PAGE)]) == [False]
    assert heard == [k] and not os.path.exists(b.path(k))
    assert b.stats()["corrupt_kept"] == 0


async def test_a_corrupt_page_whose_removal_outlives_the_deadline_is_kept_until_it_ends(
    tmp_path, layout, make_keys, make_pages, caplog
) -> None:
    """The unlink is still running at the deadline: counted as a ``timeout``, kept corrupt
    (a read meanwhile is a miss); when it returns and removed the page, it is dropped and
    told removed."""
    (k,) = make_keys(1)
    b = FileBackend(tmp_path, layout, timeout_s=TIMEOUT_S, timeout_per_gib_s=0)
    heard: list[str] = []
    b.add_eviction_listener(heard.extend)
    assert await b.set_batch([k], make_pages(1, PAGE)) == [True]
    b.set_fault_hook(BadRead({k}, {k}, slow=3 * TIMEOUT_S))
    assert await b.get_batch([k], [bytearray(PAGE)]) == [False]
    st = b.stats()
    assert st["faults"] == {"get.corrupt": 1, "remove_corrupt.timeout": 1}
    assert removal_failed(caplog) == [
        {"cause": "corrupt", "pages": 1, "kept_bytes": FILE, "reasons": {"timeout": 1}}
    ]
    assert st["corrupt_kept"] == 1 and k in b._index and heard == []
    assert await b.exists_prefix([k]) == 0
    assert await until(lambda: k not in b._busy)
    await anyio.sleep(0)
    assert heard == [k] and k not in b._index and not os.path.exists(b.path(k))
    st = b.stats()
    assert (st["corrupt_kept"], st["used_bytes"]) == (0, 0)
    assert disk_bytes(tmp_path, suffix_of(b)) == 0
