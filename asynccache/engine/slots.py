"""Device slots of a cache: one :class:`DeviceSlots` per cache, FULL-only or hybrid.

The engine allocates, frees and applies tree results through this protocol, so allocation,
free, eviction, insert, close and the accounting check have no "is this a hybrid cache" branch:
:class:`FullSlots` works on the KV pool alone, :class:`HybridDeviceSlots` keeps every FULL
slot's SWA pair and the Mamba states in step (see :mod:`asynccache.engine.hybrid_slots`).
Synchronous; no I/O.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from asynccache.config import CacheConfig
from asynccache.engine.hybrid_slots import HybridSlots
from asynccache.transfers.pools import DevicePool
from asynccache.tree import EvictResult, InsertResult, RadixTree
from asynccache.tree.results import EMPTY_SLOTS


class DeviceSlots(Protocol):
    #: Allocation under pressure awaits write-back copies inside its eviction (FULL-only).
    evicts_async: bool

    def alloc(self, num_tokens: int, swa_tokens: int | None = None) -> np.ndarray | None:
        """Fresh slots, without evicting (None when a pool is short). Hybrid: the last
        ``swa_tokens`` get SWA pairs (None: all of them)."""

    def shortfall(self, num_tokens: int, swa_tokens: int | None = None) -> tuple[int, int]:
        """(FULL tokens, SWA tokens) to evict before :meth:`alloc` can succeed."""

    def describe(self) -> str:
        """What is free, for an allocation error."""

    def free(self, slots: np.ndarray, pages: np.ndarray | None = None) -> None:
        """Free slots no one else owns (``pages``: their page ids, already checked)."""

    def apply_evict(self, res: EvictResult) -> None:
        """Free the device and component slots an eviction (or drop) gave up."""

    def apply_insert(self, res: InsertResult, mamba_value: int | None) -> None:
        """Free an insert's duplicates (and adopt its SWA side, its Mamba state)."""

    def release_tree(self, tree: RadixTree) -> list[np.ndarray]:
        """Free everything the tree holds on device and reset it (the cache closes); returns
        the tree's FULL host slots for the host pool."""

    def check(self, tree: RadixTree) -> None:
        """Component accounting (FULL-only: nothing beyond the ledger's)."""

    def agreed_state(self, tree: RadixTree) -> list[int]:
        """Component figures every rank must share at a tick (see :func:`agreed_state_names`)."""


class FullSlots:
    """FULL-only caches: the KV pool's allocator."""

    evicts_async = True

    def __init__(self, device_pool: DevicePool) -> None:
        self._alloc = device_pool.allocator

    def alloc(self, num_tokens: int, swa_tokens: int | None = None) -> np.ndarray | None:
        got: np.ndarray | None = self._alloc.alloc(num_tokens)
        return got

    def shortfall(self, num_tokens: int, swa_tokens: int | None = None) -> tuple[int, int]:
        return num_tokens - self._alloc.available_size, 0

    def describe(self) -> str:
        return f"{self._alloc.available_size} free"

    def free(self, slots: np.ndarray, pages: np.ndarray | None = None) -> None:
        if pages is not None:
            self._alloc.free_pages(pages)
        elif len(slots):
            self._alloc.free(slots)

    def apply_evict(self, res: EvictResult) -> None:
        for slots in res.device_frees:
            self._alloc.free(slots)

    def apply_insert(self, res: InsertResult, mamba_value: int | None) -> None:
        for slots in res.device_frees:
            self._alloc.free(slots)

    def release_tree(self, tree: RadixTree) -> list[np.ndarray]:
        device, host = tree.reset() if not tree.pending_ops else ([], [])
        for slots in device:
            self._alloc.free(slots)
        return host

    def check(self, tree: RadixTree) -> None:
        return None

    def agreed_state(self, tree: RadixTree) -> list[int]:
        return []


class HybridDeviceSlots:
    """Hybrid caches: FULL slots with their SWA pairs, and Mamba states."""

    evicts_async = False

    def __init__(self, hybrid: HybridSlots) -> None:
        self.hybrid = hybrid

    def alloc(self, num_tokens: int, swa_tokens: int | None = None) -> np.ndarray | None:
        hy = self.hybrid
        smap = hy.swa_map
        if swa_tokens is None or smap is None:
            return hy.alloc(num_tokens)
        full: np.ndarray | None = smap.full.alloc(num_tokens)
        if full is None:
            return None
        swa = smap.swa.alloc(swa_tokens) if swa_tokens else EMPTY_SLOTS
        if swa is None:
            smap.full.free(full)
            return None
        if swa_tokens:
            smap.adopt(full[num_tokens - swa_tokens :], swa)
        return full

    def shortfall(self, num_tokens: int, swa_tokens: int | None = None) -> tuple[int, int]:
        full, swa = self.hybrid.available()
        if self.hybrid.swa_map is None:
            return max(0, num_tokens - full), 0
        want = num_tokens if swa_tokens is None else swa_tokens
        return max(0, num_tokens - full), max(0, want - swa)

    def describe(self) -> str:
        return f"FULL, SWA free: {self.hybrid.available()}"

    def free(self, slots: np.ndarray, pages: np.ndarray | None = None) -> None:
        if len(slots):
            self.hybrid.free_full(slots)

    def apply_evict(self, res: EvictResult) -> None:
        self.hybrid.apply_evict(res)

    def apply_insert(self, res: InsertResult, mamba_value: int | None) -> None:
        self.hybrid.apply_insert(res, mamba_value)

    def release_tree(self, tree: RadixTree) -> list[np.ndarray]:
        return self.hybrid.release_tree(tree)

    def check(self, tree: RadixTree) -> None:
        self.hybrid.check(tree)

    def agreed_state(self, tree: RadixTree) -> list[int]:
        """Per component, the units the tree holds on device and the usage of its device and
        host pools: those take every all-or-nothing allocation, so ranks whose pools drifted
        apart fail at the next tick instead of skipping different operations later."""
        hy = self.hybrid
        tier = hy.tier
        out: list[int] = []
        if hy.swa_map is not None:
            out += [sum(tree.component_sizes("swa")), hy.swa_map.swa.used_size,
                    tier.swa_host.allocator.used_size
                    if tier is not None and tier.swa_host is not None else 0]
        if hy.mamba_pool is not None:
            out += [sum(tree.component_sizes("mamba")), hy.mamba_pool.used_size,
                    tier.mamba_host.used_size
                    if tier is not None and tier.mamba_host is not None else 0]
        return out


def agreed_state_names(config: CacheConfig) -> tuple[str, ...]:
    """The names of :meth:`Tiering.agreed_state`'s figures (for a divergence error)."""
    names = ["tree nodes", "device tokens", "host tokens"]
    if config.sliding_window:
        names += ["swa device tokens", "swa device pool used", "swa host pool used"]
    if config.mamba_states:
        names += ["mamba device states", "mamba device pool used", "mamba host pool used"]
    return tuple(names)


def device_slots(device_pool: DevicePool, hybrid: HybridSlots | None) -> DeviceSlots:
    return FullSlots(device_pool) if hybrid is None else HybridDeviceSlots(hybrid)
