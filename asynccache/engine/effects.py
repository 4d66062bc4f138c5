"""Effects: the one place that applies every field of a tree result.

The tree decides and returns what must happen (slots to free per pool, backups to run, write
intents, dropped tokens); this module frees the slots in their pools, starts the backups,
forwards the intents to the storage port and counts the metrics. Synchronous, no I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from asynccache.engine.parts import Parts
from asynccache.engine.ports import NO_STORAGE, StoragePorts
from asynccache.engine.slots import DeviceSlots
from asynccache.transfers.handles import CopyHandle
from asynccache.tree import BackupRequest, EvictResult, InsertResult
from asynccache.tree.results import HostEvictResult

StartBackups = Callable[[Sequence[BackupRequest]], list[CopyHandle]]


class Effects:
    """Applies tree results; the only owner of the evicted-tokens count."""

    def __init__(self, parts: Parts, slots: DeviceSlots, start_backups: StartBackups) -> None:
        self._parts = parts
        self._slots = slots
        self._start_backups = start_backups
        self.ports: StoragePorts = NO_STORAGE
        self.evicted_total = 0

    def evicted(self, res: EvictResult, started: float | None = None) -> list[CopyHandle]:
        """An eviction (or a drop): free its slots, count it, start its write-back copies."""
        self._slots.apply_evict(res)
        p = self._parts
        if res.host_frees:
            assert p.host_pool is not None
            for slots in res.host_frees:
                p.host_pool.allocator.free(slots)
        m = p.metrics
        if res.dropped_host_tokens:
            m.dropped_tokens.labels(reason="host_pressure").inc(res.dropped_host_tokens)
        if res.num_evicted:
            self.evicted_total += res.num_evicted
            m.evicted_tokens.inc(res.num_evicted)
        m.eviction_duration.observe(0.0 if started is None else time.perf_counter() - started)
        return self._start_backups(res.backups) if res.backups else []

    def host_evicted(self, res: HostEvictResult) -> None:
        p = self._parts
        if res.host_frees:
            assert p.host_pool is not None
            for slots in res.host_frees:
                p.host_pool.allocator.free(slots)
        if res.component_host_frees:
            assert p.hybrid_tier is not None
            p.hybrid_tier.free_host(res.component_host_frees)

    def inserted(self, res: InsertResult, mamba_value: int | None = None) -> None:
        """An insert: free its duplicates, start its write-through copies, queue its intents."""
        self._slots.apply_insert(res, mamba_value)
        if res.backups:
            self._start_backups(res.backups)
        if res.intents:
            self.ports.write_intents(res.intents)
