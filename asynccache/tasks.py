"""Small helpers for tasks the engine owns."""

from __future__ import annotations

import asyncio
from typing import Any

from asynccache.logs import get_logger

_log = get_logger("tasks")


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
