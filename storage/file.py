"""File backend: checksummed pages in a directory (local disk or NFS).

Layout on disk: ``<root>/<key[:2]>/<key>.<layout tag>.kv`` (256 fan-out directories keep
directories small). Several backends (layouts, ranks, engine instances) may share a root.
Every page is found under its own name; the file behind the name is either the page alone
or a *segment* (``segment_bytes``): the pages of one ``set_batch`` written as one file and
published under each page's name with a hard link (:mod:`asynccache.storage.segment`).

* Writes go to a hidden temp file in the same directory, then ``os.replace`` (one page) or
  ``os.link`` per page (a segment): readers never see a partial page, and concurrent writers
  of one key are safe (the last publish wins; both wrote a complete, verified page). With
  ``fsync=True`` the file's data is made durable (``fdatasync``) before it is published, and
  the touched directories once per batch after that, before ``set_batch`` reports the pages
  stored; without it, a power loss can lose or tear recent pages, which the checksum turns
  into misses. Durable writes go in groups (``PageFiles.write_group``): a job writes several
  files, starting their writeback at once, before it syncs the first, then publishes each.
* A page may be given as :class:`~asynccache.storage.base.Pieces` (its bytes apart in the
  caller's memory): the pieces go to the file in one ``pwritev`` after the header, with the
  checksum streamed over them, and a verified read is copied out into them piece by piece;
  the object is the same as for the joined bytes.
* Reads ``preadv`` into a per-worker bounce buffer (a run of neighbouring pages of one
  segment by one worker, in file order, page by page), verify every page against its own
  header, and only then copy into the caller's buffer under the call's
  :class:`~asynccache.storage.threadio.PageGuard` (a timed-out call's threads can never write
  a buffer the caller has reused). A bad page's name is removed after the read, under the
  key's claim, if it still names the bad file.
* Bulk I/O runs on ``io_threads`` daemon worker threads (:mod:`asynccache.storage.threadio`)
  with ``os.preadv``/``os.pwritev`` instead of aiofiles: aiofiles does one thread hop per call
  (open, read, close: three per page) and ``read()`` allocates a new bytes object per page;
  ``scripts/bench_storage.py`` measures both. The backend works under any anyio backend.
* A read still running when its call's deadline passes (a FIFO at a page's name, a file on a
  dead NFS server) is abandoned and its pages are *quarantined*: later reads of them are
  immediate ``quarantined`` misses (and ``exists_prefix`` stops there) until the stuck read
  returns or the page is written again. Healthy pages keep their threads meanwhile.
* Capacity: an LRU index of files (:mod:`asynccache.storage.fileindex`) bounds the bytes of this
  backend's objects; new pages evict the least recently used files (a segment goes whole).
  Hits and re-sets refresh recency; a hit also refreshes the file's mtime when it is over a
  minute old, so the order survives a restart (to the minute) without an inode write per
  read. The index is rebuilt from the directory on start.
* Objects written by other instances sharing the root are adopted when ``exists_prefix``
  finds them on disk; each instance bounds only the objects it knows of.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from collections.abc import Callable, Container, Sequence
from pathlib import Path
from typing import Any

import anyio
from prometheus_client import CollectorRegistry

from asynccache.errors import ConfigError, StorageError
from asynccache.storage import filedir
from asynccache.storage.backend import MISS, OK, PRESENT, BackendBase, os_error_reason
from asynccache.storage.base import PageView, StorageLayout, check_batch, validate_keys
from asynccache.storage.daemonpool import loop_caller
from asynccache.storage.fileindex import Evicted, LruIndex, keys_of
from asynccache.storage.fileio import O_CLOEXEC, PageFiles, ReadReq, WriteReq, pre_fault
from asynccache.storage.pageformat import HEADER_SIZE
from asynccache.storage.quarantine import Quarantine
from asynccache.storage.segment import file_bytes, plan_files
from asynccache.storage.threadio import PageGuard, Scratch, ThreadRunner

__all__ = ["FileBackend"]

_MAX_STUCK = 32  # default max_stuck_threads: abandoned threads before calls fail fast
_MiB = 1 << 20
#: A read job takes neighbouring pages of one segment, up to this many bytes: one thread
#: reads them in order (a file streams best read front to back by one reader), other files
#: go to the other threads. Splitting a segment's pages over the threads (1 MiB jobs) read
#: cold 1 MiB pages at 0.89 GB/s here against 1.68 GB/s in one job, warm ones at 1.66 / 3.0.
_READ_RUN_MAX = 32 * _MiB
#: With fsync, a write job takes at most this many bytes of files (all written before the
#: first is synced), and about the batch's bytes over the threads otherwise.
_WRITE_GROUP_MAX = 32 * _MiB
#: ... and at most this many files (each open until synced: io_threads x this many fds).
_WRITE_GROUP_FILES = 32
#: Removal causes that are evictions (counted in ``evictions``).
_EVICTIONS = frozenset({"capacity", "no_space"})

Job = Callable[[int, PageGuard, Scratch], None]


class _Either:
    """``k in`` either container (the batch's keys, or keys busy in other calls)."""

    __slots__ = ("a", "b")

    def __init__(self, a: Container[str], b: Container[str]) -> None:
        self.a, self.b = a, b

    def __contains__(self, k: object) -> bool:
        return k in self.a or k in self.b


class FileBackend(BackendBase):
    """Pages as files under ``root``; see the module docstring.

    ``segment_bytes``: pack the pages of one ``set_batch`` into segment files of up to this
    many bytes (pages of this size or larger stay one file each); ``None`` (default): one
    file per page. ``direct_io``: write and read segments with ``O_DIRECT`` (bypassing the
    page cache; falls back to buffered I/O where the filesystem refuses it). ``mac_key``: a
    secret (at least 16 bytes) to authenticate pages with (``pageformat.PageMac``): pages are
    written with a MAC, under names tagged with the key's id, and only pages whose MAC verifies
    are served (for directories other writers can write to).
    """

    kind = "file"
    takes_pieces = True

    def __init__(
        self,
        root: str | os.PathLike[str],
        layout: StorageLayout,
        *,
        capacity_bytes: int | None = None,
        io_threads: int = 8,
        fsync: bool = False,
        segment_bytes: int | None = None,
        direct_io: bool = False,
        timeout_s: float = 10.0,
        timeout_per_gib_s: float = 10.0,
        max_stuck_threads: int | None = None,
        adopt_external: bool = True,
        registry: CollectorRegistry | None = None,
        metrics_label: str | None = None,
        mac_key: bytes | str | None = None,
    ) -> None:
        super().__init__(
            layout,
            timeout_s=timeout_s,
            timeout_per_gib_s=timeout_per_gib_s,
            registry=registry,
            metrics_label=metrics_label,
            mac_key=mac_key,
        )
        if not isinstance(root, str | os.PathLike) or not os.fspath(root):
            raise ConfigError(f"root must be a directory path, got {root!r}")
        for name, value in (("capacity_bytes", capacity_bytes), ("segment_bytes", segment_bytes)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value <= 0
            ):
                raise ConfigError(f"{name} must be an int > 0 or None, got {value!r}")
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
            raise ConfigError(f"io_threads must be an int >= 1, got {io_threads!r}")
        stuck = _MAX_STUCK if max_stuck_threads is None else max_stuck_threads
        if isinstance(stuck, bool) or not isinstance(stuck, int) or stuck < 1:
            raise ConfigError(f"max_stuck_threads must be an int >= 1, got {max_stuck_threads!r}")
        self.root = Path(os.path.abspath(os.fspath(root)))
        self._root = str(self.root)
        self.capacity_bytes = capacity_bytes
        self.segment_bytes = segment_bytes
        self.fsync = bool(fsync)
        self.adopt_external = bool(adopt_external)
        self._runner = ThreadRunner(io_threads, stuck)
        self._files = PageFiles(
            self._path, self._fault, fsync=self.fsync, direct=bool(direct_io), mac=self._mac
        )
        self._index = LruIndex()  # key -> file (unit); files in LRU order
        self._reserved = 0
        self._victims: list[Evicted] = []
        #: Keys a call is changing on disk (a set writing them, a delete or an eviction
        #: unlinking them), each with an event set when that call is done with them. Calls on
        #: the same key wait their turn, eviction skips busy keys, and exists does not adopt
        #: them: the index and the names on disk change together.
        self._busy: dict[str, anyio.Event] = {}
        #: One set per exists_prefix stat'ing files to adopt (:meth:`_adopt`): the keys other
        #: calls claimed meanwhile (their file may have changed since its stat).
        self._watching: list[set[str]] = []
        self._started = False
        self._start_lock: anyio.Lock | None = None
        self._dir = filedir.DirState(self._root, self._suffix)  # writer lock, temp files
        self._quarantine = Quarantine()  # pages whose read was abandoned, still running
        #: Pages a read found corrupt whose removal did not happen (key -> the bad file's
        #: inode): still on disk (counted if indexed), never served. A read of one is a
        #: ``corrupt`` miss that tries the removal again, exists stops there, a set writes it
        #: again; it ends when its name is unlinked or names another file.
        self._kept_corrupt: dict[str, int] = {}

    # -- paths ----------------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        return f"{self._root}/{key[:2]}/{key}{self._suffix}"

    def path(self, key: str) -> str:
        """The file name under which page ``key`` is stored (whether it exists or not)."""
        return self._path(validate_keys([key])[0])

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
                entries = await self._runner.call(self._scan, max(self.timeout_s, 60.0))
            except (OSError, TimeoutError) as exc:
                self._log.error("storage_start_failed", root=str(self.root), error=repr(exc))
                if strict:
                    raise StorageError(
                        f"cannot use storage directory {str(self.root)!r}: {exc}"
                    ) from exc
                entries = []
            files: dict[int, tuple[int, int, list[str]]] = {}  # inode -> (mtime, size, keys)
            for mtime, key, size, ino in entries:
                files.setdefault(ino, (mtime, size, []))[2].append(key)
            for _mtime, size, keys in sorted(files.values(), key=lambda f: (f[0], f[2][0])):
                self._index.add(keys, size)
            self._started = True
            victims: list[Evicted] = []
            if self.capacity_bytes is not None:
                victims = self._index.evict(self.capacity_bytes, self._dir.tmp_bytes, protect=())
            if victims:
                mark = self._claim_now(keys_of(victims))
                await self._evict_files(victims, mark, "capacity")
            self._set_usage()
            self._log.info(
                "storage_started",
                root=str(self.root),
                objects=len(self._index),
                bytes=self._index.used,
            )

    def _scan(self) -> list[tuple[int, str, int, int]]:
        """Blocking: this layout's objects; takes this writer's lock the first time, removes
        dead writers' temp files and counts the others (``filedir.DirState``)."""
        entries = self._dir.scan()
        self._files.writer = self._dir.writer
        return entries

    @property
    def writer_id(self) -> str | None:
        """The id this backend names its temp files with (None before start, or where the
        filesystem has no ``flock``)."""
        return self._dir.writer

    @property
    def tmp_recheck_s(self) -> float:
        """Seconds between looks at other writers' temp files kept at start (default 60)."""
        return self._dir.recheck_s

    @tmp_recheck_s.setter
    def tmp_recheck_s(self, value: float) -> None:
        self._dir.recheck_s = value

    # -- capacity -------------------------------------------------------------------------------

    def _set_usage(self) -> None:
        self.metrics.set_usage(self._index.used, len(self._index))

    def _reserve(self, size: int, protect: set[str]) -> bool:
        cap = self.capacity_bytes
        if cap is not None:
            if size > cap:
                return False
            held = self._reserved + self._dir.tmp_bytes  # other writers' temp files count too
            self._victims += self._index.evict(cap - size, held, _Either(protect, self._busy))
            if self._index.used + held + size > cap:
                return False
        self._reserved += size
        return True

    async def _claim(self, want: Callable[[], list[str]]) -> tuple[list[str], anyio.Event] | None:
        """Wait until no other call is changing the keys ``want()`` names (asked again after
        each wait), then mark them busy (release with :meth:`_release`); returns them and the
        mark. No wait when none is busy (the usual case); None when they are still busy after
        ``timeout_s`` (an unlink stuck on a dead disk keeps its keys busy until its thread
        returns: the caller fails at its deadline instead of waiting)."""
        busy = self._busy
        with anyio.move_on_after(self.timeout_s):
            while True:
                keys = want()
                ev = next((e for k in keys if (e := busy.get(k)) is not None), None)
                if ev is None:
                    return keys, self._claim_now(keys)
                await ev.wait()
        return None

    def _claim_timed_out(
        self, op: str, keys: list[str], sizes: list[int], started: float
    ) -> list[bool]:
        """Account a call whose keys stayed busy past its deadline: every page a timeout."""
        why = f"another call's I/O on these pages did not end within {self.timeout_s} s"
        return self._account(op, keys, ["timeout"] * len(keys), [why] * len(keys), sizes, started)

    def _claim_now(self, keys: list[str]) -> anyio.Event:
        ev = anyio.Event()
        for k in keys:
            self._busy[k] = ev
        for watch in self._watching:
            watch.update(keys)
        return ev

    def _release(self, keys: list[str], ev: anyio.Event) -> None:
        for k in keys:
            if self._busy.get(k) is ev:
                del self._busy[k]
        ev.set()

    async def _unlink(
        self,
        keys: list[str],
        ev: anyio.Event,
        late: Callable[[str, str], None] | None = None,
        deadline: float | None = None,
        inodes: Sequence[int] | None = None,
    ) -> tuple[list[str], list[str | None]]:
        """Unlink ``keys`` (claimed with ``ev``, released here) even when the caller is
        cancelled meanwhile (their index entries are gone already: the names must go too),
        within ``deadline`` seconds (default :meth:`_deadline`). A key whose unlink outlives
        the deadline stays busy until its thread returns; then ``late(key, outcome)`` runs on
        the loop (before the key is released). With ``inodes``, a name is unlinked only if
        it still names that file (else ``miss``)."""
        call = loop_caller()
        pending = [0]
        raw: list[str | None] = [None] * len(keys)  # outcomes, also of an abandoned unlink

        def one_done(i: int) -> None:
            if late is not None:
                late(keys[i], raw[i] or "timeout")
            pending[0] -= 1
            if pending[0] == 0:
                self._release(keys, ev)

        def on_stuck(i: int, _outcomes: list[str]) -> Callable[[], None]:
            pending[0] += 1
            return lambda: call(lambda: one_done(i))

        try:
            with anyio.CancelScope(shield=True):
                out = await self._runner.run(
                    len(keys),
                    self._unlink_job(keys, raw, inodes),
                    self._deadline() if deadline is None else deadline,
                    on_stuck=on_stuck,
                )
        finally:
            if pending[0] == 0:
                self._release(keys, ev)
        return out

    async def _evict_files(self, units: list[Evicted], ev: anyio.Event, cause: str) -> None:
        """Unlink the files of ``units``, which the index dropped for ``cause`` (their keys
        claimed with ``ev``, released here; cancel-safe), and tell listeners the pages gone
        (:meth:`_remove`); a page whose unlink did not happen stays indexed, counted
        (``evict.<reason>`` faults) and logged (``storage_evict_failed``)."""
        result, kept_bytes = await self._remove(units, ev, cause)
        self._unlink_failed("evict", cause, result, kept_bytes)

    async def _remove(
        self,
        units: list[Evicted],
        ev: anyio.Event,
        cause: str,
        unknown: Sequence[str] = (),
        deadline: float | None = None,
    ) -> tuple[dict[str, tuple[str, str | None]], int]:
        """Unlink the pages of ``units``, which the index dropped for ``cause`` (an eviction,
        a delete, a clear), and the ``unknown`` pages (not in the index); all claimed with
        ``ev``, released here; cancel-safe; within ``deadline`` (default :meth:`_deadline`). Tell the listeners the pages gone: those unlinked,
        and those indexed whose file was gone already. Returns each page's unlink outcome
        and detail, and the bytes put back into the index.

        A page of ``units`` whose unlink did not happen (it failed, the backend failed fast
        with ``unavailable``, or it was still running at the deadline) still has its file on
        disk: it goes back into the index with the bytes of its file (into its unit if that
        still holds other pages, else as the least recent: the next eviction takes it first)
        and is not told gone. An unlink that outlived the deadline and then removed its page
        drops it from the index then (and tells it gone)."""
        keys = [*keys_of(units), *unknown]
        evicting = cause in _EVICTIONS
        restored: dict[str, int] = {}  # page -> id of the unit it went back into

        def late(key: str, outcome: str) -> None:
            if outcome in (OK, MISS):
                self._kept_corrupt.pop(key, None)
            uid = restored.pop(key, None)
            if outcome in (OK, MISS) and uid is not None and self._index.unit_of(key) == uid:
                self._index.drop(key)
                if evicting:
                    self.metrics.evicted(1)
                self._set_usage()
                self._gone([key], cause)

        outcomes, details = await self._unlink(keys, ev, late, deadline)
        # No await from here on: a late() runs after this (on the loop, at the next await).
        result = dict(zip(keys, zip(outcomes, details, strict=True), strict=True))
        for k, (o, _) in result.items():
            if o in (OK, MISS):
                self._kept_corrupt.pop(k, None)
        used = self._index.used
        for unit in reversed(units):  # least recent ends up first
            kept = [k for k in unit.keys if result[k][0] not in (OK, MISS)]
            uid = self._index.restore(kept, unit.nbytes, unit.uid)
            if uid is not None:
                restored.update(dict.fromkeys(kept, uid))
        indexed = set(keys_of(units))
        gone = [k for k, (o, _) in result.items() if o == OK or (o == MISS and k in indexed)]
        if evicting:
            self.metrics.evicted(len(gone))
        self._set_usage()
        self._gone(gone, cause)
        return result, self._index.used - used

    def _unlink_failed(
        self, op: str, cause: str, result: dict[str, tuple[str, str | None]], kept_bytes: int
    ) -> None:
        """Count (``<op>.<reason>`` faults) and log (``storage_<op>_failed``, once) the pages
        of ``result`` (:meth:`_remove`) whose unlink did not happen."""
        failed = {k: od for k, od in result.items() if od[0] not in (OK, MISS)}
        if not failed:
            return
        reasons = Counter(o for o, _ in failed.values())
        for reason, count in reasons.items():
            self.metrics.fault(op, reason, count)
        first_key, (_, detail) = next(iter(failed.items()))
        self._log.warning(
            f"storage_{op}_failed",
            cause=cause,
            pages=len(failed),
            kept_bytes=kept_bytes,
            reasons=dict(reasons),
            first_key=first_key,
            detail=detail,
        )

    def _quarantine_keys(self, keys: list[str]) -> Callable[[], None]:
        lift = self._quarantine.add(keys)
        self._log.warning("storage_quarantined", keys=keys, quarantined=len(self._quarantine))
        return lift

    def _unlink_job(
        self,
        keys: list[str],
        raw: list[str | None] | None = None,
        inodes: Sequence[int] | None = None,
    ) -> Job:
        """Unlink ``keys[i]`` (with ``inodes``: only if its name still names file
        ``inodes[i]``, else ``miss``); ``raw[i]`` (if given) gets its outcome also after the
        call."""

        def job(i: int, guard: PageGuard, _scratch: Scratch) -> None:
            key = keys[i]
            path = self._path(key)
            detail: str | None = None
            try:
                pre_fault(self._fault("delete", key), "unlink")
                if inodes is not None and os.stat(path).st_ino != inodes[i]:
                    raise FileNotFoundError(path)  # another file now: not the bad one
                os.unlink(path)
                outcome = OK
            except FileNotFoundError:
                outcome = MISS
            except OSError as exc:
                outcome, detail = os_error_reason(exc), str(exc)
            if raw is not None:
                raw[i] = outcome
            guard.finish(i, outcome, detail)

        return job

    # -- exists ---------------------------------------------------------------------------------

    async def exists_prefix(self, keys: Sequence[str]) -> int:
        self._check_open()
        key_list = validate_keys(keys)
        await self._ensure_started()
        started = time.perf_counter()
        n = 0
        quarantine, kept = self._quarantine, self._kept_corrupt
        for key in key_list:
            if key not in self._index or key in quarantine or key in kept:
                break
            n += 1
        rest = key_list[n:]
        rest = rest[: next((i for i, k in enumerate(rest) if k in kept), len(rest))]
        if rest and self.adopt_external and rest[0] not in quarantine:
            n += await self._adopt(rest)
        self.metrics.page("exists", "hit", n)
        self.metrics.page("exists", "miss", min(1, len(key_list) - n))
        self.metrics.observe("exists", time.perf_counter() - started)
        return n

    async def _adopt(self, keys: list[str]) -> int:
        """Stat ``keys`` in order until one is missing; index the ones found on disk. A key
        another call is changing (busy) when the stats start, or claims while they run, may
        have lost its file since its stat (an eviction or a delete unlinking it): it is not
        adopted, and the prefix stops there unless it is indexed by then."""
        found: list[tuple[str, os.stat_result]] = []
        errors: list[str] = []

        def job(i: int, guard: PageGuard, _scratch: Scratch) -> None:
            for key in keys:
                if key in self._quarantine:
                    break
                try:
                    pre_fault(self._fault("exists", key), "stat")
                    found.append((key, os.stat(self._path(key))))
                except FileNotFoundError:
                    break
                except OSError as exc:
                    errors.append(os_error_reason(exc))
                    break
            guard.finish(i, OK)

        changed = {k for k in keys if k in self._busy}
        self._watching.append(changed)
        try:
            outcomes, _ = await self._runner.run(1, job, self._deadline())
        finally:
            self._watching = [w for w in self._watching if w is not changed]
        if outcomes[0] != OK:
            errors.append(outcomes[0])
        if errors:
            self.metrics.fault("exists", errors[0])
            self._log.warning("storage_faults", op="exists", faults={errors[0]: 1})
        adopted = list(found)  # a timed-out thread may still append
        index = self._index
        stale = (i for i, (k, _) in enumerate(adopted) if k in changed and k not in index)
        adopted = adopted[: next(stale, len(adopted))]
        # Names of one segment found together become one file; its bytes are shared out
        # over all its names (some may be another instance's to bound).
        j = 0
        while j < len(adopted):
            st = adopted[j][1]
            k = j + 1
            while k < len(adopted) and adopted[k][1].st_ino == st.st_ino:
                k += 1
            new = [
                key for key, _ in adopted[j:k] if key not in self._index and key not in self._busy
            ]
            if new:
                share = st.st_size * len(new) // max(st.st_nlink, len(new))
                self._index.add(new, share)
            j = k
        if adopted:
            self._set_usage()
        return len(adopted)

    # -- get ------------------------------------------------------------------------------------

    async def get_batch(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        self._check_open()
        key_list, views = check_batch(keys, buffers, writable=True, pieces=True)
        await self._ensure_started()
        started = time.perf_counter()
        n = len(key_list)
        outcomes: list[str] = ["quarantined"] * n
        details: list[str | None] = ["a read of this page is stuck"] * n
        quarantine, kept = self._quarantine, self._kept_corrupt
        bad: dict[str, int] = {}  # key -> the file its read found corrupt (first one)
        for i, k in enumerate(key_list):
            if k in kept and k not in quarantine:  # never served: try its removal again
                outcomes[i] = "corrupt"
                details[i] = "found corrupt before and not removed; removal tried again"
                bad.setdefault(k, kept[k])
        live = [i for i, k in enumerate(key_list) if k not in quarantine and k not in kept]
        reqs = [
            ReadReq(j, key_list[i], key_list[i] + self._suffix, views[i])
            for j, i in enumerate(live)
        ]
        total = sum(r.target.nbytes for r in reqs)
        runs = self._read_runs(reqs)

        def job(g: int, guard: PageGuard, scratch: Scratch) -> None:
            run, in_segment = runs[g]
            try:
                self._files.read_run(run, in_segment, guard, scratch)
            except Exception as exc:  # a bug: keep the engine alive, count it, log it
                self._log.exception("storage_worker_error", op="get", error=repr(exc))
                for r in run:
                    guard.finish(r.slot, "internal", repr(exc))

        def on_stuck(g: int, done: list[str]) -> Callable[[], None] | None:
            hung = [r.key for r in runs[g][0] if done[r.slot] == "timeout"]
            return self._quarantine_keys(hung) if hung else None

        index = self._index
        before = [index.unit_of(k) for k in key_list]  # a drop below needs the same file
        deadline = self._deadline(total)
        if reqs:
            done, done_details = await self._runner.run(
                len(runs), job, deadline, slots=len(reqs), on_stuck=on_stuck
            )
            for j, i in enumerate(live):
                outcomes[i], details[i] = done[j], done_details[j]
        missing: list[str] = []
        for j, i in enumerate(live):
            ino = reqs[j].bad
            if outcomes[i] in ("corrupt", "partial") and ino is not None:
                bad.setdefault(key_list[i], ino)
        for key, outcome, unit in zip(key_list, outcomes, before, strict=True):
            if outcome == OK:
                index.touch(key)
            elif outcome == MISS and unit is not None and index.unit_of(key) == unit:
                index.drop(key)
                missing.append(key)  # known, but gone: deleted behind this backend's back
        self._set_usage()
        sizes = [v.nbytes for v in views]
        results = self._account("get", key_list, outcomes, details, sizes, started)
        if bad:
            left = deadline - (time.perf_counter() - started)
            await self._remove_corrupt(bad, missing, left)
        self._gone(missing, "missing")
        return results

    async def _remove_corrupt(
        self, bad: dict[str, int], missing: list[str], deadline: float
    ) -> None:
        """Unlink the names of the bad files a read found (``bad``: key -> inode), each only
        if it still names that file, within ``deadline`` s; drop them from the index and tell
        them gone (``corrupt``; not the ``missing`` ones, told by the caller). A key another
        call is changing is left to that call (a set replaces it, a delete or an eviction
        unlinks and tells it). A name whose unlink does not happen (it fails, it outlives the
        deadline, or no time is left) stays, indexed and counted if it was: it is kept
        corrupt (never served, see ``_kept_corrupt``; the next read of it tries again),
        counted (``remove_corrupt.<reason>`` faults) and logged once
        (``storage_remove_corrupt_failed``). Cancel-safe, like delete."""
        keys = [k for k in bad if k not in self._busy]
        if not keys:
            return
        told = set(missing)
        index = self._index
        kept = self._kept_corrupt
        unknown = {k for k in keys if k not in index}  # a file the index did not know

        def gone(removed: list[str]) -> None:
            # The index knew this very file, if it knew the key (nothing can index another
            # one under the claim); a page a concurrent get_batch missed was dropped and told.
            tell = [k for k in removed if (index.drop(k) or k in unknown) and k not in told]
            self._set_usage()
            self._gone(tell, "corrupt")

        def late(key: str, outcome: str) -> None:
            if outcome in (OK, MISS):  # (a miss: the name is gone or names another file)
                kept.pop(key, None)
            if outcome == OK:
                gone([key])

        if deadline > 0:
            mark = self._claim_now(keys)
            outcomes, details = await self._unlink(
                keys, mark, late, deadline, [bad[k] for k in keys]
            )
        else:
            outcomes = ["timeout"] * len(keys)
            details = ["the call's deadline passed before the removal"] * len(keys)
        # No await from here on: a late() runs after this.
        result = dict(zip(keys, zip(outcomes, details, strict=True), strict=True))
        for k, (o, _) in result.items():
            if o in (OK, MISS):
                kept.pop(k, None)
            else:
                kept[k] = bad[k]
        gone([k for k in keys if result[k][0] == OK])
        failed = [k for k in keys if result[k][0] not in (OK, MISS)]
        self._unlink_failed("remove_corrupt", "corrupt", result, index.file_bytes(failed))

    def _read_runs(self, reqs: list[ReadReq]) -> list[tuple[list[ReadReq], bool]]:
        """Split a batch into read jobs: neighbouring pages of one segment go together (one
        open, read in order), up to :data:`_READ_RUN_MAX` bytes."""
        index = self._index
        runs: list[tuple[list[ReadReq], bool]] = []
        i = 0
        while i < len(reqs):
            unit = index.unit_of(reqs[i].key)
            in_segment = unit is not None and index.unit_size(reqs[i].key) > 1
            j, nbytes = i + 1, reqs[i].target.nbytes
            if in_segment:
                while (
                    j < len(reqs)
                    and index.unit_of(reqs[j].key) == unit
                    and nbytes + reqs[j].target.nbytes <= _READ_RUN_MAX
                ):
                    nbytes += reqs[j].target.nbytes
                    j += 1
            runs.append((reqs[i:j], in_segment))
            i = j
        return runs

    # -- set ------------------------------------------------------------------------------------

    async def set_batch(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        self._check_open()
        key_list, views = check_batch(keys, buffers, writable=False, pieces=True)
        await self._ensure_started()
        if self._dir.due():  # other writers' temp files: still there, still theirs?
            with contextlib.suppress(OSError, TimeoutError):
                await self._runner.call(self._dir.recheck, self._deadline())
        quarantine = self._quarantine
        index = self._index
        busy = self._busy  # indexed and busy: an unlink past its deadline may still take it
        unique = list(dict.fromkeys(key_list))

        kept = self._kept_corrupt  # a page kept corrupt is written again, not present

        def to_write() -> list[str]:
            return [
                k for k in unique if k not in index or k in quarantine or k in busy or k in kept
            ]

        # After a delete / eviction / set of them ends; chosen again after each wait (an
        # eviction may have taken a page meanwhile that was indexed: it must be claimed too).
        claimed = await self._claim(to_write)
        if claimed is None:
            return self._claim_timed_out(
                "set", key_list, [v.nbytes for v in views], time.perf_counter()
            )
        writing, mark = claimed
        try:
            return await self._set_claimed(key_list, views)
        finally:
            self._release(writing, mark)

    async def _set_claimed(self, key_list: list[str], views: list[PageView]) -> list[bool]:
        started = time.perf_counter()
        n = len(key_list)
        outcomes: list[str] = [OK] * n
        details: list[str | None] = [None] * n
        protect = set(key_list)
        todo: list[int] = []
        first: dict[str, int] = {}  # a key repeated within the batch is written once
        quarantine, kept = self._quarantine, self._kept_corrupt
        for i, key in enumerate(key_list):
            if key in self._index and key not in quarantine and key not in kept:
                # content-addressed: recency only
                self._index.touch(key)
                outcomes[i] = PRESENT
            elif first.setdefault(key, i) == i:
                todo.append(i)
        files = self._reserve_files(todo, views, protect, outcomes, details)
        victims, self._victims = self._victims, []
        done = await self._write_files(key_list, views, files, victims, "capacity")
        # ENOSPC: the filesystem is full, whatever the capacity says. That is capacity
        # pressure: evict least recently used files and write those pages once more.
        full = [i for g, _ in files for i in g if done[i][0] == "no_space"]
        if full:
            room = 2 * sum(size for g, size in files if any(done[i][0] == "no_space" for i in g))
            more_victims = self._make_room(room, protect)
            if more_victims:
                # The space must be free before the writes start: unlink first.
                await self._write_files(key_list, views, [], more_victims, "no_space")
                # Then reserve again, like any write: the first attempt gave its reservation
                # back, other calls may have taken that room meanwhile, and a victim whose
                # unlink failed is counted again. A page that no longer fits is a capacity
                # skip (so is each page of a segment that does not: written page by page).
                for i in full:
                    del done[i]
                retry = self._reserve_files(full, views, protect, outcomes, details)
                victims, self._victims = self._victims, []
                self.metrics.no_space_retry(sum(len(g) for g, _ in retry))
                done.update(await self._write_files(key_list, views, retry, victims, "capacity"))
        for i, (outcome, detail) in done.items():
            outcomes[i], details[i] = outcome, detail
        for i, key in enumerate(key_list):
            j = first.get(key, i)
            if j != i:
                outcomes[i] = PRESENT if outcomes[j] == OK else outcomes[j]
                details[i] = details[j]
        self._set_usage()
        sizes = [v.nbytes for v in views]
        return self._account("set", key_list, outcomes, details, sizes, started)

    async def _write_files(
        self,
        key_list: list[str],
        views: list[PageView],
        files: list[tuple[list[int], int]],
        victims: list[Evicted],
        cause: str,
    ) -> dict[int, tuple[str, str | None]]:
        """Unlink ``victims`` (evicted for ``cause``) and write ``files`` (reserved page
        groups, indices into the batch); index what was stored. Returns each page's outcome.

        The victims are unlinked even when the call is cancelled (they left the index), and
        they stay busy until then (a set of one waits: the late unlink cannot take its new
        file); a victim whose unlink does not happen goes back into the index
        (:meth:`_evict_files`). Every page published is indexed, also when the call is
        cancelled after."""
        vmark = self._claim_now(keys_of(victims))  # before any await: chosen just now
        n = len(key_list)
        total = sum(views[i].nbytes for g, _ in files for i in g)
        writes = self._write_jobs(
            [
                [WriteReq(i, key_list[i], key_list[i] + self._suffix, views[i]) for i in g]
                for g, _ in files
            ],
            total,
        )

        def job(j: int, guard: PageGuard, scratch: Scratch) -> None:
            group = writes[j]
            try:
                self._files.write_group(group, guard, scratch)
            except Exception as exc:  # a bug: keep the engine alive, count it, log it
                self._log.exception("storage_worker_error", op="set", error=repr(exc))
                for reqs in group:
                    for r in reqs:
                        guard.finish(r.slot, "internal", repr(exc))

        async def unlink_victims() -> None:
            with anyio.CancelScope(shield=True):
                await self._evict_files(victims, vmark, cause)

        report: list[str | None] = []
        done: list[str] = ["timeout"] * n
        done_details: list[str | None] = [None] * n
        try:
            async with anyio.create_task_group() as tg:
                if victims:
                    tg.start_soon(unlink_victims)
                if writes:
                    done, done_details = await self._runner.run(
                        len(writes), job, self._deadline(total), slots=n, report=report
                    )
        finally:
            self._reserved -= sum(size for _, size in files)
            for g, size in files:  # what was published is on disk: index it, whatever else
                stored = [key_list[i] for i in g if report and report[i] == OK]
                if stored:
                    self._index.add(stored, size)
                    self._quarantine.discard(stored)  # a new file under the name: readable
                    for k in stored:
                        self._kept_corrupt.pop(k, None)
            self._set_usage()
        if self.fsync:
            written = [key_list[i] for g, _ in files for i in g if done[i] == OK]
            failed = await self._sync_dirs(written)
            for g, _ in files:
                for i in g:
                    if done[i] == OK and key_list[i][:2] in failed:
                        done[i], done_details[i] = failed[key_list[i][:2]]
        return {i: (done[i], done_details[i]) for g, _ in files for i in g}

    def _write_jobs(self, files: list[list[WriteReq]], total: int) -> list[list[list[WriteReq]]]:
        """Deal the files of a batch out to write jobs. With ``fsync``, a job takes several
        neighbouring files (about ``total / io_threads`` bytes, at most 32 MiB and 32 files): it
        writes them all before it syncs the first (``PageFiles.write_group``), so their data
        goes to the disk together and one journal commit covers several files, instead of a
        write, a wait for the disk and a commit per file. Without ``fsync``, one file a job."""
        if not self.fsync or len(files) <= self._runner.threads:
            return [[f] for f in files]
        budget = min(_WRITE_GROUP_MAX, -(-total // self._runner.threads))
        jobs: list[list[list[WriteReq]]] = []
        nbytes = 0
        for f in files:
            size = sum(r.payload.nbytes for r in f)
            if not jobs or nbytes + size > budget or len(jobs[-1]) >= _WRITE_GROUP_FILES:
                jobs.append([])
                nbytes = 0
            jobs[-1].append(f)
            nbytes += size
        return jobs

    def _reserve_files(
        self,
        todo: list[int],
        views: list[PageView],
        protect: set[str],
        outcomes: list[str],
        details: list[str | None],
    ) -> list[tuple[list[int], int]]:
        """Plan the files of ``todo``'s pages and reserve each within the capacity (choosing
        victims into ``self._victims``); a segment that does not fit is reserved page by page.
        Returns the reserved files (page indices, bytes on disk); a page that does not fit
        gets outcome ``capacity``."""
        files: list[tuple[list[int], int]] = []
        for group in self._plan_files(todo, views):
            size = file_bytes([views[i].nbytes for i in group], self._files.direct)
            if self._reserve(size, protect):
                files.append((group, size))
                continue
            skipped = group if len(group) == 1 else []
            for i in group if len(group) > 1 else ():  # a segment that does not fit: pages
                if self._reserve(HEADER_SIZE + views[i].nbytes, protect):
                    files.append(([i], HEADER_SIZE + views[i].nbytes))
                else:
                    skipped.append(i)
            for i in skipped:
                outcomes[i] = "capacity"
                details[i] = f"{HEADER_SIZE + views[i].nbytes} bytes do not fit"
        return files

    def _make_room(self, nbytes: int, protect: set[str]) -> list[Evicted]:
        """After ENOSPC: evict least recently used files for ``nbytes`` (twice the bytes of
        the files that did not fit, so the next batch of that size usually fits at once);
        returns the victims (none: nothing can be evicted, no retry). The pages are then
        reserved again (:meth:`_reserve_files`) before they are written once more."""
        return self._index.evict(self._index.used - nbytes, 0, _Either(protect, self._busy))

    def _plan_files(self, todo: list[int], views: list[PageView]) -> list[list[int]]:
        """The files to write ``todo``'s pages in (``segment.plan_files``); one page per file
        where the filesystem has no hard links."""
        limit = self.segment_bytes if self._files.links_ok else None
        return plan_files(todo, [v.nbytes for v in views], limit)

    async def _sync_dirs(self, keys: list[str]) -> dict[str, tuple[str, str | None]]:
        """fsync the directories of freshly published pages, once each per batch (the new
        names are durable only then; one journal commit usually covers them all). Returns
        the failed directories' outcomes by fan-out prefix."""
        prefixes = sorted({k[:2] for k in keys})

        def job(i: int, guard: PageGuard, _scratch: Scratch) -> None:
            try:
                dfd = os.open(os.path.join(self.root, prefixes[i]), os.O_RDONLY | O_CLOEXEC)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
                guard.finish(i, OK)
            except OSError as exc:
                guard.finish(i, os_error_reason(exc), str(exc))

        outcomes, details = await self._runner.run(len(prefixes), job, self._deadline())
        return {p: (o, d) for p, o, d in zip(prefixes, outcomes, details, strict=True) if o != OK}

    # -- delete / clear -------------------------------------------------------------------------

    async def delete(self, keys: Sequence[str]) -> int:
        self._check_open()
        key_list = list(dict.fromkeys(validate_keys(keys)))
        await self._ensure_started()
        started = time.perf_counter()
        claimed = await self._claim(lambda: key_list)  # after a set / eviction of them ends
        if claimed is None:
            return sum(self._claim_timed_out("delete", key_list, [0] * len(key_list), started))
        mark = claimed[1]
        units = self._index.take(key_list)
        indexed = set(keys_of(units))
        unknown = [k for k in key_list if k not in indexed]
        # Even if cancelled meanwhile; a page whose unlink did not happen stays indexed.
        result, _ = await self._remove(units, mark, "delete", unknown)
        outcomes = [result[k][0] for k in key_list]
        details = [result[k][1] for k in key_list]
        self._quarantine.discard(
            [k for k, o in zip(key_list, outcomes, strict=True) if o in (OK, MISS)]
        )
        sizes = [0] * len(key_list)
        return sum(self._account("delete", key_list, outcomes, details, sizes, started))

    async def clear(self) -> int:
        """Remove every object of this layout under the root (also ones not in the index);
        returns how many were removed. Keys another call is changing are left to it. A page
        whose unlink does not happen stays (in the index, counted, if it was there); counted
        (``clear.<reason>`` faults) and logged (``storage_clear_failed``), like a directory
        that cannot be listed (then nothing is removed)."""
        self._check_open()
        await self._ensure_started()
        deadline = max(self.timeout_s, 60.0)
        found: list[list[tuple[int, str, int, int]]] = []

        def scan(i: int, guard: PageGuard, _scratch: Scratch) -> None:
            try:
                found.append(self._scan())
                guard.finish(i, OK)
            except OSError as exc:
                guard.finish(i, os_error_reason(exc), str(exc))

        outcomes, details = await self._runner.run(1, scan, deadline)
        if outcomes[0] != OK:
            self.metrics.fault("clear", outcomes[0])
            self._log.warning("storage_clear_failed", reason=outcomes[0], detail=details[0])
            return 0
        on_disk = [key for _mtime, key, _size, _ino in found[0]]
        busy = self._busy
        keys = [k for k in dict.fromkeys([*self._index.keys(), *on_disk]) if k not in busy]
        mark = self._claim_now(keys)
        units = self._index.take(keys)
        indexed = set(keys_of(units))
        unknown = [k for k in keys if k not in indexed]
        result, kept_bytes = await self._remove(units, mark, "clear", unknown, deadline)
        self._quarantine.discard([k for k, (o, _) in result.items() if o in (OK, MISS)])
        self._unlink_failed("clear", "clear", result, kept_bytes)
        return sum(o == OK for o, _ in result.values())

    # -- misc -----------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {
            **self._base_stats(),
            "root": str(self.root),
            "capacity_bytes": self.capacity_bytes,
            "segment_bytes": self.segment_bytes,
            "direct_io": self._files.direct,
            "used_bytes": self._index.used,
            "reserved_bytes": self._reserved,
            "objects": len(self._index),
            "files": self._index.files,
            "stuck_threads": self._runner.stuck,
            "quarantined": len(self._quarantine),
            "corrupt_kept": len(self._kept_corrupt),
            "no_space_retries": self.metrics.no_space_retries,
            "temp_files": len(self._dir.temps),
            "temp_bytes": self._dir.tmp_bytes,
            "writer_id": self._dir.writer,
        }

    async def aclose(self) -> None:
        """Later calls raise ClosedError; this writer's lock file is removed (its temp files
        are then anyone's to remove)."""
        if self._closed:
            return
        self._closed = True
        if self._dir.lock.held:
            with contextlib.suppress(OSError, TimeoutError):
                await self._runner.call(self._dir.lock.release, self.timeout_s)

    def __repr__(self) -> str:
        return f"FileBackend(root={str(self.root)!r}, tag={self._layout.tag!r})"
