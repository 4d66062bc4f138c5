"""Blocking page I/O of the file backend, run on its worker threads.

:class:`PageFiles` writes pages (one file per page, or a segment of several pages published
under each page's name with hard links) and reads runs of pages, verifying each against its
own header before the caller's buffer is touched. Every function reports per page through
the call's :class:`~asynccache.storage.threadio.PageGuard`; faults from the injection hook strike here.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from asynccache.storage.backend import MISS, OK, os_error_reason
from asynccache.storage.base import Pieces, copy_into
from asynccache.storage.faults import Fault, FaultKind, fault_error, flip_byte
from asynccache.storage.pageformat import (
    HEADER_SIZE,
    CorruptPageError,
    PageMac,
    encode_header,
    name_hash,
    parse_header,
    verify_payload,
)
from asynccache.storage.segment import (
    BLOCK,
    HEAD_READ,
    Entry,
    encode_table,
    is_segment,
    parse_table,
)
from asynccache.storage.threadio import PageGuard, Scratch

__all__ = ["PageFiles", "ReadReq", "WriteReq", "pread_full", "pwrite_all"]

TOUCH_AFTER_S = 60.0  # a hit refreshes the file's mtime only when it is older than this
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_DIRECT = getattr(os, "O_DIRECT", 0)
_NO_LINKS = {errno.EPERM, errno.EMLINK, errno.EXDEV, errno.ENOTSUP, errno.EOPNOTSUPP}


#: Buffered reads go in steps of this many bytes (the kernel's default readahead window):
#: the kernel then reads ahead of each step, so a cold file streams. One read of a whole
#: 4 MiB page waited for each of its pieces in turn: 1.25 against 1.73 GB/s here.
READ_STEP = 128 << 10
#: ``O_DIRECT`` reads (no readahead) go in steps of this many bytes: 1 MiB requests read
#: segments at 2.2 GB/s here, 4 MiB ones at 1.9, 32 MiB ones at 1.2.
DIRECT_STEP = 1 << 20


def pread_full(fd: int, view: memoryview, offset: int = 0) -> int:
    """Read ``view`` from ``offset`` in :data:`READ_STEP` steps; stops at the end of the file."""
    total = 0
    size = len(view)
    while total < size:
        at = offset + total
        step = READ_STEP - at % READ_STEP  # steps end on READ_STEP boundaries of the file
        n = os.preadv(fd, [view[total : total + step]], at)
        if n == 0:
            break
        total += n
    return total


def pread_direct(fd: int, view: memoryview, offset: int) -> int:
    """``O_DIRECT`` read of a block-aligned range in :data:`DIRECT_STEP` steps; stops at the
    end of the file."""
    total = 0
    while total < len(view):
        n = os.preadv(fd, [view[total : total + DIRECT_STEP]], offset + total)
        total += n
        if n == 0 or n % BLOCK:
            break
    return total


def pwrite_all(fd: int, parts: list[memoryview]) -> None:
    offset = 0
    while parts:
        n = os.pwritev(fd, parts[:1024], offset)  # IOV_MAX
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        while parts and n >= len(parts[0]):
            n -= len(parts[0])
            parts.pop(0)
        if parts and n:
            parts[0] = parts[0][n:]


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the dirty pages; do not wait


def start_writeback(fd: int) -> None:
    """Start writing a file's dirty pages to the disk without waiting (Linux
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; nothing elsewhere). A hint only: durability
    still comes from ``fdatasync``; an error here is left for ``fdatasync`` to report."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def pre_fault(fault: Fault | None, what: str) -> None:
    """Apply the faults that strike before any byte moves."""
    if fault is None:
        return
    if fault.kind is FaultKind.DELAY:
        time.sleep(fault.delay_s)
    elif fault.kind in (FaultKind.EIO, FaultKind.DROP):
        raise fault_error(fault.kind, what)


@dataclass(slots=True)
class ReadReq:
    slot: int
    key: str
    name: str
    target: memoryview | Pieces
    #: The inode of the file this page was found corrupt or partial in (the reader removes
    #: nothing: the caller removes the name, if it still names that file).
    bad: int | None = None


@dataclass(slots=True)
class _Staged:
    """A file of :meth:`PageFiles.write_group` between its write and its publish."""

    reqs: list[WriteReq]
    tmp: str | None  # the temp file; None once published under the page's name
    fd: int  # open until synced; -1 after
    failed: bool = False


@dataclass(slots=True)
class WriteReq:
    slot: int
    key: str
    name: str
    payload: memoryview | Pieces


class PageFiles:
    """Page files under one root; ``path(key)`` names a page, ``fault(op, key)`` injects."""

    def __init__(
        self,
        path: Callable[[str], str],
        fault: Callable[[str, str], Fault | None],
        *,
        fsync: bool,
        direct: bool = False,
        mac: PageMac | None = None,
    ) -> None:
        self.path = path
        self.fault = fault
        self.mac = mac
        self.fsync = fsync
        self.direct = direct and O_DIRECT != 0  # segments with O_DIRECT (cleared on EINVAL)
        self.links_ok = True  # cleared when the filesystem refuses hard links
        #: This backend's writer id (storage/filewriters.py), named in every temp file so a
        #: later start can tell a dead writer's leftovers from a live writer's in-flight ones.
        self.writer: str | None = None

    def tmp_path(self, directory: str, stem: str) -> str:
        """A fresh hidden temp file name in ``directory``."""
        tag = secrets.token_hex(6)
        if self.writer is not None:
            return os.path.join(directory, f".{self.writer}.{stem}.{tag}.tmp")
        return os.path.join(directory, f".{stem}.{os.getpid()}.{tag}.tmp")  # no writer lock

    # -- writes ---------------------------------------------------------------------------------

    def _create_tmp(self, directory: str, stem: str) -> tuple[str, int]:
        tmp = self.tmp_path(directory, stem)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC
        try:
            return tmp, os.open(tmp, flags, 0o644)
        except FileNotFoundError:
            os.makedirs(directory, exist_ok=True)
            return tmp, os.open(tmp, flags, 0o644)

    def _write_file(self, fd: int, parts: list[memoryview], enospc: bool) -> None:
        """Write ``parts`` from offset 0; with ``fsync``, start the file's writeback at once
        (not waiting for it: the group's ``fdatasync`` calls come after all its writes)."""
        if enospc:  # an injected full disk: half the bytes, then the error
            half = sum(p.nbytes for p in parts) // 2
            pwrite_all(fd, _cut(parts, half))
            raise fault_error(FaultKind.ENOSPC, "write")
        pwrite_all(fd, parts)
        if self.fsync:
            start_writeback(fd)

    def _write_direct(
        self, directory: str, parts: list[memoryview], enospc: bool, scratch: Scratch
    ) -> str | None:
        """Write a segment with ``O_DIRECT`` from an aligned copy, zero-padded to a whole
        block; returns the temp file, or None when the filesystem refuses O_DIRECT."""
        size = sum(p.nbytes for p in parts)
        padded = -(-size // BLOCK) * BLOCK
        buf = scratch.aligned(padded)
        at = 0
        for p in parts:
            copy_into(buf[at : at + p.nbytes], p)
            at += p.nbytes
        buf[size:] = bytes(padded - size)
        tmp = self.tmp_path(directory, "seg")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC | O_DIRECT
        try:
            try:
                fd = os.open(tmp, flags, 0o644)
            except FileNotFoundError:
                os.makedirs(directory, exist_ok=True)
                fd = os.open(tmp, flags, 0o644)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.direct = False  # e.g. tmpfs: buffered writes from now on
            return None
        try:
            if enospc:
                pwrite_all(fd, [buf[: padded // 2 // BLOCK * BLOCK]])
                raise fault_error(FaultKind.ENOSPC, "write")
            pwrite_all(fd, [buf])
            if self.fsync:
                os.fdatasync(fd)  # the file's size and extents
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)
        return tmp

    def write_single(self, req: WriteReq, guard: PageGuard) -> None:
        """One page, one file: temp file, then ``os.replace`` onto its name."""
        self.write_group([[req]], guard, None)

    def write_segment(self, reqs: list[WriteReq], guard: PageGuard, scratch: Scratch) -> None:
        """Several pages in one file (one write, one fdatasync), then a hard link per page.

        A fault striking any page's raw write fails the whole file, as a real one would.
        """
        self.write_group([reqs], guard, scratch)

    def write_group(
        self, files: list[list[WriteReq]], guard: PageGuard, scratch: Scratch | None
    ) -> None:
        """Write several files in one job, each a page (one request) or a segment (several).

        Three phases: every file is written to its temp file (with ``fsync``, its writeback
        started right after its write); then each is made durable (``fdatasync``, which finds
        its data mostly on the disk already, and one journal commit can cover several files);
        then each is published (``os.replace``, or a hard link per page of a segment). A file
        is published only after its own ``fdatasync`` returned, and a file whose write or sync
        fails is never published (its pages fail; the other files go on).
        """
        staged: list[_Staged] = []
        try:
            for reqs in files:
                st = self._stage(reqs, guard, scratch)
                if st is not None:
                    staged.append(st)
            for st in staged:
                if st.fd < 0:
                    continue
                fd, st.fd = st.fd, -1
                try:
                    if self.fsync:
                        os.fdatasync(fd)
                except OSError as exc:
                    self._fail(st.reqs, exc, guard)
                    st.failed = True
                finally:
                    os.close(fd)
            if not guard.may_publish():
                return  # the call is over; the finally below removes the temp files
            for st in staged:
                if not st.failed:
                    self._publish(st, guard)
        finally:
            for st in staged:
                if st.fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(st.fd)
                if st.tmp is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(st.tmp)

    @staticmethod
    def _fail(reqs: list[WriteReq], exc: OSError, guard: PageGuard) -> None:
        reason, detail = os_error_reason(exc), str(exc)
        for r in reqs:
            guard.finish(r.slot, reason, detail)

    def _stage(
        self, reqs: list[WriteReq], guard: PageGuard, scratch: Scratch | None
    ) -> _Staged | None:
        """Write ``reqs`` (one page, or a segment) to a fresh temp file, not yet synced (an
        ``O_DIRECT`` segment is synced already); on failure, report its pages and return None."""
        faults = [self.fault("write", r.key) for r in reqs]
        try:
            for f in faults:
                pre_fault(f, "write")
            if len(reqs) == 1:
                parts = _faulted_parts(reqs[0], faults[0], self.mac)
                directory, stem = os.path.dirname(self.path(reqs[0].key)), reqs[0].name
            else:
                parts = self._segment_parts(reqs, faults)
                directory, stem = os.path.dirname(self.path(reqs[0].key)), "seg"
            enospc = any(f is not None and f.kind is FaultKind.ENOSPC for f in faults)
            if len(reqs) > 1 and self.direct and scratch is not None:
                tmp = self._write_direct(directory, parts, enospc, scratch)
                if tmp is not None:
                    return _Staged(reqs, tmp, -1)
            tmp, fd = self._create_tmp(directory, stem)
            try:
                self._write_file(fd, parts, enospc)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            return _Staged(reqs, tmp, fd)
        except OSError as exc:
            self._fail(reqs, exc, guard)
            return None

    def _segment_parts(self, reqs: list[WriteReq], faults: list[Fault | None]) -> list[memoryview]:
        table, _entries = encode_table(
            [name_hash(r.name) for r in reqs], [r.payload.nbytes for r in reqs]
        )
        parts: list[memoryview] = [memoryview(table)]
        for r, f in zip(reqs, faults, strict=True):
            if f is not None and f.kind is FaultKind.PARTIAL_WRITE:
                # a torn write: this page is cut short, nothing after it reached the disk
                page = _faulted_parts(r, None, self.mac)
                size = sum(p.nbytes for p in page)
                parts += _cut(page, HEADER_SIZE + int((size - HEADER_SIZE) * f.position))
                break
            parts += _faulted_parts(r, f, self.mac)
        return parts

    def _publish(self, st: _Staged, guard: PageGuard) -> None:
        """Publish a durable temp file under its page names (the temp name is then gone).

        Each name is published inside a :meth:`PageGuard.enter` section, so a call that is
        cancelled publishes nothing after its cancel returned, and the caller learns of every
        name that was published (it indexes them, cancelled or not)."""
        tmp = st.tmp
        assert tmp is not None
        if len(st.reqs) == 1:
            req = st.reqs[0]
            if not guard.enter():
                return
            outcome, detail = OK, None
            try:
                os.replace(tmp, self.path(req.key))
                st.tmp = None
            except OSError as exc:
                outcome, detail = os_error_reason(exc), str(exc)
            finally:
                guard.leave(req.slot, outcome, detail)
            return
        for i, r in enumerate(st.reqs):
            if not self.links_ok:
                self.write_single(r, guard)
                continue
            if not guard.enter():
                return
            slot: int | None = r.slot
            outcome, detail = OK, None
            try:
                self._link(tmp, self.path(r.key))
            except OSError as exc:
                if exc.errno in _NO_LINKS and i == 0:
                    self.links_ok = False
                    slot = None  # written on its own below
                else:
                    outcome, detail = os_error_reason(exc), str(exc)
            finally:
                guard.leave(slot, outcome, detail)
            if slot is None:
                self.write_single(r, guard)

    @staticmethod
    def _link(src: str, dst: str) -> None:
        """Publish ``src`` as ``dst``; an existing ``dst`` is replaced atomically."""
        try:
            os.link(src, dst)
            return
        except FileNotFoundError:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
        except FileExistsError:
            pass  # another writer's copy (or a stale one): replace it like os.replace would
        else:
            return
        try:
            os.link(src, dst)
            return
        except FileExistsError:
            pass
        side = f"{src[:-4]}.{secrets.token_hex(4)}.tmp"  # (same writer id) swept if we crash
        os.link(src, side)
        try:
            os.replace(side, dst)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(side)
            raise

    # -- reads ----------------------------------------------------------------------------------

    def read_run(
        self, reqs: list[ReadReq], in_segment: bool, guard: PageGuard, scratch: Scratch
    ) -> None:
        """Read ``reqs``: the first by its own name; the following ones from the same open
        file, in file order, page by page, when it is a segment holding them right after the
        first; any left over are read the same way, starting from their own names."""
        while reqs and not guard.cancelled:
            done = self._read_from(reqs, in_segment, guard, scratch)
            reqs = reqs[done:]

    def _read_from(
        self, reqs: list[ReadReq], in_segment: bool, guard: PageGuard, scratch: Scratch
    ) -> int:
        first = reqs[0]
        path = self.path(first.key)
        fault = self.fault("read", first.key)
        direct = in_segment and self.direct
        try:
            pre_fault(fault, "read")
            fd = os.open(path, os.O_RDONLY | O_CLOEXEC | (O_DIRECT if direct else 0))
        except FileNotFoundError:
            guard.finish(first.slot, MISS)
            return 1
        except OSError as exc:
            guard.finish(first.slot, os_error_reason(exc), str(exc))
            return 1
        ino = -1
        try:
            st = os.fstat(fd)
            ino = st.st_ino
            if not stat.S_ISREG(st.st_mode):  # a FIFO, a device, a directory: never a page
                raise CorruptPageError("corrupt", f"object {first.name}: not a regular file")
            want = HEADER_SIZE + first.target.nbytes
            # A page known to live in a segment: read the table first, not page 0's bytes.
            if direct:
                head = scratch.aligned(HEAD_READ)
                got = pread_direct(fd, head, 0)
            else:
                head = scratch.view(HEAD_READ if in_segment else want)
                got = pread_full(fd, head)
            if got >= 4 and is_segment(head):
                if got < HEAD_READ < st.st_size:  # read as a single page: fetch the table
                    head = scratch.view(HEAD_READ)
                    got = pread_full(fd, head)
                table = parse_table(head[:got], first.name)
                run = _run_of(reqs, table)
                if not run:
                    raise CorruptPageError("corrupt", f"segment {first.name}: page not in table")
                # Every page's name links this file while it has as many links as pages
                # (the usual case: no stat); otherwise each later page's own name is checked.
                vouched = st.st_nlink >= len(table)
                return self._read_segment_run(
                    fd, st, reqs[: len(run)], run, fault, direct, guard, scratch, vouched
                )
            if in_segment and got < min(want, st.st_size):  # read only a head: read the page
                if direct:  # not a segment after all: read it the plain way
                    plain = os.open(path, os.O_RDONLY | O_CLOEXEC)
                    os.close(fd)
                    fd = plain
                    st = os.fstat(fd)
                    ino = st.st_ino
                head = scratch.view(want)
                got = pread_full(fd, head)
            self._check_and_copy(first, head, got, st.st_size, fault, guard)
            self._touch(fd, st)
            return 1
        except CorruptPageError as exc:
            first.bad = ino
            guard.finish(first.slot, "partial" if exc.reason == "partial" else "corrupt", str(exc))
            return 1
        except OSError as exc:
            guard.finish(first.slot, os_error_reason(exc), str(exc))
            return 1
        finally:
            os.close(fd)

    def _read_segment_run(
        self,
        fd: int,
        st: os.stat_result,
        reqs: list[ReadReq],
        run: list[Entry],
        first_fault: Fault | None,
        direct: bool,
        guard: PageGuard,
        scratch: Scratch,
        vouched: bool = True,
    ) -> int:
        for j, (req, entry) in enumerate(zip(reqs, run, strict=True)):
            # the first page's fault was decided (and its pre-fault applied) on opening
            fault = self.fault("read", req.key) if j else first_fault
            if j and not vouched and not _links(self.path(req.key), st):
                self._touch(fd, st)
                return j  # its name is gone or names another file: read it by its name
            if entry.length != HEADER_SIZE + req.target.nbytes:
                guard.finish(
                    req.slot,
                    "size_mismatch",
                    f"object has {entry.length - HEADER_SIZE} payload bytes, "
                    f"buffer {req.target.nbytes}",
                )
                continue
            try:
                if j:
                    pre_fault(fault, "read")
                page, avail = _read_entry(fd, entry, direct, scratch)
                self._check_and_copy(req, page, avail, entry.length, fault, guard)
            except CorruptPageError as exc:
                req.bad = st.st_ino
                reason = "partial" if exc.reason == "partial" else "corrupt"
                guard.finish(req.slot, reason, str(exc))
            except OSError as exc:
                guard.finish(req.slot, os_error_reason(exc), str(exc))
        self._touch(fd, st)
        return len(reqs)

    def _check_and_copy(
        self,
        req: ReadReq,
        buf: memoryview,
        got: int,
        stored: int,
        fault: Fault | None,
        guard: PageGuard,
    ) -> None:
        """Verify one page read into ``buf`` (``got`` bytes of an object of ``stored`` bytes)
        and copy its payload into the caller's buffer; raises CorruptPageError."""
        want = HEADER_SIZE + req.target.nbytes
        if fault is not None and fault.kind is FaultKind.SHORT_READ:
            got = int(got * fault.position)
        elif fault is not None and fault.kind is FaultKind.FLIP_BYTES:
            flip_byte(buf[:got], fault.position)
        info = parse_header(buf[:got], req.name, self.mac)
        if info.payload_len != req.target.nbytes and stored == HEADER_SIZE + info.payload_len:
            guard.finish(
                req.slot,
                "size_mismatch",
                f"object has {info.payload_len} payload bytes, buffer {req.target.nbytes}",
            )
            return
        if stored != want or got < want:
            raise CorruptPageError(
                "partial",
                f"object {req.name}: {stored} bytes stored, {got} read, expected {want}",
            )
        verify_payload(info, buf[HEADER_SIZE:want], req.name, self.mac)
        if guard.enter():
            copied = False
            try:
                copy_into(req.target, buf[HEADER_SIZE:want])
                copied = True
            finally:
                guard.leave(req.slot, OK if copied else "internal")

    @staticmethod
    def _touch(fd: int, st: os.stat_result) -> None:
        if time.time() - st.st_mtime > TOUCH_AFTER_S:
            with contextlib.suppress(OSError):
                os.utime(fd)  # recency survives a restart (coarsely: no inode churn)


def _read_entry(fd: int, entry: Entry, direct: bool, scratch: Scratch) -> tuple[memoryview, int]:
    """Read one page of a segment into ``scratch``: its bytes, and how many of them arrived.
    Page by page, each checked and copied out before the next is read: the scratch stays one
    page (and warm in the CPU's caches)."""
    if not direct:
        page = scratch.view(entry.length)
        return page, pread_full(fd, page, entry.offset)
    lo = entry.offset // BLOCK * BLOCK  # the block-aligned range around the page
    end = entry.offset + entry.length
    buf = scratch.aligned(-(-end // BLOCK) * BLOCK - lo)
    at = entry.offset - lo
    got = pread_direct(fd, buf, lo) - at
    return buf[at : at + entry.length], max(0, min(entry.length, got))


def _links(path: str, st: os.stat_result) -> bool:
    """Whether ``path`` names the file ``st`` describes."""
    try:
        own = os.stat(path)
    except OSError:
        return False
    return own.st_ino == st.st_ino and own.st_dev == st.st_dev


def _run_of(reqs: list[ReadReq], table: dict[int, Entry]) -> list[Entry]:
    """Entries of the leading ``reqs`` that lie back to back in the segment."""
    run: list[Entry] = []
    for req in reqs:
        entry = table.get(name_hash(req.name))
        if entry is None or (run and entry.offset != run[-1].offset + run[-1].length):
            break
        run.append(entry)
    return run


def _faulted_parts(req: WriteReq, fault: Fault | None, mac: PageMac | None) -> list[memoryview]:
    """Header + payload of a page (a :class:`Pieces` payload: its pieces, written in place by
    one ``pwritev``), with a write fault's damage applied (flip / cut)."""
    header = memoryview(encode_header(req.name, req.payload, mac))
    payload = req.payload.parts if isinstance(req.payload, Pieces) else [req.payload]
    if fault is not None and fault.kind is FaultKind.FLIP_BYTES:
        flipped = bytearray(b"".join(payload))
        flip_byte(flipped, fault.position)
        return [header, memoryview(flipped)]
    if fault is not None and fault.kind is FaultKind.PARTIAL_WRITE:
        return [header, *_cut(payload, int(req.payload.nbytes * fault.position))]
    return [header, *payload]


def _cut(parts: list[memoryview], nbytes: int) -> list[memoryview]:
    """The first ``nbytes`` of ``parts``."""
    out: list[memoryview] = []
    for p in parts:
        if nbytes <= 0:
            break
        out.append(p[:nbytes])
        nbytes -= p.nbytes
    return out
