"""LoopBridge: batched thread -> loop completions, cancellation, errors, close, anyio."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future as ConcurrentFuture
from typing import Any

import anyio
import pytest

from asynccache.errors import ClosedError, OwnerError
from asynccache.transfers.bridge import LoopBridge


def _in_thread(fn: Any) -> threading.Thread:
    t = threading.Thread(target=fn, name="test-bridge-worker")
    t.start()
    return t


async def test_thousands_of_awaits_resolve_exactly_once_in_batches() -> None:
    bridge = LoopBridge()
    n = 5000
    futs = [bridge.create_future() for _ in range(n)]
    resumed: list[int] = []

    async def waiter(i: int) -> int:
        value = await futs[i]
        resumed.append(i)
        return value

    tasks = [asyncio.create_task(waiter(i)) for i in range(n)]
    await asyncio.sleep(0)
    assert bridge.pending_count == n

    def worker() -> None:
        for start in range(0, n, 250):
            bridge.complete_many((futs[i], i * 3, None) for i in range(start, start + 250))
        # completing again is harmless: the future is done, nothing is delivered twice
        bridge.set_result(futs[0], -1)

    _in_thread(worker).join()
    results = await asyncio.gather(*tasks)
    assert results == [i * 3 for i in range(n)]
    assert sorted(resumed) == list(range(n)) and len(resumed) == n
    assert bridge.pending_count == 0
    assert bridge.delivered == n
    # the worker posted 21 times; every post made while a drain was pending shared its hop
    assert 1 <= bridge.hops <= 21
    bridge.close()


async def test_single_posts_coalesce_into_one_hop() -> None:
    bridge = LoopBridge()
    futs = [bridge.create_future() for _ in range(1000)]

    def worker() -> None:
        for i, f in enumerate(futs):
            bridge.set_result(f, i)

    _in_thread(worker).join()  # the loop is blocked here: nothing drained yet
    assert bridge.hops == 0
    assert await asyncio.gather(*futs) == list(range(1000))
    assert bridge.hops == 1  # one wake-up for all 1000 completions


async def test_completions_arrive_in_post_order() -> None:
    bridge = LoopBridge()
    futs = [bridge.create_future() for _ in range(300)]
    order: list[int] = []
    for i, f in enumerate(futs):
        f.add_done_callback(lambda _f, i=i: order.append(i))

    def worker() -> None:
        for i in range(0, 300, 7):
            bridge.complete_many((f, None, None) for f in futs[i : i + 7])

    _in_thread(worker).join()
    await asyncio.gather(*futs)
    await asyncio.sleep(0)
    assert order == list(range(300))


async def test_errors_propagate_to_the_awaiter() -> None:
    bridge = LoopBridge()
    ok, bad = bridge.create_future(), bridge.create_future()
    _in_thread(
        lambda: bridge.complete_many([(ok, "fine", None), (bad, None, KeyError("k"))])
    ).join()
    assert await ok == "fine"
    with pytest.raises(KeyError, match="k"):
        await bad
    worse = bridge.create_future()
    _in_thread(lambda: bridge.set_exception(worse, ValueError("boom"))).join()
    with pytest.raises(ValueError, match="boom"):
        await worse


async def test_cancelled_awaiter_does_not_break_the_batch() -> None:
    bridge = LoopBridge()
    futs = [bridge.create_future() for _ in range(3)]
    task = asyncio.create_task(asyncio.wait_for(futs[1], timeout=10))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert futs[1].cancelled()
    _in_thread(lambda: bridge.complete_many((f, i, None) for i, f in enumerate(futs))).join()
    assert await futs[0] == 0 and await futs[2] == 2
    assert bridge.pending_count == 0


async def test_close_fails_pending_and_drops_late_completions() -> None:
    bridge = LoopBridge()
    futs = [bridge.create_future() for _ in range(50)]
    waiters = [asyncio.create_task(_await(f)) for f in futs]
    await asyncio.sleep(0)
    bridge.close()
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(r, ClosedError) for r in results) and len(results) == 50
    _in_thread(lambda: bridge.set_result(futs[0], 1)).join()  # dropped, no error
    await asyncio.sleep(0)
    assert bridge.closed and bridge.pending_count == 0
    with pytest.raises(ClosedError):
        bridge.create_future()
    bridge.close()  # idempotent


async def _await(f: asyncio.Future[Any]) -> Any:
    return await f


async def test_wrap_concurrent_future_and_call_soon() -> None:
    bridge = LoopBridge()
    cf_ok: ConcurrentFuture[int] = ConcurrentFuture()
    cf_bad: ConcurrentFuture[int] = ConcurrentFuture()
    ok, bad = bridge.wrap_future(cf_ok), bridge.wrap_future(cf_bad)
    seen: list[str] = []

    def worker() -> None:
        cf_ok.set_result(41)
        cf_bad.set_exception(RuntimeError("nope"))
        bridge.call_soon(lambda: seen.append("callback"))

    _in_thread(worker).join()
    assert await ok == 41
    with pytest.raises(RuntimeError, match="nope"):
        await bad
    await asyncio.sleep(0)
    assert seen == ["callback"]


async def test_posting_from_the_loop_thread_works() -> None:
    bridge = LoopBridge()
    f = bridge.create_future()
    bridge.set_result(f, "same-thread")
    assert await f == "same-thread"


def test_needs_a_running_loop() -> None:
    with pytest.raises(OwnerError, match="running asyncio event loop"):
        LoopBridge()


def test_works_under_anyio_with_cancel_scopes() -> None:
    async def main() -> list[Any]:
        bridge = LoopBridge()
        futs = [bridge.create_future() for _ in range(200)]
        got: list[Any] = []

        async def waiter(i: int) -> None:
            got.append(await futs[i])

        with anyio.move_on_after(0):  # this awaiter is cancelled by anyio
            await futs[0]
        async with anyio.create_task_group() as tg:
            for i in range(1, 200):
                tg.start_soon(waiter, i)
            await anyio.sleep(0)
            t = _in_thread(lambda: bridge.complete_many((f, i, None) for i, f in enumerate(futs)))
        t.join()
        bridge.close()
        return got

    got = anyio.run(main, backend="asyncio")
    assert sorted(got) == list(range(1, 200))
