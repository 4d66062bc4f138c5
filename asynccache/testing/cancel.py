"""Cancel a coroutine at its k-th await: test that abort paths leak nothing.

:func:`cancel_at` runs a coroutine as a task and delivers ``task.cancel()`` exactly when the
coroutine suspends for the k-th time (an ``await`` that really waits: on a future, a copy, a
lock, ``asyncio.sleep(0)``...). The cancel lands at that await, just as a scheduler's abort
would if it came in while the request waited there. Counting suspensions rather than loop turns
makes the point deterministic: ``k = 3`` is the same await on every run (as long as the
coroutine takes the same path), however fast threads or storage answer.

:func:`sweep_cancellations` tries k = 0, 1, 2, ... until the coroutine runs to completion
without reaching its k-th suspension, calling ``check`` after each run (e.g.
:func:`asynccache.testing.assert_quiescent`), so every await of an abort path is exercised.

asyncio only (the tools step asyncio tasks).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Coroutine, Generator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["CancelOutcome", "await_chain", "cancel_at", "sweep_cancellations"]

T = TypeVar("T")

#: Seconds a run may take (from the start to the end of the task, cancelled or not).
DEFAULT_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class CancelOutcome(Generic[T]):
    """How one :func:`cancel_at` run ended.

    ``delivered``: the cancel was sent (``k == 0``, or the coroutine reached its k-th
    suspension); ``cancelled``: the task ended with ``CancelledError``; ``completed``: it
    returned ``result`` (it finished before its k-th suspension, or swallowed the cancel);
    ``error``: anything else it raised. ``suspensions``: how often it suspended in all.
    ``where``: the await the cancel landed at, as the chain of suspended coroutine frames
    (outermost first: ``"serve (kv.py:180)"``); empty for ``k = 0`` or an undelivered cancel.
    """

    k: int
    delivered: bool
    cancelled: bool
    completed: bool
    result: T | None
    error: BaseException | None
    suspensions: int
    where: tuple[str, ...] = ()

    def __str__(self) -> str:
        if self.cancelled:
            how = "cancelled"
        elif self.completed:
            how = "completed" + (" despite the cancel" if self.delivered else "")
        else:
            how = f"raised {self.error!r}"
        at = f" (landed in {self.where[-1]})" if self.where else ""
        return f"cancel at await {self.k}{at}: {how} after {self.suspensions} suspensions"


def await_chain(awaitable: object, limit: int = 64) -> tuple[str, ...]:
    """The suspended frames of a coroutine and of what it awaits: ``"func (file.py:12)"``."""
    out: list[str] = []
    obj: Any = awaitable
    while obj is not None and len(out) < limit:
        frame = getattr(obj, "cr_frame", None) or getattr(obj, "gi_frame", None)
        if frame is None:
            break
        code = frame.f_code
        out.append(f"{getattr(code, 'co_qualname', code.co_name)} "
                   f"({code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno})")
        obj = getattr(obj, "cr_await", None) or getattr(obj, "gi_yieldfrom", None)
    return tuple(out)


class _Stepper:
    """Drives a coroutine, counting its suspensions; cancels the running task at the k-th."""

    def __init__(self, coro: Coroutine[Any, Any, Any], k: int,
                 before_cancel: Callable[[], object] | None) -> None:
        self.coro = coro
        self.k = k
        self.before_cancel = before_cancel
        self.suspensions = 0
        self.delivered = False
        self.started = False
        self.where: tuple[str, ...] = ()

    def __await__(self) -> Generator[Any, Any, Any]:
        coro = self.coro
        self.started = True
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                yielded = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as stop:
                return stop.value
            self.suspensions += 1
            if self.suspensions == self.k:
                # Requested from inside the task's step: the task cancels the future it is about
                # to wait on (or throws CancelledError at the next step after a bare yield),
                # exactly as an external cancel arriving while it waits there.
                if self.before_cancel is not None:
                    self.before_cancel()
                self.delivered = True
                self.where = await_chain(coro)
                task = asyncio.current_task()
                assert task is not None
                task.cancel()
            try:
                value, error = (yield yielded), None
            except BaseException as exc:  # delivered into the coroutine at its await
                value, error = None, exc


def _as_coroutine(made: Awaitable[T]) -> Coroutine[Any, Any, T]:
    if inspect.iscoroutine(made):
        return made

    async def wrap() -> T:
        return await made

    return wrap()


async def cancel_at(
    coro_factory: Callable[[], Awaitable[T]],
    k: int,
    *,
    before_cancel: Callable[[], object] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> CancelOutcome[T]:
    """Run ``coro_factory()`` as a task and cancel it at its ``k``-th suspension.

    ``k = 0`` cancels the task before its first step (the coroutine body never runs).
    ``before_cancel()`` runs right before the cancel is delivered (from inside the task). Waits
    for the task to end (it may run cleanup awaits after the cancel) and reports how it ended;
    raises ``AssertionError`` when it is still running after ``timeout`` seconds.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be an int >= 0, got {k!r}")
    stepper = _Stepper(_as_coroutine(coro_factory()), k, before_cancel)

    async def run() -> T:
        result: T = await stepper
        return result

    task = asyncio.get_running_loop().create_task(run(), name=f"cancel_at[k={k}]")
    if k == 0:
        if before_cancel is not None:
            before_cancel()
        stepper.delivered = True
        task.cancel()
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not stepper.started:  # cancelled before its first step: never awaited, say so quietly
        stepper.coro.close()
    if not done:
        task.cancel()
        raise AssertionError(
            f"cancel_at(k={k}): the task is still running {timeout} s after it started "
            f"({stepper.suspensions} suspensions, cancel {'sent' if stepper.delivered else 'not reached'})"
        )
    s = stepper
    if task.cancelled():
        return CancelOutcome(k, s.delivered, True, False, None, None, s.suspensions, s.where)
    exc = task.exception()
    if exc is not None:
        return CancelOutcome(k, s.delivered, False, False, None, exc, s.suspensions, s.where)
    return CancelOutcome(k, s.delivered, False, True, task.result(), None, s.suspensions,
                         s.where)


async def sweep_cancellations(
    coro_factory: Callable[[], Awaitable[T]],
    *,
    check: Callable[[CancelOutcome[T]], object] | None = None,
    start: int = 0,
    max_k: int = 1000,
    allow_errors: bool = False,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> list[CancelOutcome[T]]:
    """Cancel a fresh ``coro_factory()`` at await k for k = start, start + 1, ... until a run
    completes without reaching its k-th suspension; returns every run's outcome.

    ``check(outcome)`` (sync or async) runs after each run: assert there what an abort must
    leave behind (no lock held, accounting balanced...). A run that raises anything but
    ``CancelledError`` re-raises it (with a note naming ``k``) unless ``allow_errors``.
    Raises ``AssertionError`` when no run completed up to ``max_k``.
    """
    outcomes: list[CancelOutcome[T]] = []
    for k in range(start, max_k + 1):
        outcome = await cancel_at(coro_factory, k, timeout=timeout)
        outcomes.append(outcome)
        if outcome.error is not None and not allow_errors:
            outcome.error.add_note(
                f"asynccache.testing.sweep_cancellations: raised by the run cancelled at await {k}"
                if outcome.delivered else
                f"asynccache.testing.sweep_cancellations: raised by the uncancelled run (k={k})"
            )
            raise outcome.error
        if check is not None:
            checked = check(outcome)
            if inspect.isawaitable(checked):
                await checked
        if not outcome.delivered:
            return outcomes
    raise AssertionError(
        f"sweep_cancellations: the coroutine still had not completed without a cancel at "
        f"k={max_k} (raise max_k, or the coroutine never finishes)"
    )
