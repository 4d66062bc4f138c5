"""What is in a FileBackend directory: page objects, temp files, and the writers that own them.

:func:`scan` lists this layout's objects (for the index) and sorts the temp files it meets;
:func:`recheck` looks again at the temp files it could not remove.

A page (or a segment) is written to a hidden temp file and then published under its name. A
writer killed between the two (``kill -9``, a power loss) leaves the temp file behind. Every
backend instance is a *writer* with a random id: its temp files are named
``.<writer id>.<...>.tmp``, and while it lives it holds an exclusive ``fcntl.flock`` on
``<root>/.writers/<writer id>.lock``. The kernel drops the lock when the process dies however
it dies, so anyone who can take the lock knows the writer is gone and its temp files are
garbage. (On NFS, Linux maps ``flock`` onto NFS byte-range locks, so this holds across hosts
that share the directory.)

The lock file is created under a temporary name, locked, and only then renamed into place, so
nobody ever finds a writer's lock file unlocked while that writer lives. Temp files with no
writer id (written before writer ids, or where ``flock`` is not supported) keep the old rule:
removed when over an hour old.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import time
from typing import NamedTuple

from asynccache.logs import get_logger

__all__ = [
    "LEGACY_STALE_S",
    "WRITERS_DIR",
    "DirState",
    "Liveness",
    "TempFile",
    "WriterLock",
    "recheck",
    "scan",
    "writer_of",
]

_log = get_logger("asynccache.storage.file")

WRITERS_DIR = ".writers"
#: Temp files without a writer id are removed when older than this.
LEGACY_STALE_S = 3600.0
_SUBDIR_RE = re.compile(r"[0-9a-f]{2}")
_KEY_RE = re.compile(r"[0-9a-f]{64}(?:\.[a-z0-9_-]{1,32})?")
_TMP_RE = re.compile(r"\.(w[0-9a-f]{16})\.")
_LOCK_RE = re.compile(r"\.?(w[0-9a-f]{16})\.lock(?:\.tmp)?")
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def writer_of(name: str) -> str | None:
    """The writer id in a temp file's name, or None (a name from before writer ids)."""
    m = _TMP_RE.match(name)
    return m.group(1) if m else None


def _lock_path(root: str, writer: str) -> str:
    return os.path.join(root, WRITERS_DIR, f"{writer}.lock")


class WriterLock:
    """This backend instance's writer id and the lock that says it is alive."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.id = "w" + secrets.token_hex(8)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> bool:
        """Create and lock the lock file (blocking I/O: a worker thread). False where the
        filesystem has no ``flock``: temp files then carry no writer id."""
        for _ in range(3):
            try:
                return self._acquire()
            except FileNotFoundError:  # a sweep took our half-made lock file: a new id
                self.id = "w" + secrets.token_hex(8)
        return self._acquire()

    def _acquire(self) -> bool:
        directory = os.path.join(self.root, WRITERS_DIR)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{self.id}.lock.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(tmp, _lock_path(self.root, self.id))
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                _log.warning("storage_writer_lock_unavailable", root=self.root, error=str(exc))
                return False
            raise
        self._fd = fd
        return True

    def release(self) -> None:
        """Remove the lock file, then drop the lock (blocking I/O)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(_lock_path(self.root, self.id))
        os.close(fd)


class Liveness:
    """Answers "is writer X alive?" under one root, removing dead writers' lock files.

    Answers are remembered for the life of the object (one scan or one check): a writer found
    dead stays dead; one found alive is asked again by the next ``Liveness``.
    """

    def __init__(self, root: str, own: str | None) -> None:
        self.root = root
        self.own = own
        self._known: dict[str, bool] = {}

    def alive(self, writer: str) -> bool:
        if writer == self.own:
            return True
        known = self._known.get(writer)
        if known is None:
            known = self._known[writer] = self._probe(_lock_path(self.root, writer))
        return known

    def _probe(self, path: str) -> bool:
        """Whether someone holds the lock of ``path``; a free lock file is removed."""
        try:
            fd = os.open(path, os.O_RDWR | O_CLOEXEC)
        except FileNotFoundError:
            return False  # removed by whoever found the writer dead first
        except OSError:
            return True  # cannot tell: assume alive, keep its files
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return True  # no flock here: cannot tell
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)  # while holding the lock: nobody can be using it
            return False
        finally:
            os.close(fd)

    def sweep_locks(self) -> None:
        """Remove the lock files of dead writers (also half-created ones)."""
        directory = os.path.join(self.root, WRITERS_DIR)
        try:
            names = os.listdir(directory)
        except OSError:
            return
        for name in names:
            m = _LOCK_RE.fullmatch(name)
            if m is None or m.group(1) == self.own:
                continue
            if name.endswith(".tmp"):  # a writer that died while creating its lock file
                self._probe(os.path.join(directory, name))
            else:
                self.alive(m.group(1))


class TempFile(NamedTuple):
    """A temp file left where it was: its writer may still publish or remove it."""

    size: int
    mtime: float
    writer: str | None


def _garbage(name: str, mtime: float, liveness: Liveness, now: float) -> bool:
    writer = writer_of(name)
    if writer is None:
        return now - mtime > LEGACY_STALE_S
    return not liveness.alive(writer)


def scan(
    root: str, suffix: str, liveness: Liveness
) -> tuple[list[tuple[int, str, int, int]], dict[str, TempFile]]:
    """Blocking. ``(mtime_ns, key, size, inode)`` of the objects whose names end with
    ``suffix``, and the temp files kept (path -> TempFile); removes the temp files no live
    writer can own, and dead writers' lock files. The scanning writer's own temp files
    (``liveness.own``: its writes in flight, a ``clear`` scanning during a ``set``) are
    neither kept nor removed."""
    os.makedirs(root, exist_ok=True)
    liveness.sweep_locks()
    now = time.time()
    out: list[tuple[int, str, int, int]] = []
    temps: dict[str, TempFile] = {}
    with os.scandir(root) as top:
        subdirs = [e.path for e in top if e.is_dir() and _SUBDIR_RE.fullmatch(e.name)]
    for sub in subdirs:
        with os.scandir(sub) as it:
            for e in it:
                name = e.name
                try:
                    if name.startswith("."):
                        if name.endswith(".tmp") and (
                            liveness.own is None or writer_of(name) != liveness.own
                        ):  # (the scanning writer's own: writes in flight, counted by it)
                            st = e.stat()
                            if _garbage(name, st.st_mtime, liveness, now):
                                os.unlink(e.path)
                            else:
                                temps[e.path] = TempFile(st.st_size, st.st_mtime, writer_of(name))
                        continue
                    if not name.endswith(suffix):
                        continue
                    key = name[: -len(suffix)]
                    if _KEY_RE.fullmatch(key) and key[:2] == os.path.basename(sub):
                        st = e.stat()
                        out.append((st.st_mtime_ns, key, st.st_size, st.st_ino))
                except FileNotFoundError:
                    continue
    return out, temps


def recheck(temps: dict[str, TempFile], liveness: Liveness) -> dict[str, TempFile]:
    """Blocking. The temp files of ``temps`` still there and still owned by a live writer
    (the others are removed)."""
    now = time.time()
    left: dict[str, TempFile] = {}
    for path, tf in temps.items():
        try:
            st = os.stat(path)
            if _garbage(os.path.basename(path), st.st_mtime, liveness, now):
                os.unlink(path)
            else:
                left[path] = TempFile(st.st_size, st.st_mtime, tf.writer)
        except FileNotFoundError:
            continue
        except OSError:
            left[path] = tf
    return left


class DirState:
    """One backend's view of its directory beyond the index: its writer lock, and the temp
    files of other writers it keeps counting. The blocking methods run on worker threads."""

    #: Seconds between looks at the temp files kept at start (while there are any).
    recheck_s = 60.0

    def __init__(self, root: str, suffix: str) -> None:
        self.root = root
        self.suffix = suffix
        self.lock = WriterLock(root)
        self.writer: str | None = None  # named in temp files once the lock is held
        self._lock_tried = False
        self.temps: dict[str, TempFile] = {}
        self.tmp_bytes = 0
        self._checked = time.monotonic()

    def liveness(self) -> Liveness:
        return Liveness(self.root, self.writer)

    def scan(self) -> list[tuple[int, str, int, int]]:
        """Blocking: take this writer's lock (the first time), then :func:`scan`; the temp files
        kept are counted from now on."""
        if not self._lock_tried:
            os.makedirs(self.root, exist_ok=True)
            self._lock_tried = True
            if self.lock.acquire():
                self.writer = self.lock.id
        entries, temps = scan(self.root, self.suffix, self.liveness())
        self._set(temps)
        return entries

    def due(self) -> bool:
        """Whether kept temp files are waiting for another look."""
        return bool(self.temps) and time.monotonic() >= self._checked + self.recheck_s

    def recheck(self) -> None:
        """Blocking: :func:`recheck` the temp files kept."""
        self._checked = time.monotonic()
        self._set(recheck(dict(self.temps), self.liveness()))

    def _set(self, temps: dict[str, TempFile]) -> None:
        self.temps = temps
        self.tmp_bytes = sum(t.size for t in temps.values())
