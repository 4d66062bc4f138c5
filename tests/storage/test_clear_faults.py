"""Pages whose unlink fails in ``clear`` stay counted (file backend).

``clear`` lists this layout's files and unlinks them; a page whose unlink does not happen (an
OS error, or ``unavailable`` when too many threads are stuck) keeps its file, so it must stay
in the index with its bytes, not be told removed, be left out of clear's count, and the
failure is counted (``clear.<reason>``) and logged (``storage_clear_failed``). Before, clear
emptied the index first: such files stayed on disk uncounted. See test_delete_faults.py.
"""

from __future__ import annotations

import anyio

from asynccache.storage.faults import FaultInjectingBackend
from asynccache.storage.file import FileBackend
from asynccache.testing import stuck_pages
from tests.storage.test_delete_faults import eio_on, logged, read, wait_unstuck
from tests.storage.test_evict_faults import FILE, PAGE, disk_bytes, fault_count, suffix_of


async def test_clear_keeps_the_pages_it_cannot_unlink_counted(
    tmp_path, layout, make_keys, make_pages, caplog
) -> None:
    """clear's unlink of one page fails (EIO): that page stays indexed and readable, is not
    told removed, clear's count leaves it out; a later clear removes it."""
    inner = FileBackend(tmp_path, layout)
    heard: list[str] = []
    inner.add_eviction_listener(heard.extend)
    keys, pages = make_keys(3), make_pages(3, PAGE)
    assert await inner.set_batch(keys, pages) == [True] * 3
    sfx = suffix_of(inner)
    fb = FaultInjectingBackend(inner, eio_on(keys[1:2]))
    assert await fb.clear() == 2
    st = inner.stats()
    assert disk_bytes(tmp_path, sfx) == st["used_bytes"] == FILE
    assert st["objects"] == 1
    assert sorted(heard) == sorted([keys[0], keys[2]]) and st["removed"] == {"clear": 2}
    assert fault_count(inner, "clear", "io_error") == 1
    assert logged(caplog, "storage_clear_failed", "pages", "reasons") == [
        {"pages": 1, "reasons": {"io_error": 1}}
    ]
    ok, got = await read(inner, keys)
    assert ok == [False, True, False] and got[1] == pages[1]

    fb.clear_rules()
    assert await fb.clear() == 1
    assert disk_bytes(tmp_path, sfx) == inner.stats()["used_bytes"] == 0
    assert inner.stats()["objects"] == 0
    assert sorted(heard) == sorted(keys) and inner.stats()["removed"] == {"clear": 3}
    assert (await read(inner, keys))[0] == [False] * 3


async def test_a_clear_that_fails_fast_keeps_every_page(
    tmp_path, layout, make_keys, make_pages, caplog, short_deadline
) -> None:
    """Too many stuck threads: clear fails fast (``unavailable``) and removes nothing, so the
    index must keep every page (before, it was emptied first: the files stayed, uncounted)."""
    b = FileBackend(tmp_path, layout, io_threads=1, max_stuck_threads=1)
    heard: list[str] = []
    b.add_eviction_listener(heard.extend)
    keys, pages = make_keys(4), make_pages(4, PAGE)
    assert await b.set_batch(keys[:3], pages[:3]) == [True] * 3
    sfx = suffix_of(b)
    with stuck_pages(b, keys[3:4]) as stuck:
        with short_deadline(b, 0.2):
            assert (await read(b, keys[3:4]))[0] == [False]
        assert b.stats()["stuck_threads"] == 1
        assert await b.clear() == 0
        st = b.stats()
        assert disk_bytes(tmp_path, sfx) == st["used_bytes"] == 3 * FILE
        assert st["objects"] == 3 and heard == [] and st["removed"] == {}
        assert fault_count(b, "clear", "unavailable") == 1
        assert [e["reason"] for e in logged(caplog, "storage_clear_failed", "reason")] == [
            "unavailable"
        ]
        stuck.release()
    await wait_unstuck(b)
    assert await b.exists_prefix(keys[:3]) == 3
    with anyio.fail_after(10):
        assert await b.clear() == 3
    assert disk_bytes(tmp_path, sfx) == b.stats()["used_bytes"] == 0
    assert sorted(heard) == sorted(keys[:3]) and b.stats()["removed"] == {"clear": 3}
    assert (await read(b, keys[:3]))[0] == [False] * 3
