"""The engine's calls up to the storage layer, as named ports: the attached tier sets them on
attach and they go back to :data:`NO_STORAGE` on detach. The engine never imports storage."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass


def _ignore(_items: Sequence[int]) -> None:
    return None


def _nothing_pending() -> bool:
    return False


async def _nothing_to_drain() -> None:
    return None


@dataclass(frozen=True)
class StoragePorts:
    #: Nodes whose D->H backup committed (cache host mode: write them to storage).
    node_backed_up: Callable[[Sequence[int]], None] = _ignore
    #: Write intents of an insert (buffer-only host mode: queue their storage writes).
    write_intents: Callable[[Sequence[int]], None] = _ignore
    #: Are storage writes holding host pins? (an allocation may wait for them)
    writes_pending: Callable[[], bool] = _nothing_pending
    #: Wait for the storage writes in flight (shielded: cancelling the wait stops only it).
    drain: Callable[[], Awaitable[None]] = _nothing_to_drain


NO_STORAGE = StoragePorts()
