"""The facade's side of hybrid models: the SWA KV pool with its full->SWA slot map and the
Mamba state pool, and how tree results are applied to them (per-component frees).

:class:`~asynccache.cache.HierarchicalCache` owns one :class:`HybridSlots` when its config
has ``sliding_window`` or ``mamba_states``; FULL-only caches have none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from asynccache.errors import InvalidInputError
from asynccache.transfers.hybrid_pools import MambaStatePool, SWASlotMap
from asynccache.transfers.pools import DevicePool, KVShape
from asynccache.tree import EvictResult, InsertResult, RadixTree
from asynccache.tree.config import as_slots

if TYPE_CHECKING:
    from asynccache.config import CacheConfig
    from asynccache.hybrid_tier import HybridTier


class HybridSlots:
    """SWA and Mamba pools of a hybrid cache, and their accounting."""

    def __init__(self, config: CacheConfig, device_pool: DevicePool) -> None:
        self.swa_pool: DevicePool | None = None
        self.swa_map: SWASlotMap | None = None
        if config.sliding_window:
            shape = KVShape(config.swa_layers, config.num_heads, config.head_dim,
                            config.torch_dtype)
            tokens = config.swa_tokens or device_pool.num_slots
            self.swa_pool = DevicePool.from_tokens(shape, tokens, config.page_size,
                                                   device=config.device)
            self.swa_map = SWASlotMap(device_pool.allocator, self.swa_pool.allocator)
        self.mamba_pool: MambaStatePool | None = None
        if config.mamba_states:
            self.mamba_pool = MambaStatePool(config.mamba_states, config.mamba_state_shape,
                                             dtype=config.torch_dtype, device=config.device)
        self.device_pool = device_pool
        self.tier: HybridTier | None = None  # host pools and copies (set with a host tier)
        self.mamba_outstanding = 0  # states handed to callers, not yet adopted or freed

    # ------------------------------------------------------------------ FULL + SWA slots
    def alloc(self, num_tokens: int) -> np.ndarray | None:
        if self.swa_map is not None:
            return self.swa_map.alloc(num_tokens)
        got: np.ndarray | None = self.device_pool.allocator.alloc(num_tokens)
        return got

    def available(self) -> tuple[int, int]:
        """Free (FULL, SWA) slots."""
        full = self.device_pool.allocator.available_size
        swa = self.swa_map.swa.available_size if self.swa_map is not None else full
        return full, swa

    def free_full(self, slots: np.ndarray) -> None:
        if self.swa_map is not None:
            self.swa_map.free_full(slots)
        else:
            self.device_pool.allocator.free(slots)

    def free_swa(self, slots: Any) -> None:
        """Free a request's SWA slots that slid out of the window (its FULL slots stay)."""
        if self.swa_map is None:
            raise InvalidInputError("free_swa: the cache has no SWA component")
        self.swa_map.free_swa(as_slots(slots, "slots"))

    def check_paired(self, value: np.ndarray, start: int) -> None:
        """An insert's FULL slots from ``start`` on must still have their SWA side (the tree
        takes their SWA data as theirs); raises :class:`InvalidInputError` naming one that
        has none."""
        if self.swa_map is not None:
            self.swa_map.translate(value[start:])

    # ------------------------------------------------------------------ Mamba states
    def alloc_mamba(self) -> int | None:
        if self.mamba_pool is None:
            raise InvalidInputError("alloc_mamba: the cache has no Mamba component")
        got = self.mamba_pool.alloc(1)
        if got is None:
            return None
        self.mamba_outstanding += 1
        return int(got[0])

    def copy_on_write(self, slot: int) -> int | None:
        if self.mamba_pool is None:
            raise InvalidInputError("copy_on_write: the cache has no Mamba component")
        dst = self.mamba_pool.copy_on_write(slot)
        if dst is not None:
            self.mamba_outstanding += 1
        return dst

    def free_mamba(self, slot: int) -> None:
        if self.mamba_pool is None:
            raise InvalidInputError("free_mamba: the cache has no Mamba component")
        self.mamba_pool.free([slot])
        self.mamba_outstanding -= 1

    # ------------------------------------------------------------------ tree results
    def apply_insert(self, res: InsertResult, mamba_value: int | None) -> None:
        if self.swa_map is not None:
            self.swa_map.apply_tree_frees(res.device_frees, res.component_frees.get("swa", []),
                                          res.swa_adopted)
        else:
            for slots in res.device_frees:
                self.device_pool.allocator.free(slots)
        if mamba_value is not None and self.mamba_pool is not None:
            dups = res.component_frees.get("mamba", [])
            for slots in dups:
                self.mamba_pool.free(slots)
            # Freed just above, or adopted (not when the node already held a state).
            if dups or (res.cached_len and not res.mamba_exist):
                self.mamba_outstanding -= 1

    def apply_evict(self, res: EvictResult) -> None:
        if self.swa_map is not None:
            self.swa_map.apply_tree_frees(res.device_frees, res.component_frees.get("swa", []))
        else:
            for slots in res.device_frees:
                self.device_pool.allocator.free(slots)
        if self.mamba_pool is not None:
            for slots in res.component_frees.get("mamba", []):
                self.mamba_pool.free(slots)
        if self.tier is not None:
            self.tier.free_host(res.component_host_frees)

    def release_tree(self, tree: RadixTree) -> list[np.ndarray]:
        """Free every device and component slot the tree holds, then reset it (the cache is
        closing); returns the FULL host slots for the caller's host pool."""
        swa = tree.component_slots("swa") if self.swa_map is not None else None
        states = tree.component_slots("mamba") if self.mamba_pool is not None else None
        if self.tier is not None:
            self.tier.release(tree)
        device, host = tree.reset()
        if self.swa_map is not None:
            assert swa is not None
            self.swa_map.apply_tree_frees(device, [swa])
        else:
            for slots in device:
                self.device_pool.allocator.free(slots)
        if self.mamba_pool is not None and states is not None and len(states):
            self.mamba_pool.free(states)
        return host

    def check(self, tree: RadixTree) -> None:
        """Every SWA slot is paired with an allocated FULL slot, the tree's SWA-live nodes have
        their FULL slots paired and its SWA tombstones have them unpaired, and every Mamba state
        has one owner."""
        if self.swa_map is not None:
            self.swa_map.check()
            paired = int((self.swa_map.swa_to_full >= 0).sum())
            used = self.swa_map.swa.used_size
            if paired != used:
                raise AssertionError(f"SWA accounting: {used} slots used but {paired} paired")
            f2s = self.swa_map.full_to_swa
            for n in tree.iter_nodes():
                if n.value is None:
                    continue
                sides = f2s[n.value]
                live = tree.component_slots_of(n.id, "swa") is not None
                if live and int(sides.min()) < 0:
                    raise AssertionError(f"node {n.id} is SWA-live but a FULL slot is unpaired")
                if not live and int(sides.max()) >= 0:
                    raise AssertionError(f"SWA tombstone {n.id} has a FULL slot still paired")
        if self.mamba_pool is not None:
            held = len(tree.component_slots("mamba"))
            if self.mamba_pool.used_size != held + self.mamba_outstanding:
                raise AssertionError(
                    f"Mamba accounting: pool uses {self.mamba_pool.used_size} states, tree holds "
                    f"{held} and callers {self.mamba_outstanding}"
                )
        if self.tier is not None:
            self.tier.check(tree)
