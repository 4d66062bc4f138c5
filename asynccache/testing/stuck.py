"""``stuck_pages(backend, keys)``: pages whose reads hang, like files on a dead NFS server.

A FIFO (named pipe) is put under each page's file name. Opening a FIFO for reading blocks in
the kernel until a writer opens it: a real syscall that no thread can interrupt, which is what a
read from a dead NFS server looks like to the process. The backend must abandon that read at its
deadline, quarantine the page, keep healthy pages readable and let the process exit.

:meth:`StuckPages.release` (or leaving the ``with`` block) wakes every reader still blocked
and removes the FIFOs: each reader then finds a FIFO, not a page (a corrupt object, removed),
and its thread is free again. Each FIFO also has a hidden second name (a hard link) in the same
directory, so a release still reaches the readers after the page has been written again over
the FIFO's name.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

__all__ = ["StuckPages", "stuck_pages"]


def _file_backend(backend: Any) -> Any:
    """The FileBackend under ``backend`` (fault wrappers have ``inner``)."""
    b = backend
    while not callable(getattr(b, "path", None)) and hasattr(b, "inner"):
        b = b.inner
    if not callable(getattr(b, "path", None)):
        raise TypeError(
            f"stuck_pages needs a FileBackend (or a wrapper of one), got {type(backend).__name__}"
        )
    return b


class StuckPages:
    """FIFOs at the file names of some pages; see the module docstring."""

    def __init__(self, backend: Any, keys: Sequence[str]) -> None:
        files = _file_backend(backend)
        self.keys = list(dict.fromkeys(keys))
        self.paths = [files.path(k) for k in self.keys]
        self._fifos: list[tuple[str, str, int]] = []  # (page name, side name, inode)
        try:
            for path in self.paths:
                directory = os.path.dirname(path)
                os.makedirs(directory, exist_ok=True)
                side = os.path.join(directory, f".stuck-{secrets.token_hex(6)}.fifo")
                os.mkfifo(side)
                ino = os.stat(side).st_ino
                self._fifos.append((path, side, ino))
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                os.link(side, path)
        except BaseException:
            self.release()
            raise

    def release(self, settle_s: float = 0.1) -> int:
        """Wake every reader blocked on the FIFOs and remove them; returns how many of the
        FIFOs had readers blocked on them. Idempotent."""
        fifos, self._fifos = self._fifos, []
        for path, _side, ino in fifos:  # first: no new reader can find a FIFO by its name
            with contextlib.suppress(OSError):
                if os.stat(path).st_ino == ino:
                    os.unlink(path)
        woken = 0
        for _path, side, _ino in fifos:
            readers = False
            quiet_since = time.monotonic()
            while time.monotonic() - quiet_since < settle_s:
                try:
                    fd = os.open(side, os.O_WRONLY | os.O_NONBLOCK)
                except OSError as exc:
                    if exc.errno != errno.ENXIO:  # ENXIO: no reader waiting right now
                        break
                    time.sleep(0.005)
                    continue
                os.close(fd)  # every reader blocked in open() wakes up and sees a FIFO
                readers = True
                quiet_since = time.monotonic()
            woken += readers
            with contextlib.suppress(OSError):
                os.unlink(side)
        return woken

    def __enter__(self) -> StuckPages:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def stuck_pages(backend: Any, keys: Sequence[str]) -> StuckPages:
    """Make reads of pages ``keys`` of a ``FileBackend`` (or a ``faults(...)`` wrapper of one)
    hang until :meth:`StuckPages.release`; use it as a context manager::

        with stuck_pages(asynccache_file_storage, keys[3:4]) as stuck:
            ...  # reads of keys[3] hang until the deadline, then are quarantined misses
    """
    return StuckPages(backend, keys)
