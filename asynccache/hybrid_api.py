"""Hybrid-model calls of the cache facade (SWA / Mamba components): the hybrid insert, early
release of a lock's SWA window, the request-facing SWA and Mamba state slot calls. The pools
and their accounting are in :mod:`asynccache.hybrid_slots`; the host tier in
:mod:`asynccache.hybrid_tier`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asynccache.errors import InvalidInputError
from asynccache.tree import InsertResult, LockReceipt, RadixKey, as_slots

if TYPE_CHECKING:
    from asynccache.cache import HierarchicalCache
    from asynccache.hybrid_slots import HybridSlots


class HybridMixin:
    """SWA / Mamba calls of :class:`~asynccache.HierarchicalCache`."""

    def _insert_hybrid(self: HierarchicalCache, key: RadixKey | Any, value: Any, prev_prefix_len: int,
                       inserted_len: int, priority: int, swa_evicted_seqlen: int,
                       mamba_value: int | None, held: tuple[int, Any]) -> InsertResult:
        """(``value`` and ``held`` come checked from :meth:`HierarchicalCache.insert`.)"""
        hy = self.hybrid
        assert hy is not None
        slots = as_slots(value)
        if isinstance(swa_evicted_seqlen, bool) or not isinstance(swa_evicted_seqlen, int) or (
            not 0 <= swa_evicted_seqlen <= len(slots)
        ):
            raise InvalidInputError(
                f"swa_evicted_seqlen must be an int in [0, {len(slots)}], got {swa_evicted_seqlen!r}"
            )
        start = min(len(slots), max(swa_evicted_seqlen, prev_prefix_len))
        hy.check_paired(slots, start)
        evicted = {"swa": swa_evicted_seqlen} if hy.swa_map is not None else None
        res = self.tree.insert(key, slots, prev_prefix_len=prev_prefix_len,
                               inserted_len=inserted_len, priority=priority,
                               component_evicted_seqlens=evicted, mamba_value=mamba_value)
        self._release_inserted(held, res.cached_len)
        hy.apply_insert(res, mamba_value)
        if res.backups:
            self._start_backups(res.backups)
        if res.intents and self._buffer is not None:  # buffer-only host (FULL+SWA)
            self._buffer.enqueue(res.intents)
        return res

    def release_swa(self: HierarchicalCache, receipt: LockReceipt) -> None:
        """Hybrid: drop the SWA / Mamba pins of a held lock once decode passed the window."""
        self._check_open()
        self.tree.release_swa(receipt)

    def _hybrid_slots(self: HierarchicalCache) -> HybridSlots:
        if self.hybrid is None:
            raise InvalidInputError("this cache has no SWA / Mamba components")
        return self.hybrid

    def free_swa(self: HierarchicalCache, slots: Any) -> None:
        """Free a request's SWA slots that slid out of the window (pairs of its FULL slots)."""
        self._check_open()
        self._hybrid_slots().free_swa(slots)

    def alloc_mamba_state(self: HierarchicalCache) -> int | None:
        """A fresh Mamba state slot for a request (None when the pool is full after evicting
        unlocked states)."""
        self._check_open()
        hy = self._hybrid_slots()
        got = hy.alloc_mamba()
        if got is None:
            self.evict(0, mamba_num=1)
            got = hy.alloc_mamba()
        return got

    def free_mamba_state(self: HierarchicalCache, slot: int) -> None:
        self._check_open()
        self._hybrid_slots().free_mamba(slot)

    def mamba_copy_on_write(self: HierarchicalCache, slot: int) -> int | None:
        """A request-private copy of the state a match returned in ``mamba_cow_slot``."""
        self._check_open()
        hy = self._hybrid_slots()
        got = hy.copy_on_write(slot)
        if got is None:
            self.evict(0, mamba_num=1)
            got = hy.copy_on_write(slot)
        return got
