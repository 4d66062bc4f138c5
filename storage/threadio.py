"""Run a batch of blocking per-page I/O on a few worker threads, safely abandonable.

One call = one :class:`PageGuard` and at most ``threads`` worker threads (anyio's
``to_thread``), each pulling page indices in order, so leading pages (the ones a prefix needs)
finish first. The loop thread pays one thread hop per worker, not one per page.

A call that times out or is cancelled abandons its threads (a thread stuck in a syscall on a
dead NFS server cannot be interrupted). The guard makes that safe for the caller's buffers:

* a worker touches caller memory only between :meth:`PageGuard.enter` and
  :meth:`PageGuard.leave`, and ``enter`` fails once the call is cancelled;
* :meth:`PageGuard.cancel` (run by the loop when the call ends, however it ends) sets the flag
  and waits for the workers inside such a section to leave it. Sections only copy memory
  (no I/O), so the wait is bounded by a memcpy;
* writers check :meth:`PageGuard.may_publish` after the data is on storage and before
  publishing it; the caller's buffer is no longer read at that point.

Abandoned threads still running are counted; while ``max_stuck`` or more are stuck, calls fail
fast with the ``unavailable`` reason instead of piling up more threads.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable
from functools import partial

import anyio
import anyio.to_thread

from asynccache.logs import get_logger

__all__ = ["PageGuard", "Scratch", "ThreadRunner"]

_log = get_logger("asynccache.storage.threadio")


class Scratch:
    """A worker's reusable bounce buffers: plain, and page-aligned (for ``O_DIRECT``)."""

    __slots__ = ("buf", "mem")

    def __init__(self) -> None:
        self.buf = bytearray()
        self.mem: mmap.mmap | None = None

    def view(self, n: int) -> memoryview:
        if len(self.buf) < n:
            self.buf = bytearray(n)
        return memoryview(self.buf)[:n]

    def aligned(self, n: int) -> memoryview:
        """``n`` bytes starting on a page boundary (anonymous memory map)."""
        if self.mem is None or len(self.mem) < n:
            self.mem = mmap.mmap(-1, max(n, mmap.PAGESIZE))  # views of the old one keep it
        return memoryview(self.mem)[:n]


class PageGuard:
    """Per-call state shared by the loop and the worker threads."""

    def __init__(self, n: int, runner: ThreadRunner, slots: int | None = None) -> None:
        self.n = n  # jobs, claimed in order
        size = n if slots is None else slots  # outcomes: one per job, or per page of a job
        self.outcomes: list[str | None] = [None] * size
        self.details: list[str | None] = [None] * size
        self._runner = runner
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._next = 0
        self._touching = 0
        self._workers = 0
        self.cancelled = False

    # -- worker side ----------------------------------------------------------------------------

    def claim(self) -> int | None:
        with self._lock:
            if self.cancelled or self._next >= self.n:
                return None
            i = self._next
            self._next += 1
            return i

    def enter(self) -> bool:
        """Begin touching caller memory; False once the call is over."""
        with self._lock:
            if self.cancelled:
                return False
            self._touching += 1
            return True

    def leave(self, i: int, outcome: str, detail: str | None = None) -> None:
        """End the section begun by a successful :meth:`enter`, recording page ``i``."""
        with self._lock:
            self.outcomes[i] = outcome
            self.details[i] = detail
            self._touching -= 1
            if self._touching == 0:
                self._idle.notify_all()

    def may_publish(self) -> bool:
        with self._lock:
            return not self.cancelled

    def finish(self, i: int, outcome: str, detail: str | None = None) -> None:
        """Record page ``i`` (ignored once the call is over)."""
        with self._lock:
            if not self.cancelled:
                self.outcomes[i] = outcome
                self.details[i] = detail

    def worker_started(self) -> bool:
        with self._lock:
            if self.cancelled:
                return False
            self._workers += 1
            return True

    def worker_done(self) -> None:
        with self._lock:
            self._workers -= 1
            if self.cancelled:
                self._runner._stuck_delta(-1)

    # -- loop side ------------------------------------------------------------------------------

    def cancel(self, wait_s: float = 5.0) -> tuple[list[str | None], list[str | None]]:
        """End the call: no worker touches caller memory after this returns."""
        with self._lock:
            if not self.cancelled:
                self.cancelled = True
                self._runner._stuck_delta(self._workers)
            if self._touching and not self._idle.wait_for(lambda: self._touching == 0, wait_s):
                # Unreachable unless the process is starved for seconds inside a memcpy.
                _log.error("storage_guard_wait_expired", touching=self._touching)
            return list(self.outcomes), list(self.details)


class ThreadRunner:
    """Runs page batches on at most ``threads`` worker threads."""

    def __init__(self, threads: int, max_stuck: int) -> None:
        self.threads = threads
        self.max_stuck = max_stuck
        self._lock = threading.Lock()
        self._stuck = 0
        self._scratch: list[Scratch] = []
        self._limiter: anyio.CapacityLimiter | None = None

    @property
    def stuck(self) -> int:
        """Abandoned worker threads still running."""
        with self._lock:
            return self._stuck

    def _stuck_delta(self, d: int) -> None:
        with self._lock:
            self._stuck += d

    def _take_scratch(self) -> Scratch:
        with self._lock:
            return self._scratch.pop() if self._scratch else Scratch()

    def _give_scratch(self, s: Scratch) -> None:
        with self._lock:
            if len(self._scratch) < self.threads:
                self._scratch.append(s)

    def _worker(self, guard: PageGuard, fn: Callable[[int, PageGuard, Scratch], None]) -> None:
        if not guard.worker_started():
            return
        scratch = self._take_scratch()
        try:
            while (i := guard.claim()) is not None:
                try:
                    fn(i, guard, scratch)
                except Exception as exc:  # a bug: keep the engine alive, count it, log it
                    _log.exception("storage_worker_error", page=i, error=repr(exc))
                    guard.finish(i, "internal", repr(exc))
        finally:
            self._give_scratch(scratch)
            guard.worker_done()

    async def run(
        self,
        n: int,
        fn: Callable[[int, PageGuard, Scratch], None],
        timeout_s: float,
        slots: int | None = None,
    ) -> tuple[list[str], list[str | None]]:
        """Run ``fn(i, guard, scratch)`` for i in range(n); return (outcomes, details).

        There is one outcome per job, or ``slots`` outcomes when a job reports for several
        pages (``guard.finish(slot, ...)``). Slots that did not finish in time get the
        ``timeout`` outcome; when too many threads are stuck, nothing starts: ``unavailable``.
        """
        size = n if slots is None else slots
        if n == 0:
            return ["timeout"] * size, [None] * size
        if self.stuck >= self.max_stuck:
            return ["unavailable"] * size, ["too many stuck storage threads"] * size
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.threads)
        guard = PageGuard(n, self, slots)
        limiter = self._limiter
        work = partial(self._worker, guard, fn)
        try:
            with anyio.move_on_after(timeout_s):
                async with anyio.create_task_group() as tg:
                    for _ in range(min(self.threads, n)):
                        tg.start_soon(
                            partial(
                                anyio.to_thread.run_sync,
                                work,
                                abandon_on_cancel=True,
                                limiter=limiter,
                            )
                        )
        finally:
            outcomes, details = guard.cancel()
        return [o if o is not None else "timeout" for o in outcomes], details
