"""Run a batch of blocking per-page I/O on a few worker threads, safely abandonable.

One call = one :class:`PageGuard` and at most ``threads`` worker threads, each pulling page
indices in order, so leading pages (the ones a prefix needs) finish first. The loop thread
pays one thread hop per worker, not one per page. The threads are daemons from a
:class:`~asynccache.storage.daemonpool.DaemonPool` (not anyio's worker threads, which are joined
at interpreter exit: a thread stuck in a syscall would keep the process alive forever).

A call that times out or is cancelled abandons its threads (a thread stuck in a syscall on a
dead NFS server cannot be interrupted). The guard makes that safe for the caller's buffers:

* a worker touches caller memory only between :meth:`PageGuard.enter` and
  :meth:`PageGuard.leave`, and ``enter`` fails once the call is cancelled;
* :meth:`PageGuard.cancel` (run by the loop when the call ends, however it ends) sets the flag
  and waits for the workers inside such a section to leave it. Sections only copy memory
  (no I/O), so the wait is bounded by a memcpy;
* writers publish each name inside an ``enter``/``leave`` section (after the data is on
  storage; the caller's buffer is no longer read then): once the call is over nothing more
  is published, and every name that was is in the call's outcomes (``run(report=...)``),
  also when the caller cancelled it.

Abandoned threads still running are counted; while ``max_stuck`` or more are stuck, calls fail
fast with the ``unavailable`` reason instead of piling up more threads. An abandoned thread no
longer counts against ``threads``: healthy calls get fresh threads meanwhile. ``on_stuck``
tells the caller which jobs a call abandoned while still running (the file backend
quarantines their pages) and takes a function to call when each finally ends.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

from asynccache.logs import get_logger
from asynccache.storage.daemonpool import DaemonPool, loop_caller

__all__ = ["PageGuard", "Scratch", "ThreadRunner"]

T = TypeVar("T")

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
        self._active: set[int] = set()  # jobs claimed and not finished
        self._release: dict[int, Callable[[], None]] = {}
        self.stuck_jobs: list[int] = []  # jobs still running when the call ended
        self.cancelled = False

    # -- worker side ----------------------------------------------------------------------------

    def claim(self) -> int | None:
        with self._lock:
            if self.cancelled or self._next >= self.n:
                return None
            i = self._next
            self._next += 1
            self._active.add(i)
            return i

    def job_done(self, i: int) -> None:
        """Job ``i`` has returned; runs the release registered for it if it was abandoned."""
        with self._lock:
            self._active.discard(i)
            release = self._release.pop(i, None)
        if release is not None:
            release()

    def enter(self) -> bool:
        """Begin touching caller memory; False once the call is over."""
        with self._lock:
            if self.cancelled:
                return False
            self._touching += 1
            return True

    def leave(self, i: int | None, outcome: str = "ok", detail: str | None = None) -> None:
        """End the section begun by a successful :meth:`enter`, recording page ``i`` (nothing
        with None). Writers publish inside such a section: once :meth:`cancel` has returned,
        no page of the call gets published, and every publish that did is in its outcomes."""
        with self._lock:
            if i is not None:
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
                self.stuck_jobs = sorted(self._active)
            if self._touching and not self._idle.wait_for(lambda: self._touching == 0, wait_s):
                # Unreachable unless the process is starved for seconds inside a memcpy.
                _log.error("storage_guard_wait_expired", touching=self._touching)
            return list(self.outcomes), list(self.details)

    def when_finished(self, i: int, release: Callable[[], None]) -> None:
        """Call ``release()`` (from the worker thread) when abandoned job ``i`` returns; at
        once if it already has."""
        with self._lock:
            if i in self._active:
                self._release[i] = release
                return
        release()


class ThreadRunner:
    """Runs page batches on at most ``threads`` worker threads at a time (plus the abandoned
    ones still stuck, at most ``max_stuck``)."""

    def __init__(self, threads: int, max_stuck: int, pool: DaemonPool | None = None) -> None:
        self.threads = threads
        self.max_stuck = max_stuck
        self.pool = pool if pool is not None else DaemonPool()
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
                    guard.job_done(i)
        finally:
            self._give_scratch(scratch)
            guard.worker_done()

    async def run(
        self,
        n: int,
        fn: Callable[[int, PageGuard, Scratch], None],
        timeout_s: float,
        slots: int | None = None,
        on_stuck: Callable[[int, list[str]], Callable[[], None] | None] | None = None,
        report: list[str | None] | None = None,
    ) -> tuple[list[str], list[str | None]]:
        """Run ``fn(i, guard, scratch)`` for i in range(n); return (outcomes, details).

        There is one outcome per job, or ``slots`` outcomes when a job reports for several
        pages (``guard.finish(slot, ...)``). Slots that did not finish in time get the
        ``timeout`` outcome; when too many threads are stuck, nothing starts: ``unavailable``.
        ``on_stuck(i, outcomes)`` runs on the loop for each job still running when the
        deadline ends the call (not when the caller cancels it; ``outcomes``: what this call
        returns); the function it returns (if any) runs on the worker thread when that job
        returns. ``report`` (a list) receives the raw outcomes (None: not done) however the
        call ends, also when the caller cancels it (what was published then still counts).
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
        call = loop_caller()

        async def one_worker() -> None:
            async with limiter:
                done = anyio.Event()

                def target() -> None:
                    try:
                        self._worker(guard, fn)
                    finally:
                        call(done.set)

                try:
                    self.pool.submit(target)
                except RuntimeError as exc:  # no thread can be started: pages time out
                    _log.error("storage_thread_start_failed", error=repr(exc))
                    return
                await done.wait()  # a cancel abandons the thread; the limiter is released

        timed_out = False
        try:
            with anyio.move_on_after(timeout_s) as scope:
                async with anyio.create_task_group() as tg:
                    for _ in range(min(self.threads, n)):
                        tg.start_soon(one_worker)
            timed_out = scope.cancelled_caught
        finally:
            raw, details = guard.cancel()
            if report is not None:
                report[:] = raw
            outcomes = [o if o is not None else "timeout" for o in raw]
            if on_stuck is not None and timed_out:  # not when the caller cancelled
                for i in guard.stuck_jobs:
                    release = on_stuck(i, outcomes)
                    if release is not None:
                        guard.when_finished(i, release)
        return outcomes, details

    async def call(self, fn: Callable[[], T], timeout_s: float) -> T:
        """Run one blocking ``fn()`` on a worker thread: its result, or its exception;
        TimeoutError when it did not return in time (the thread is abandoned) or could not
        start (too many stuck threads)."""
        box: list[Any] = []

        def job(i: int, guard: PageGuard, _scratch: Scratch) -> None:
            try:
                box.append((True, fn()))
            except Exception as exc:
                box.append((False, exc))
            guard.finish(i, "ok")

        outcomes, details = await self.run(1, job, timeout_s)
        if outcomes[0] != "ok" or not box:
            raise TimeoutError(f"{outcomes[0]}: {details[0] or f'not done in {timeout_s} s'}")
        done, value = box[0]
        if not done:
            raise value
        return value  # type: ignore[no-any-return]
