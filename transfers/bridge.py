"""LoopBridge: completes asyncio futures of one event loop from worker threads, in batches.

A worker thread never touches a future directly. It posts ``(future, result, error)``
completions; the bridge queues them and rings the loop's doorbell with one
``call_soon_threadsafe`` -- only if no drain is already scheduled. Everything posted before the
loop gets round to the drain rides the same wake-up, so a burst of completions costs one
thread hop, and completions are delivered in the order they were posted.

``close()`` fails every future still pending with :class:`ClosedError`; completions posted after
that are dropped. Works wherever ``asyncio.get_running_loop()`` does, including anyio's asyncio
backend (not trio: the bridge needs an asyncio loop).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future as ConcurrentFuture
from typing import Any

from asynccache.errors import ClosedError, OwnerError
from asynccache.logs import get_logger

_log = get_logger("asynccache.transfers.bridge")

# (future, result, error); a ``None`` future means ``result`` is a callable to run on the loop.
Completion = tuple["asyncio.Future[Any] | None", Any, BaseException | None]


class LoopBridge:
    """Batched thread -> loop completion of futures owned by one running event loop."""

    __slots__ = (
        "_closed",
        "_delivered",
        "_hops",
        "_lock",
        "_loop",
        "_pending",
        "_queue",
        "_scheduled",
        "_thread_id",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                raise OwnerError(
                    "LoopBridge must be created inside a running asyncio event loop "
                    "(anyio users: the asyncio backend)"
                ) from None
        self._loop = loop
        self._thread_id = threading.get_ident()
        self._lock = threading.Lock()
        self._queue: list[Completion] = []
        self._scheduled = False
        self._closed = False
        self._pending: set[asyncio.Future[Any]] = set()
        self._hops = 0
        self._delivered = 0

    # ------------------------------------------------------------------ loop side
    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pending_count(self) -> int:
        """Futures created by this bridge and not completed yet."""
        return len(self._pending)

    @property
    def hops(self) -> int:
        """Thread -> loop wake-ups so far (one per delivered batch)."""
        return self._hops

    @property
    def delivered(self) -> int:
        """Futures completed so far (posts to futures already done are not counted)."""
        return self._delivered

    def create_future(self) -> asyncio.Future[Any]:
        """A future on the bridge's loop that a worker thread may complete. Loop thread only."""
        if self._closed:
            raise ClosedError("LoopBridge is closed")
        fut = self._loop.create_future()
        self._pending.add(fut)
        return fut

    def close(self, error: BaseException | None = None) -> None:
        """Fail every pending future (with ``error`` or :class:`ClosedError`). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.clear()
        pending, self._pending = self._pending, set()
        for fut in pending:
            if not fut.done():
                fut.set_exception(error if error is not None else ClosedError("LoopBridge closed"))
                # Nobody may be awaiting: mark the exception retrieved to avoid loop noise.
                fut.exception()
        if pending:
            _log.debug("bridge_closed", failed=len(pending))

    # ------------------------------------------------------------------ any thread
    def set_result(self, fut: asyncio.Future[Any], result: Any = None) -> None:
        """Complete ``fut`` with ``result`` (thread-safe; batched with other completions)."""
        self._post(((fut, result, None),))

    def set_exception(self, fut: asyncio.Future[Any], error: BaseException) -> None:
        """Fail ``fut`` with ``error`` (thread-safe; batched with other completions)."""
        self._post(((fut, None, error),))

    def complete_many(self, completions: Iterable[Completion]) -> None:
        """Post many ``(future, result, error)`` completions with at most one thread hop."""
        self._post(completions)

    def call_soon(self, callback: Callable[[], Any]) -> None:
        """Run ``callback()`` on the loop, in order with the completions (thread-safe)."""
        self._post(((None, callback, None),))

    def wrap_future(self, cfut: ConcurrentFuture[Any]) -> asyncio.Future[Any]:
        """An awaitable on the loop for a ``concurrent.futures.Future``. Loop thread only."""
        fut = self.create_future()

        def _done(cf: ConcurrentFuture[Any]) -> None:
            if cf.cancelled():
                self.set_exception(fut, asyncio.CancelledError())
            elif (exc := cf.exception()) is not None:
                self.set_exception(fut, exc)
            else:
                self.set_result(fut, cf.result())

        cfut.add_done_callback(_done)
        return fut

    def _post(self, items: Iterable[Completion]) -> None:
        with self._lock:
            if self._closed:
                return
            self._queue.extend(items)
            if self._scheduled or not self._queue:
                return
            self._scheduled = True
        if threading.get_ident() == self._thread_id:
            self._loop.call_soon(self._drain)
            return
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody can await these any more
            with self._lock:
                self._scheduled = False
                self._queue.clear()
            _log.warning("bridge_loop_closed", note="completions dropped")

    def _drain(self) -> None:
        with self._lock:
            batch, self._queue = self._queue, []
            self._scheduled = False
        self._hops += 1
        pending = self._pending
        delivered = 0
        for fut, result, error in batch:
            if fut is None:
                try:
                    result()
                except Exception:
                    _log.exception("bridge_callback_failed")
                continue
            pending.discard(fut)
            if fut.done():  # cancelled by an awaiter, or completed already
                continue
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)
            delivered += 1
        self._delivered += delivered
