"""Small helpers for tasks the engine owns."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Coroutine
from typing import Any, TypeVar

from asynccache.logs import get_logger

_log = get_logger("tasks")

T = TypeVar("T")


async def stop_and_wait(task: asyncio.Task[Any], failure_event: str) -> bool:
    """Cancel ``task`` and wait until it has really finished, even if the caller is cancelled
    meanwhile (its cleanup must run first); a failure of the task is logged as
    ``failure_event``. Returns True when the caller was cancelled: re-raise after cleaning up."""
    if not task.done():
        task.cancel()
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            cancelled = True
    if not task.cancelled() and task.exception() is not None:
        _log.warning(failure_event, error=repr(task.exception()))
    return cancelled


class TaskOwner:
    """The background tasks of one cache, in named groups (``"detach"``, ``"storage_writes"``,
    ...): spawn them here, drain a group (shielded: a cancelled drainer leaves them running),
    or cancel one and wait until it really finished. A task's failure is logged, never raised
    into its siblings: one failed storage write does not cancel another."""

    def __init__(self) -> None:
        self._groups: dict[str, set[asyncio.Task[Any]]] = {}
        self._serial = itertools.count(1)

    def new_group(self, name: str) -> str:
        """A group name no other caller gets (``name#N``): one component instance's tasks,
        told apart from a sibling's (a detached storage tier still closing, the next one)."""
        return f"{name}#{next(self._serial)}"

    def spawn(self, group: str, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(coro)
        tasks = self._groups.setdefault(group, set())
        tasks.add(task)

        def finished(t: asyncio.Task[Any]) -> None:
            tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                _log.warning("background_task_failed", group=group, error=repr(t.exception()))

        task.add_done_callback(finished)
        return task

    def count(self, group: str) -> int:
        return len(self._groups.get(group, ()))

    def tasks(self, group: str) -> list[asyncio.Task[Any]]:
        return list(self._groups.get(group, ()))

    async def drain(self, group: str) -> None:
        """Wait until the group has no task left, including tasks spawned meanwhile."""
        while self._groups.get(group):
            await asyncio.wait(set(self._groups[group]))  # (wait never cancels them)
