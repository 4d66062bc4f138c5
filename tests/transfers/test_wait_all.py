"""``wait_all``: how the cache waits for a set of copies (flush, allocation, evict_async)."""

from __future__ import annotations

import asyncio

import numpy as np

from asynccache.errors import TransferError
from asynccache.transfers.handles import CopyHandle, CopyResult, wait_all

IDX = np.arange(4, dtype=np.int64)


def _handle() -> CopyHandle:
    return CopyHandle("d2h", asyncio.get_running_loop().create_future(), IDX, IDX, 64)


def _finish(h: CopyHandle, error: BaseException | None = None) -> None:
    fut = h._fut
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(CopyResult("d2h", 4, 64, 0.0, 0.001))


async def test_returns_after_the_commits_of_copies_that_finished_in_this_iteration() -> None:
    """A copy that finished in this loop iteration has its done-callbacks (the cache's
    commit) still queued; waiting for it must let them run, else an allocation loop that
    waits for copies and retries spins without ever seeing their pages freed."""
    h = _handle()
    committed: list[str] = []
    h.add_done_callback(lambda _h: committed.append("commit"))
    _finish(h)
    await wait_all([h])
    assert committed == ["commit"]


async def test_waits_for_every_copy_and_raises_none_of_their_errors() -> None:
    a, b = _handle(), _handle()
    order: list[str] = []
    a.add_done_callback(lambda _h: order.append("a"))
    b.add_done_callback(lambda _h: order.append("b"))
    waiter = asyncio.ensure_future(wait_all([a, b]))
    await asyncio.sleep(0)
    _finish(a, TransferError("boom"))
    for _ in range(3):
        await asyncio.sleep(0)
    assert not waiter.done() and order == ["a"]
    _finish(b)
    await asyncio.wait_for(waiter, 5)  # b's error-free result, a's error not raised
    assert order == ["a", "b"]
    assert isinstance(a._fut.exception(), TransferError)


async def test_cancelling_the_waiter_cancels_no_copy() -> None:
    h = _handle()
    waiter = asyncio.ensure_future(wait_all([h]))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert waiter.cancelled() and not h.finished and not h._fut.cancelled()
    _finish(h)
    await wait_all([h])
    assert h.result().num_bytes == 64


async def test_nothing_to_wait_for_returns_at_once() -> None:
    await wait_all([])
