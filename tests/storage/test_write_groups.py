"""Durable writes in groups (``fsync=True``): a write job writes several files, then syncs
them, then publishes them (``PageFiles.write_group``). What must hold whatever the grouping:
a page is published (renamed or linked under its name) only after its own file's
``fdatasync`` returned, the directories are synced after every publish and before
``set_batch`` reports the pages stored, and a page whose write or sync fails is never
published (it reads as a miss, no temp file is left) while the rest of its group is stored."""

from __future__ import annotations

import errno
import os
import sys
import threading

import pytest

import asynccache.storage.fileio as fileio
from asynccache.storage.faults import FaultInjectingBackend, FaultKind, FaultRule
from asynccache.storage.file import FileBackend

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="names open files through /proc/self/fd"
)

PAGE = 8192


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


class _Recorder:
    """Records the durability-relevant calls, in order, with the calling thread."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_sync_of: str | None = None):
        self.events: list[tuple[str, int, str, str]] = []
        self._lock = threading.Lock()
        real_fdatasync, real_fsync = os.fdatasync, os.fsync
        real_replace, real_link = os.replace, os.link
        real_writeback = fileio.start_writeback

        def note(kind: str, a: str, b: str = "") -> None:
            with self._lock:
                self.events.append((kind, threading.get_ident(), a, b))

        def fdatasync(fd: int) -> None:
            path = _fd_path(fd)
            if fail_sync_of is not None and fail_sync_of in path:
                note("sync_failed", path)
                raise OSError(errno.EIO, "injected fdatasync failure")
            real_fdatasync(fd)
            note("sync", path)

        def fsync(fd: int) -> None:
            real_fsync(fd)
            note("dirsync", _fd_path(fd))

        def replace(src: str, dst: str) -> None:
            note("publish", os.fspath(src), os.fspath(dst))
            real_replace(src, dst)

        def link(src: str, dst: str) -> None:
            note("publish", os.fspath(src), os.fspath(dst))
            real_link(src, dst)

        def writeback(fd: int) -> None:
            note("writeback", _fd_path(fd))
            real_writeback(fd)

        monkeypatch.setattr(os, "fdatasync", fdatasync)
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(os, "link", link)
        monkeypatch.setattr(fileio, "start_writeback", writeback)

    def of(self, kind: str) -> list[tuple[int, tuple[str, int, str, str]]]:
        return [(i, e) for i, e in enumerate(self.events) if e[0] == kind]


def _temp_files(root: os.PathLike[str]) -> list[str]:
    return [f for _d, _s, files in os.walk(root) for f in files if f.endswith(".tmp")]


@pytest.mark.parametrize("segment_bytes", [None, 3 * (PAGE + 4096)])
async def test_each_file_is_synced_before_it_is_published_and_dirs_after_all(
    tmp_path, layout, make_keys, make_pages, monkeypatch, segment_bytes
) -> None:
    keys, pages = make_keys(32), make_pages(32, PAGE)
    b = FileBackend(tmp_path, layout, fsync=True, io_threads=2, segment_bytes=segment_bytes)
    await b.start()
    rec = _Recorder(monkeypatch)
    assert await b.set_batch(keys, pages) == [True] * 32
    syncs = rec.of("sync")
    publishes = rec.of("publish")
    dirsyncs = rec.of("dirsync")
    assert publishes and syncs and dirsyncs
    synced_at = {e[2]: i for i, e in syncs}
    for i, (_k, _t, src, _dst) in publishes:
        assert src in synced_at and synced_at[src] < i, f"{src} published before its fdatasync"
    assert min(i for i, _ in dirsyncs) > max(i for i, _ in publishes)
    assert {os.path.basename(e[2]) for _, e in dirsyncs} == {k[:2] for k in keys}
    # Grouped: each job (thread) wrote several files before its first fdatasync.
    for thread in {e[1] for _, e in syncs}:
        mine = [e for e in rec.events if e[1] == thread]
        first_sync = next(j for j, e in enumerate(mine) if e[0] == "sync")
        assert sum(1 for e in mine[:first_sync] if e[0] == "writeback") >= 2
    bufs = [bytearray(PAGE) for _ in keys]
    assert await b.get_batch(keys, bufs) == [True] * 32
    assert [bytes(x) for x in bufs] == pages
    assert _temp_files(tmp_path) == []
    await b.aclose()


async def test_a_failed_sync_loses_only_its_page_and_publishes_nothing_of_it(
    tmp_path, layout, make_keys, make_pages, monkeypatch
) -> None:
    keys, pages = make_keys(16), make_pages(16, PAGE)
    b = FileBackend(tmp_path, layout, fsync=True, io_threads=2)
    await b.start()
    rec = _Recorder(monkeypatch, fail_sync_of=keys[3])  # in the middle of the first group
    ok = await b.set_batch(keys, pages)
    assert ok == [i != 3 for i in range(16)]
    assert rec.of("sync_failed")
    assert all(keys[3] not in e[3] for _, e in rec.of("publish"))
    monkeypatch.undo()
    assert not os.path.exists(b.path(keys[3]))
    assert _temp_files(tmp_path) == []
    bufs = [bytearray(PAGE) for _ in keys]
    assert await b.get_batch(keys, bufs) == ok
    assert [bytes(x) for x, hit in zip(bufs, ok, strict=True) if hit] == [
        p for p, hit in zip(pages, ok, strict=True) if hit
    ]
    assert await b.exists_prefix(keys) == 3
    await b.aclose()


@pytest.mark.parametrize("kind", [FaultKind.PARTIAL_WRITE, FaultKind.EIO, FaultKind.ENOSPC])
@pytest.mark.parametrize("segment_bytes", [None, 3 * (PAGE + 4096)])
async def test_faults_inside_a_group_stay_misses(
    tmp_path, layout, make_keys, make_pages, kind, segment_bytes
) -> None:
    """A torn, failed or out-of-space write of one page in a durable group never reads as a
    hit (torn: a miss on read; the others fail the write); no temp file outlives the call."""
    keys, pages = make_keys(16), make_pages(16, PAGE)
    inner = FileBackend(tmp_path, layout, fsync=True, io_threads=2, segment_bytes=segment_bytes)
    fb = FaultInjectingBackend(
        inner, [FaultRule(kind, ops=frozenset({"write"}), keys=frozenset({keys[5]}), times=1)]
    )
    ok = await fb.set_batch(keys, pages)
    if kind is not FaultKind.PARTIAL_WRITE:
        assert not ok[5]
    assert sum(ok) >= 16 - (segment_bytes // PAGE if segment_bytes else 1)  # its file fails
    bufs = [bytearray(PAGE) for _ in keys]
    hits = await fb.get_batch(keys, bufs)
    assert not hits[5]
    for key, hit, buf, page in zip(keys, hits, bufs, pages, strict=True):
        if hit:
            assert bytes(buf) == page, f"wrong bytes for {key}"
    assert _temp_files(tmp_path) == []
    await fb.aclose()
