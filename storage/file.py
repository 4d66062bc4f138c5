"""File backend: one checksummed object per page in a directory (local disk or NFS).

Layout on disk: ``<root>/<key[:2]>/<key>.<layout tag>.kv`` (256 fan-out directories keep
directories small). Several backends (layouts, ranks, engine instances) may share a root.

* Writes go to a hidden temp file in the same directory, then ``os.replace``: readers never
  see a partial page, and concurrent writers of one key are safe (the last rename wins; both
  wrote a complete, verified page). With ``fsync=True`` each page's data is made durable
  (``fdatasync``) before its rename, and the touched directories once per batch after the
  renames, before ``set_batch`` reports the pages stored; without it, a power loss can lose or
  tear recent pages, which the checksum turns into misses.
* Reads ``preadv`` header and payload into a per-worker bounce buffer, verify everything, and
  only then copy into the caller's buffer under the call's :class:`~storage.threadio.PageGuard`
  (a timed-out call's threads can never write a buffer the caller has reused). A bad object
  is removed.
* Bulk I/O runs on ``io_threads`` worker threads via ``anyio.to_thread`` with
  ``os.preadv``/``os.pwritev`` instead of aiofiles: aiofiles does one thread hop per call
  (open, read, close: three per page) and ``read()`` allocates a new bytes object per page;
  ``scripts/bench_storage.py`` measures both. The backend works under any anyio backend.
* Capacity: an LRU index (key -> bytes) bounds the bytes of this backend's objects; new pages
  evict the least recently used files. Hits and re-sets refresh recency; a hit also
  refreshes the file's mtime when it is over a minute old, so the order survives a restart
  (to the minute) without an inode write per read. The index is rebuilt from the directory on start.
* Objects written by other instances sharing the root are adopted when ``exists_prefix``
  finds them on disk; each instance bounds only the objects it knows of.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from prometheus_client import CollectorRegistry

from asynccache.errors import ConfigError, StorageError
from storage.backend import MISS, OK, PRESENT, BackendBase, os_error_reason
from storage.base import StorageLayout, check_batch, copy_into, validate_keys
from storage.faults import Fault, FaultKind, fault_error, flip_byte
from storage.pageformat import (
    HEADER_SIZE,
    CorruptPageError,
    encode_header,
    parse_header,
    verify_payload,
)
from storage.threadio import PageGuard, Scratch, ThreadRunner

__all__ = ["FileBackend"]

_SUBDIR_RE = re.compile(r"[0-9a-f]{2}")
_KEY_RE = re.compile(r"[0-9a-f]{64}(?:\.[a-z0-9_-]{1,32})?")
_STALE_TMP_S = 3600.0
_TOUCH_AFTER_S = 60.0  # a hit refreshes the file's mtime only when it is older than this
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _pread_full(fd: int, view: memoryview) -> int:
    total = 0
    size = len(view)
    while total < size:
        n = os.preadv(fd, [view[total:]], total)
        if n == 0:
            break
        total += n
    return total


def _pwrite_all(fd: int, parts: list[memoryview]) -> None:
    offset = 0
    while parts:
        n = os.pwritev(fd, parts, offset)
        if n <= 0:
            raise OSError(5, "pwritev wrote nothing")
        offset += n
        while parts and n >= len(parts[0]):
            n -= len(parts[0])
            parts.pop(0)
        if parts and n:
            parts[0] = parts[0][n:]


def _pre_fault(fault: Fault | None, what: str) -> None:
    """Apply the faults that strike before any byte moves."""
    if fault is None:
        return
    if fault.kind is FaultKind.DELAY:
        time.sleep(fault.delay_s)
    elif fault.kind in (FaultKind.EIO, FaultKind.DROP):
        raise fault_error(fault.kind, what)


class FileBackend(BackendBase):
    """Pages as files under ``root``; see the module docstring."""

    kind = "file"

    def __init__(
        self,
        root: str | os.PathLike[str],
        layout: StorageLayout,
        *,
        capacity_bytes: int | None = None,
        io_threads: int = 8,
        fsync: bool = False,
        timeout_s: float = 10.0,
        timeout_per_gib_s: float = 10.0,
        max_stuck_threads: int | None = None,
        adopt_external: bool = True,
        registry: CollectorRegistry | None = None,
        metrics_label: str | None = None,
    ) -> None:
        super().__init__(
            layout,
            timeout_s=timeout_s,
            timeout_per_gib_s=timeout_per_gib_s,
            registry=registry,
            metrics_label=metrics_label,
        )
        if not isinstance(root, str | os.PathLike) or not os.fspath(root):
            raise ConfigError(f"root must be a directory path, got {root!r}")
        if capacity_bytes is not None and (
            isinstance(capacity_bytes, bool)
            or not isinstance(capacity_bytes, int)
            or capacity_bytes <= 0
        ):
            raise ConfigError(f"capacity_bytes must be an int > 0 or None, got {capacity_bytes!r}")
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
            raise ConfigError(f"io_threads must be an int >= 1, got {io_threads!r}")
        stuck = io_threads if max_stuck_threads is None else max_stuck_threads
        if isinstance(stuck, bool) or not isinstance(stuck, int) or stuck < 1:
            raise ConfigError(f"max_stuck_threads must be an int >= 1, got {max_stuck_threads!r}")
        self.root = Path(os.path.abspath(os.fspath(root)))
        self._root = str(self.root)
        self.capacity_bytes = capacity_bytes
        self.fsync = bool(fsync)
        self.adopt_external = bool(adopt_external)
        self._runner = ThreadRunner(io_threads, stuck)
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> bytes on disk, LRU first
        self._used = 0
        self._reserved = 0
        self._victims: list[str] = []
        self._started = False
        self._start_lock: anyio.Lock | None = None

    # -- paths ----------------------------------------------------------------------------------

    def _dir(self, key: str) -> str:
        return f"{self._root}/{key[:2]}"

    def _path(self, key: str) -> str:
        return f"{self._root}/{key[:2]}/{key}{self._suffix}"

    # -- start: rebuild the index from the directory ---------------------------------------------

    async def start(self) -> None:
        """Create the root and rebuild the index; raises StorageError if the root is unusable.

        Calls start implicitly; an implicit start that fails logs and continues with an
        empty index (every call then degrades to misses / skipped writes).
        """
        await self._ensure_started(strict=True)

    async def _ensure_started(self, strict: bool = False) -> None:
        if self._started:
            return
        if self._start_lock is None:
            self._start_lock = anyio.Lock()
        async with self._start_lock:
            if self._started:
                return
            try:
                with anyio.fail_after(max(self.timeout_s, 60.0)):
                    entries = await anyio.to_thread.run_sync(self._scan, abandon_on_cancel=True)
            except (OSError, TimeoutError) as exc:
                self._log.error("storage_start_failed", root=str(self.root), error=repr(exc))
                if strict:
                    raise StorageError(
                        f"cannot use storage directory {str(self.root)!r}: {exc}"
                    ) from exc
                entries = []
            for _mtime, key, size in sorted(entries):
                self._index[key] = size
                self._used += size
            self._started = True
            victims: list[str] = []
            if self.capacity_bytes is not None:
                victims = self._evict_to(self.capacity_bytes, protect=())
            if victims:
                await self._runner.run(len(victims), self._unlink_job(victims), self._deadline())
            self.metrics.set_usage(self._used, len(self._index))
            self._log.info(
                "storage_started", root=str(self.root), objects=len(self._index), bytes=self._used
            )

    def _scan(self) -> list[tuple[int, str, int]]:
        """(mtime_ns, key, size) of this layout's objects; removes stale temp files."""
        os.makedirs(self.root, exist_ok=True)
        suffix = self._suffix
        now = time.time()
        out: list[tuple[int, str, int]] = []
        with os.scandir(self.root) as top:
            subdirs = [e.path for e in top if e.is_dir() and _SUBDIR_RE.fullmatch(e.name)]
        for sub in subdirs:
            with os.scandir(sub) as it:
                for e in it:
                    name = e.name
                    try:
                        if name.startswith("."):
                            if name.endswith(".tmp") and now - e.stat().st_mtime > _STALE_TMP_S:
                                os.unlink(e.path)
                            continue
                        if not name.endswith(suffix):
                            continue
                        key = name[: -len(suffix)]
                        if _KEY_RE.fullmatch(key) and key[:2] == os.path.basename(sub):
                            st = e.stat()
                            out.append((st.st_mtime_ns, key, st.st_size))
                    except FileNotFoundError:
                        continue
        return out

    # -- capacity -------------------------------------------------------------------------------

    def _evict_to(self, limit: int, protect: Sequence[str] | set[str]) -> list[str]:
        """Drop LRU index entries until used <= limit; returns the victims (not yet unlinked)."""
        victims: list[str] = []
        while self._used + self._reserved > limit:
            # Protected keys (the batch being written) are few and rarely least recent, so
            # this finds the victim at or near the front of the LRU order.
            victim = next((k for k in self._index if k not in protect), None)
            if victim is None:
                break
            self._used -= self._index.pop(victim)
            victims.append(victim)
        return victims

    def _reserve(self, size: int, protect: set[str]) -> bool:
        cap = self.capacity_bytes
        if cap is not None:
            if size > cap:
                return False
            self._victims += self._evict_to(cap - size, protect)
            if self._used + self._reserved + size > cap:
                return False
        self._reserved += size
        return True

    def _unlink_job(self, keys: list[str]) -> Callable[[int, PageGuard, Scratch], None]:
        def job(i: int, guard: PageGuard, _scratch: Scratch) -> None:
            key = keys[i]
            try:
                _pre_fault(self._fault("delete", key), "unlink")
                os.unlink(self._path(key))
                guard.finish(i, OK)
            except FileNotFoundError:
                guard.finish(i, MISS)
            except OSError as exc:
                guard.finish(i, os_error_reason(exc), str(exc))

        return job

    # -- exists ---------------------------------------------------------------------------------

    async def exists_prefix(self, keys: Sequence[str]) -> int:
        self._check_open()
        key_list = validate_keys(keys)
        await self._ensure_started()
        started = time.perf_counter()
        n = 0
        for key in key_list:
            if key not in self._index:
                break
            n += 1
        if n < len(key_list) and self.adopt_external:
            n += await self._adopt(key_list[n:])
        self.metrics.page("exists", "hit", n)
        self.metrics.page("exists", "miss", min(1, len(key_list) - n))
        self.metrics.observe("exists", time.perf_counter() - started)
        return n

    async def _adopt(self, keys: list[str]) -> int:
        """Stat ``keys`` in order until one is missing; index the ones found on disk."""
        found: list[tuple[str, int]] = []
        errors: list[str] = []

        def job(i: int, guard: PageGuard, _scratch: Scratch) -> None:
            for key in keys:
                try:
                    _pre_fault(self._fault("exists", key), "stat")
                    found.append((key, os.stat(self._path(key)).st_size))
                except FileNotFoundError:
                    break
                except OSError as exc:
                    errors.append(os_error_reason(exc))
                    break
            guard.finish(i, OK)

        outcomes, _ = await self._runner.run(1, job, self._deadline())
        if outcomes[0] != OK:
            errors.append(outcomes[0])
        if errors:
            self.metrics.fault("exists", errors[0])
            self._log.warning("storage_faults", op="exists", faults={errors[0]: 1})
        adopted = list(found)  # a timed-out thread may still append
        for key, size in adopted:
            if key not in self._index:
                self._index[key] = size
                self._used += size
        if adopted:
            self.metrics.set_usage(self._used, len(self._index))
        return len(adopted)

    # -- get ------------------------------------------------------------------------------------

    async def get_batch(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        self._check_open()
        key_list, views = check_batch(keys, buffers, writable=True)
        await self._ensure_started()
        started = time.perf_counter()
        names = [k + self._suffix for k in key_list]

        def job(i: int, guard: PageGuard, scratch: Scratch) -> None:
            self._read_page(i, key_list[i], names[i], views[i], guard, scratch)

        total = sum(v.nbytes for v in views)
        outcomes, details = await self._runner.run(len(key_list), job, self._deadline(total))
        for key, outcome in zip(key_list, outcomes, strict=True):
            if outcome == OK:
                if key in self._index:
                    self._index.move_to_end(key)
            elif outcome in (MISS, "corrupt", "partial") and key in self._index:
                self._used -= self._index.pop(key)
        self.metrics.set_usage(self._used, len(self._index))
        sizes = [v.nbytes for v in views]
        return self._account("get", key_list, outcomes, details, sizes, started)

    def _read_page(
        self,
        i: int,
        key: str,
        name: str,
        target: memoryview,
        guard: PageGuard,
        scratch: Scratch,
    ) -> None:
        path = self._path(key)
        fault = self._fault("read", key)
        try:
            _pre_fault(fault, "read")
            fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
        except FileNotFoundError:
            guard.finish(i, MISS)
            return
        except OSError as exc:
            guard.finish(i, os_error_reason(exc), str(exc))
            return
        ino = -1
        try:
            st = os.fstat(fd)
            ino = st.st_ino
            want = HEADER_SIZE + target.nbytes
            buf = scratch.view(want)
            got = _pread_full(fd, buf)
            if fault is not None and fault.kind is FaultKind.SHORT_READ:
                got = int(got * fault.position)
            elif fault is not None and fault.kind is FaultKind.FLIP_BYTES:
                flip_byte(buf[:got], fault.position)
            info = parse_header(buf[:got], name)
            if info.payload_len != target.nbytes and st.st_size == HEADER_SIZE + info.payload_len:
                guard.finish(
                    i,
                    "size_mismatch",
                    f"object has {info.payload_len} payload bytes, buffer {target.nbytes}",
                )
                return
            if st.st_size != want or got != want:
                raise CorruptPageError(
                    "partial", f"object {name}: {st.st_size} bytes on disk, expected {want}"
                )
            verify_payload(info, buf[HEADER_SIZE:want], name)
            if guard.enter():
                copied = False
                try:
                    copy_into(target, buf[HEADER_SIZE:want])
                    copied = True
                finally:
                    guard.leave(i, OK if copied else "internal")
                if time.time() - st.st_mtime > _TOUCH_AFTER_S:
                    with contextlib.suppress(OSError):
                        os.utime(fd)  # recency survives a restart (coarsely: no inode churn)
        except CorruptPageError as exc:
            self._remove_bad(path, ino)
            guard.finish(i, "partial" if exc.reason == "partial" else "corrupt", str(exc))
        except OSError as exc:
            guard.finish(i, os_error_reason(exc), str(exc))
        finally:
            os.close(fd)

    @staticmethod
    def _remove_bad(path: str, ino: int) -> None:
        try:
            if os.stat(path).st_ino == ino:  # not a good page that a writer just put there
                os.unlink(path)
        except OSError:
            pass

    # -- set ------------------------------------------------------------------------------------

    async def set_batch(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        self._check_open()
        key_list, views = check_batch(keys, buffers, writable=False)
        await self._ensure_started()
        started = time.perf_counter()
        n = len(key_list)
        outcomes: list[str] = [OK] * n
        details: list[str | None] = [None] * n
        protect = set(key_list)
        todo: list[int] = []
        for i, key in enumerate(key_list):
            if key in self._index:  # content-addressed: only refresh recency
                self._index.move_to_end(key)
                outcomes[i] = PRESENT
                continue
            if self._reserve(HEADER_SIZE + views[i].nbytes, protect):
                todo.append(i)
            else:
                outcomes[i] = "capacity"
                details[i] = f"{HEADER_SIZE + views[i].nbytes} bytes do not fit"
        victims, self._victims = self._victims, []
        names = [k + self._suffix for k in key_list]
        unlink = self._unlink_job(victims)

        def job(j: int, guard: PageGuard, scratch: Scratch) -> None:
            if j < len(victims):
                unlink(j, guard, scratch)
            else:
                i = todo[j - len(victims)]
                self._write_page(j, key_list[i], names[i], views[i], guard)

        total = sum(views[i].nbytes for i in todo)
        try:
            done, done_details = await self._runner.run(
                len(victims) + len(todo), job, self._deadline(total)
            )
        finally:
            for i in todo:
                self._reserved -= HEADER_SIZE + views[i].nbytes
        self.metrics.evicted(len(victims))
        for v, outcome in zip(victims, done, strict=False):
            if outcome not in (OK, MISS):
                self._log.warning("storage_evict_failed", key=v, reason=outcome)
        if self.fsync:
            written = [key_list[i] for j, i in enumerate(todo, len(victims)) if done[j] == OK]
            failed = await self._sync_dirs(written)
            for j, i in enumerate(todo, len(victims)):
                if done[j] == OK and key_list[i][:2] in failed:
                    done[j], done_details[j] = failed[key_list[i][:2]]
        for j, i in enumerate(todo, start=len(victims)):
            outcomes[i], details[i] = done[j], done_details[j]
            key = key_list[i]
            if done[j] == OK:
                if key in self._index:
                    self._index.move_to_end(key)
                else:
                    self._index[key] = HEADER_SIZE + views[i].nbytes
                    self._used += HEADER_SIZE + views[i].nbytes
        self.metrics.set_usage(self._used, len(self._index))
        sizes = [v.nbytes for v in views]
        return self._account("set", key_list, outcomes, details, sizes, started)

    async def _sync_dirs(self, keys: list[str]) -> dict[str, tuple[str, str | None]]:
        """fsync the directories of freshly renamed pages, once each per batch (the renames
        are durable only then; one journal commit usually covers them all). Returns the
        failed directories' outcomes by fan-out prefix."""
        prefixes = sorted({k[:2] for k in keys})

        def job(i: int, guard: PageGuard, _scratch: Scratch) -> None:
            try:
                dfd = os.open(os.path.join(self.root, prefixes[i]), os.O_RDONLY | _O_CLOEXEC)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
                guard.finish(i, OK)
            except OSError as exc:
                guard.finish(i, os_error_reason(exc), str(exc))

        outcomes, details = await self._runner.run(len(prefixes), job, self._deadline())
        return {p: (o, d) for p, o, d in zip(prefixes, outcomes, details, strict=True) if o != OK}

    def _write_page(
        self, j: int, key: str, name: str, payload: memoryview, guard: PageGuard
    ) -> None:
        fault = self._fault("write", key)
        tmp = None
        try:
            _pre_fault(fault, "write")
            header = memoryview(encode_header(name, payload))
            parts = [header, payload]
            if fault is not None and fault.kind is FaultKind.FLIP_BYTES:
                flipped = bytearray(payload)
                flip_byte(flipped, fault.position)
                parts = [header, memoryview(flipped)]
            elif fault is not None and fault.kind is FaultKind.PARTIAL_WRITE:
                parts = [header, payload[: int(payload.nbytes * fault.position)]]
            directory = self._dir(key)
            tmp = os.path.join(directory, f".{name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC
            try:
                fd = os.open(tmp, flags, 0o644)
            except FileNotFoundError:
                os.makedirs(directory, exist_ok=True)
                fd = os.open(tmp, flags, 0o644)
            try:
                if fault is not None and fault.kind is FaultKind.ENOSPC:
                    _pwrite_all(fd, [header, payload[: payload.nbytes // 2]])
                    raise fault_error(fault.kind, "write")
                _pwrite_all(fd, parts)
                if self.fsync:
                    os.fdatasync(fd)
            finally:
                os.close(fd)
            if not guard.may_publish():
                return  # the call is over; the finally below removes the temp file
            os.replace(tmp, self._path(key))
            tmp = None
            guard.finish(j, OK)
        except OSError as exc:
            guard.finish(j, os_error_reason(exc), str(exc))
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    # -- delete / clear -------------------------------------------------------------------------

    async def delete(self, keys: Sequence[str]) -> int:
        self._check_open()
        key_list = list(dict.fromkeys(validate_keys(keys)))
        await self._ensure_started()
        started = time.perf_counter()
        for key in key_list:
            if key in self._index:
                self._used -= self._index.pop(key)
        outcomes, details = await self._runner.run(
            len(key_list), self._unlink_job(key_list), self._deadline()
        )
        self.metrics.set_usage(self._used, len(self._index))
        sizes = [0] * len(key_list)
        return sum(self._account("delete", key_list, outcomes, details, sizes, started))

    async def clear(self) -> int:
        """Remove every object of this layout under the root (also ones not in the index)."""
        self._check_open()
        await self._ensure_started()
        self._index.clear()
        self._used = 0
        removed: list[int] = [0]

        def job(i: int, guard: PageGuard, _scratch: Scratch) -> None:
            for _mtime, key, _size in self._scan():
                try:
                    os.unlink(self._path(key))
                    removed[0] += 1
                except FileNotFoundError:
                    pass
            guard.finish(i, OK)

        outcomes, details = await self._runner.run(1, job, max(self.timeout_s, 60.0))
        if outcomes[0] != OK:
            self.metrics.fault("clear", outcomes[0])
            self._log.warning("storage_clear_failed", reason=outcomes[0], detail=details[0])
        self.metrics.set_usage(self._used, len(self._index))
        return removed[0]

    # -- misc -----------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {
            **self._base_stats(),
            "root": str(self.root),
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self._used,
            "reserved_bytes": self._reserved,
            "objects": len(self._index),
            "stuck_threads": self._runner.stuck,
        }

    async def aclose(self) -> None:
        self._closed = True

    def __repr__(self) -> str:
        return f"FileBackend(root={str(self.root)!r}, tag={self._layout.tag!r})"
