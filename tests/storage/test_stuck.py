"""Hung file reads (issue 23 item 5): a FIFO at a page's name stands in for a dead NFS file.

Opening a FIFO for reading blocks until a writer opens it: a real syscall that never returns,
which no thread can interrupt. The page that hung is quarantined (later reads of it are
immediate misses), healthy pages stay readable however many reads are stuck, and the process
can still exit (the stuck threads are daemons, never joined).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from asynccache.storage.file import FileBackend
from asynccache.testing import stuck_pages

PAGE = 4096


def fault_count(backend: FileBackend, op: str, reason: str) -> int:
    return backend.stats()["faults"].get(f"{op}.{reason}", 0)


async def read(backend: FileBackend, keys: list[str]) -> list[bool]:
    return await backend.get_batch(keys, [bytearray(PAGE) for _ in keys])


async def wait_unstuck(backend: FileBackend, limit_s: float = 20.0) -> None:
    import asyncio

    deadline = time.monotonic() + limit_s
    while backend.stats()["stuck_threads"] and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert backend.stats()["stuck_threads"] == 0


async def test_a_hung_page_is_quarantined_and_healthy_pages_stay_readable(
    tmp_path, layout, make_keys, make_pages, short_deadline
) -> None:
    b = FileBackend(tmp_path, layout, io_threads=2)
    keys = make_keys(12)
    assert await b.set_batch(keys, make_pages(12, PAGE)) == [True] * 12
    with stuck_pages(b, keys[3:4]) as stuck:
        started = time.monotonic()
        with short_deadline(b, 1.0):
            assert await read(b, [keys[3]]) == [False]  # pays the deadline once
        assert time.monotonic() - started >= 0.9
        assert fault_count(b, "get", "timeout") == 1
        assert b.stats()["stuck_threads"] == 1
        assert b.stats()["quarantined"] == 1

        # Every later read of the hung page is an immediate miss; no new thread gets stuck.
        # (Under the default deadline, 10 s: a read that waited for one could not pass.)
        started = time.monotonic()
        for _ in range(20):
            assert await read(b, [keys[3]]) == [False]
        assert time.monotonic() - started < b.timeout_s  # 20 reads, not even one deadline
        assert fault_count(b, "get", "quarantined") == 20
        assert fault_count(b, "get", "timeout") == 1
        assert b.stats()["stuck_threads"] == 1

        # A prefix read stops there; the healthy pages around it are all readable.
        assert await read(b, keys) == [True] * 3 + [False] + [True] * 8
        assert await b.exists_prefix(keys) == 3
        assert fault_count(b, "get", "unavailable") == 0
        assert stuck.release() == 1  # one reader was blocked
    await wait_unstuck(b)
    # The stuck read came back (it found a FIFO: a corrupt object): nothing quarantined.
    assert b.stats()["quarantined"] == 0
    assert fault_count(b, "get", "corrupt") == 0  # (the late outcome of an abandoned call)
    assert not Path(stuck.paths[0]).exists()
    assert await read(b, [keys[3]]) == [False]  # an ordinary miss now
    assert fault_count(b, "get", "quarantined") == 21  # (20 + the batch read above)


async def test_more_hung_pages_than_io_threads_leave_healthy_pages_readable(
    tmp_path, layout, make_keys, make_pages, short_deadline
) -> None:
    b = FileBackend(tmp_path, layout, io_threads=2)
    keys = make_keys(16)
    pages = make_pages(16, PAGE)
    assert await b.set_batch(keys, pages) == [True] * 16
    hung = keys[:6]  # three times io_threads
    with stuck_pages(b, hung):
        with short_deadline(b, 0.3):
            for k in hung:
                assert await read(b, [k]) == [False]
        assert b.stats()["stuck_threads"] == 6
        bufs = [bytearray(PAGE) for _ in keys[6:]]
        assert await b.get_batch(keys[6:], bufs) == [True] * 10
        assert [bytes(x) for x in bufs] == pages[6:]
        assert fault_count(b, "get", "unavailable") == 0
        # Writing a hung page replaces the FIFO with the page: readable again at once.
        assert await b.set_batch([hung[0]], [pages[0]]) == [True]
        buf = bytearray(PAGE)
        assert await b.get_batch([hung[0]], [buf]) == [True] and bytes(buf) == pages[0]
    await wait_unstuck(b)
    assert b.stats()["quarantined"] == 0


_EXIT_SCRIPT = """
import asyncio, hashlib, os, sys
from asynccache.storage import FileBackend, StorageLayout

async def main():
    b = FileBackend(sys.argv[1], StorageLayout("m", 16))
    key = hashlib.sha256(b"page").hexdigest()
    assert await b.set_batch([key], [bytes(4096)]) == [True]
    os.unlink(b.path(key))
    os.mkfifo(b.path(key))
    default, b.timeout_s = b.timeout_s, 0.3  # only the read that hangs: a short deadline
    got = await b.get_batch([key], [bytearray(4096)])
    b.timeout_s = default  # (aclose releases the writer lock within it)
    print(got, b.stats()["stuck_threads"], flush=True)
    await b.aclose()

asyncio.run(main())
print("exiting", flush=True)
"""


def test_the_interpreter_exits_with_a_read_stuck_forever(tmp_path) -> None:
    """Nothing ever opens the FIFO's write end: the reading thread stays blocked until the
    process ends, and must not keep it from ending."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_EXIT_SCRIPT), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the process did not exit with a stuck storage read: {out!r} {err[-800:]!r}")
    assert proc.returncode == 0, err[-2000:]
    assert out.splitlines() == ["[False] 1", "exiting"]


def test_the_daemon_threads_wake_a_trio_loop_too(
    tmp_path, layout, make_keys, make_pages, short_deadline
) -> None:
    """The threads report back through the running loop's own wake-up (asyncio or trio)."""
    pytest.importorskip("trio")
    import anyio

    keys, pages = make_keys(8), make_pages(8, PAGE)

    async def main() -> tuple[list[bool], list[bool], list[bytes], int]:
        b = FileBackend(tmp_path, layout, io_threads=2)
        stored = await b.set_batch(keys, pages)
        bufs = [bytearray(PAGE) for _ in keys]
        # One call: the hung page times out, the healthy ones must be read within it.
        with stuck_pages(b, keys[:1]), short_deadline(b, 1.0):
            got = await b.get_batch(keys, bufs)
            quarantined = b.stats()["quarantined"]
        return stored, got, [bytes(x) for x in bufs[1:]], quarantined

    stored, got, data, quarantined = anyio.run(main, backend="trio")
    assert stored == [True] * 8 and got == [False] + [True] * 7
    assert data == pages[1:] and quarantined == 1
