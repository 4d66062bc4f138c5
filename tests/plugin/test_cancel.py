"""cancel_at / sweep_cancellations: the cancel lands exactly at the k-th suspension."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

import pytest

from asynccache.testing import CancelOutcome, cancel_at, sweep_cancellations


class Probe:
    """A coroutine with three awaits that records how far it got and what it cleaned up."""

    def __init__(self) -> None:
        self.reached: list[int] = []
        self.cleaned = 0

    async def run(self) -> str:
        try:
            for i in range(3):
                self.reached.append(i)
                await asyncio.sleep(0)
            return "done"
        finally:
            self.cleaned += 1


async def test_k0_cancels_before_the_body_runs() -> None:
    probe = Probe()
    out = await cancel_at(probe.run, 0)
    assert (out.delivered, out.cancelled, out.suspensions) == (True, True, 0)
    assert probe.reached == [] and probe.cleaned == 0


@pytest.mark.parametrize("k", [1, 2, 3])
async def test_the_cancel_lands_at_the_kth_await(k: int) -> None:
    probe = Probe()
    out = await cancel_at(probe.run, k)
    assert out.cancelled and out.delivered and not out.completed
    assert probe.reached == list(range(k))  # stopped at the await right after step k - 1
    assert probe.cleaned == 1
    assert out.where[0].startswith("Probe.run (test_cancel.py:")  # the chain of frames
    assert f"cancel at await {k} (landed in " in str(out)


async def test_past_the_last_await_it_completes() -> None:
    probe = Probe()
    out = await cancel_at(probe.run, 4)
    assert (out.completed, out.delivered, out.result, out.suspensions) == (True, False, "done", 3)
    assert "completed after 3 suspensions" in str(out)


async def test_a_cancel_lands_on_a_future_and_on_awaited_tasks() -> None:
    started = asyncio.Event()
    inner_cancelled = []

    async def inner() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            inner_cancelled.append(True)
            raise

    async def outer() -> None:
        task = asyncio.get_running_loop().create_task(inner())
        await asyncio.sleep(0)  # suspension 1: inner starts
        await task  # suspension 2: cancelling outer here cancels inner too

    out = await cancel_at(outer, 2)
    assert out.cancelled and started.is_set() and inner_cancelled == [True]


async def test_a_swallowed_cancel_and_an_error_are_reported() -> None:
    async def stubborn() -> int:
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
        await asyncio.sleep(0)
        return 7

    out = await cancel_at(stubborn, 1)
    assert (out.delivered, out.completed, out.result) == (True, True, 7)
    assert "despite the cancel" in str(out)

    async def converts() -> None:
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise RuntimeError("abort path broke") from None

    out = await cancel_at(converts, 1)
    assert isinstance(out.error, RuntimeError) and not out.cancelled


async def test_before_cancel_and_timeout() -> None:
    seen: list[str] = []
    await cancel_at(Probe().run, 2, before_cancel=lambda: seen.append("now"))
    assert seen == ["now"]

    stop = asyncio.Event()

    async def ignores_cancels_until_stopped() -> None:
        while not stop.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.01)

    with pytest.raises(AssertionError, match=r"still running 0\.1 s after it started"):
        await cancel_at(ignores_cancels_until_stopped, 1, timeout=0.1)
    stop.set()
    with pytest.raises(ValueError, match="k must be an int >= 0"):
        await cancel_at(Probe().run, -1)


async def test_plain_awaitables_are_accepted() -> None:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[int] = loop.create_future()
    loop.call_later(0.01, fut.set_result, 5)
    out = await cancel_at(lambda: fut, 5)
    assert out.completed and out.result == 5


async def test_sweep_runs_until_a_run_completes() -> None:
    probes: list[Probe] = []
    checked: list[CancelOutcome[str]] = []

    def make() -> Coroutine[Any, Any, str]:
        probes.append(Probe())
        return probes[-1].run()

    async def check(outcome: CancelOutcome[str]) -> None:
        checked.append(outcome)
        assert probes[-1].cleaned == (1 if outcome.k else 0)

    outcomes = await sweep_cancellations(make, check=check)
    assert [o.k for o in outcomes] == [0, 1, 2, 3, 4]
    assert [o.cancelled for o in outcomes] == [True, True, True, True, False]
    assert outcomes[-1].result == "done" and checked == outcomes


async def test_sweep_reraises_errors_with_the_k_and_gives_up_at_max_k() -> None:
    async def breaks_at_second_await() -> None:
        await asyncio.sleep(0)
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise KeyError("lost the request") from None

    with pytest.raises(KeyError) as info:
        await sweep_cancellations(breaks_at_second_await)
    assert "raised by the run cancelled at await 2" in info.value.__notes__[0]

    outcomes = await sweep_cancellations(breaks_at_second_await, allow_errors=True)
    assert isinstance(outcomes[2].error, KeyError) and outcomes[-1].completed

    with pytest.raises(AssertionError, match="had not completed without a cancel at k=2"):
        await sweep_cancellations(Probe().run, max_k=2)
