"""Temp files of writers killed mid-write (issue 23 item 5).

A page is written to a hidden temp file, then renamed onto its name. A writer killed with
SIGKILL in between leaves the temp file behind; before, it was removed only when over an hour
old and was not counted in the capacity. Now every writer names its temp files with its writer
id and holds a lock (``fcntl.flock``) on ``<root>/.writers/<id>.lock`` while it lives: a start
removes the temp files of writers whose lock is free, and counts the others until they go.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from asynccache.storage.file import FileBackend
from asynccache.storage.pageformat import HEADER_SIZE

PAGE = 4096
SIZE = HEADER_SIZE + PAGE

_WRITER = """
import asyncio, hashlib, os, sys
from asynccache.storage import FileBackend, StorageLayout

async def main():
    b = FileBackend(sys.argv[1], StorageLayout("test/model", 16, kv_dtype="bfloat16"), fsync=True)
    await b.start()
    page = os.urandom(16 << 20)
    print("ready", flush=True)
    i = 0
    while True:  # every page lands in <root>/ab/: the parent watches one directory
        key = "ab" + hashlib.sha256(str(i).encode()).hexdigest()[2:]
        await b.set_batch([key], [page])
        i += 1

asyncio.run(main())
"""


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob(".*.tmp") if p.is_file()]


def kill_mid_write(root: Path) -> list[Path]:
    """Run a writer of 16 MiB pages and SIGKILL it while a temp file exists; returns the temp
    files it left (tries again if the kill landed between two writes)."""
    watch = root / "ab"
    for _ in range(20):
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_WRITER), str(root)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if watch.is_dir() and any(n.endswith(".tmp") for n in os.listdir(watch)):
                    proc.send_signal(signal.SIGKILL)
                    break
                time.sleep(0.0005)
        finally:
            proc.kill()
            proc.communicate()
        left = temp_files(root)
        if left:
            return left
    raise AssertionError("never caught the writer mid-write")


async def test_a_killed_writers_temp_files_are_removed_at_start(tmp_path, layout) -> None:
    left = kill_mid_write(tmp_path)
    assert left and all(p.stat().st_mtime > time.time() - 600 for p in left)  # young ones
    locks = list((tmp_path / ".writers").iterdir())
    assert len(locks) >= 1  # the dead writer's lock file (its lock died with it)

    b = FileBackend(tmp_path, layout)
    await b.start()
    assert temp_files(tmp_path) == []
    assert b.stats()["temp_files"] == 0
    # Only the new writer's lock file is left.
    assert [p.name for p in (tmp_path / ".writers").iterdir()] == [f"{b.writer_id}.lock"]
    await b.aclose()
    assert list((tmp_path / ".writers").iterdir()) == []


async def test_a_live_writers_temp_files_are_kept_and_counted(
    tmp_path, layout, make_keys, make_pages
) -> None:
    live = FileBackend(tmp_path, layout)
    await live.start()
    # An in-flight write of the live writer: its temp file under its own writer id.
    sub = tmp_path / "7f"
    sub.mkdir(exist_ok=True)
    tmp = sub / f".{live.writer_id}.{'7f' * 32}.some-page.kv.0123456789ab.tmp"
    tmp.write_bytes(bytes(3 * SIZE))

    b = FileBackend(tmp_path, layout, capacity_bytes=5 * SIZE)
    heard: list[str] = []
    b.add_eviction_listener(heard.extend)
    await b.start()
    assert tmp.exists()
    assert (b.stats()["temp_files"], b.stats()["temp_bytes"]) == (1, 3 * SIZE)
    keys, pages = make_keys(3), make_pages(3, PAGE)
    assert await b.set_batch(keys[:2], pages[:2]) == [True] * 2
    assert heard == []
    assert await b.set_batch(keys[2:], pages[2:]) == [True]
    assert heard == [keys[0]]  # 3 temp + 3 pages > 5: the capacity counts the temp file

    await live.aclose()  # the writer is gone: its temp file can go at the next check
    b.tmp_recheck_s = 0.0
    assert await b.set_batch(make_keys(1, "x"), make_pages(1, PAGE)) == [True]
    assert not tmp.exists()
    assert (b.stats()["temp_files"], b.stats()["temp_bytes"]) == (0, 0)
    assert heard == [keys[0]]  # room enough now


async def test_legacy_temp_names_keep_the_hour_rule(tmp_path, layout) -> None:
    sub = tmp_path / "11"
    sub.mkdir()
    young = sub / f".{'11' * 32}.page.kv.1234.abcdef012345.tmp"  # pid-named, pre-writer-id
    old = sub / f".{'11' * 32}.other.kv.1234.abcdef012346.tmp"
    young.write_bytes(b"x" * 100)
    old.write_bytes(b"y" * 200)
    hours_ago = time.time() - 7200
    os.utime(old, (hours_ago, hours_ago))
    b = FileBackend(tmp_path, layout)
    await b.start()
    assert young.exists() and not old.exists()
    assert (b.stats()["temp_files"], b.stats()["temp_bytes"]) == (1, 100)
    await asyncio.sleep(0)
