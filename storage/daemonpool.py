"""Daemon threads for blocking storage I/O, and waking the event loop from them.

anyio's worker threads (``anyio.to_thread``) are joined when the interpreter exits, so a thread
stuck in a syscall that never returns (opening a FIFO, reading a file on a dead NFS server)
keeps the process alive forever. The threads here are daemons: they are never joined, and one
blocked in the kernel at exit simply ends with the process.

:class:`DaemonPool` reuses idle threads and starts new ones on demand; how many run at once is
bounded by the caller (:class:`~asynccache.storage.threadio.ThreadRunner`), which also counts
the threads it abandoned. An idle thread exits after ``idle_s``.

:func:`loop_caller` returns a function that schedules a callback on the calling event loop's
thread from any thread, without blocking (asyncio: ``call_soon_threadsafe``; trio:
``TrioToken.run_sync_soon``), and ignores a loop that has already closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable

from asynccache.logs import get_logger

__all__ = ["DaemonPool", "loop_caller"]

_log = get_logger("asynccache.storage.threadio")

#: Name of every storage I/O thread (``threading.enumerate()`` shows them).
THREAD_NAME = "asynccache-storage-io"


class DaemonPool:
    """Run callables on daemon threads: an idle one if any, else a new one."""

    def __init__(self, name: str = THREAD_NAME, idle_s: float = 10.0) -> None:
        self.name = name
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0  # threads waiting for a job that no submitted job has claimed yet
        self._threads = 0

    @property
    def threads(self) -> int:
        """Threads alive (busy, stuck or idle)."""
        with self._lock:
            return self._threads

    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on a pool thread (``fn`` handles its own exceptions)."""
        with self._lock:
            if self._idle:
                self._idle -= 1
                self._jobs.put(fn)
                return
            self._threads += 1
        try:
            threading.Thread(target=self._run, args=(fn,), name=self.name, daemon=True).start()
        except BaseException:
            with self._lock:
                self._threads -= 1
            raise

    def _run(self, fn: Callable[[], None] | None) -> None:
        while fn is not None:
            try:
                fn()
            except BaseException as exc:  # fn catches its own; this is a last resort
                _log.error("storage_thread_error", error=repr(exc))
            fn = None
            with self._lock:
                self._idle += 1
            while fn is None:
                try:
                    fn = self._jobs.get(timeout=self.idle_s)
                except queue.Empty:
                    with self._lock:
                        if self._idle:  # nobody claimed this thread: leave
                            self._idle -= 1
                            self._threads -= 1
                            return
                    # a job was handed to the idle threads just now: one is for this thread


def loop_caller() -> Callable[[Callable[[], None]], None]:
    """``call(fn)``: run ``fn`` on the current event loop's thread soon, from any thread.

    Never blocks; once the loop has closed, ``fn`` is dropped.
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    if loop is not None:
        running = loop

        def call_asyncio(fn: Callable[[], None]) -> None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                running.call_soon_threadsafe(fn)

        return call_asyncio
    import trio  # anyio's other backend

    token = trio.lowlevel.current_trio_token()

    def call_trio(fn: Callable[[], None]) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(fn)

    return call_trio
