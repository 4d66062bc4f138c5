"""Hybrid-model operations (SWA / Mamba components): early release of a lock's SWA window and
the request-facing SWA and Mamba state slot calls. The pools and their accounting are in
:mod:`asynccache.engine.hybrid_slots`, with their host side;
the hybrid insert is the engine's insert (:meth:`Tiering.insert`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asynccache.engine.hybrid_slots import HybridSlots
from asynccache.engine.tiering import Tiering
from asynccache.errors import InvalidInputError
from asynccache.tree import LockReceipt


class HybridOps:
    """SWA / Mamba calls of one cache (each raises :class:`InvalidInputError` on a cache
    without the component)."""

    def __init__(self, tiering: Tiering) -> None:
        self._t = tiering
        self._hy = tiering.parts.hybrid

    def slots(self) -> HybridSlots:
        if self._hy is None:
            raise InvalidInputError("this cache has no SWA / Mamba components")
        return self._hy

    def release_swa(self, receipt: LockReceipt) -> None:
        self._t.tree.release_swa(receipt)

    def free_swa(self, slots: Any) -> None:
        self.slots().free_swa(slots)

    def alloc_mamba_state(self) -> int | None:
        return self._state_evicting(self.slots().alloc_mamba)

    def free_mamba_state(self, slot: int) -> None:
        self.slots().free_mamba(slot)

    def mamba_copy_on_write(self, slot: int) -> int | None:
        hy = self.slots()
        return self._state_evicting(lambda: hy.copy_on_write(slot))

    def _state_evicting(self, take: Callable[[], int | None]) -> int | None:
        """A Mamba state from ``take``; when the pool is full, after evicting one unlocked
        state (None if there is none)."""
        got = take()
        if got is None:
            self._t.evict(0, mamba_num=1)
            got = take()
        return got
