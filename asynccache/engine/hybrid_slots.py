"""Slots of hybrid models, device and host.

:class:`HybridSlots`: the SWA KV pool with its full->SWA slot map and the Mamba state pool, and
how tree results are applied to them (per-component frees). A cache has one when its config
has ``sliding_window`` or ``mamba_states``; FULL-only caches have none.

:class:`HybridTier` (``HybridSlots.tier``): the host (L2) side, when the cache has a host tier:
host pools of the SWA KV and the Mamba states, and their copies. It allocates the host slots a
backup's component values need and the device slots a load-back's need (all or nothing: when
any pool falls short, nothing is taken and the operation is skipped), submits their copies (SWA
KV through a second copy engine, Mamba states through a
:class:`~asynccache.transfers.hybrid_copies.StateCopier`) and frees what the tree gives up.

Several ranks: the engine joins an operation's copies over all pools into one
:class:`~asynccache.transfers.hybrid_copies.GroupHandle` and commits it through the agreement's
copy lane, so it commits (or, if it failed on any rank, is undone) at the same tick everywhere.
The all-or-nothing skips need no collective of their own: the pools here are sized from the
config and only allocated / freed inside the caller's calls or at ticks, so they agree on every
rank, and each tick compares their usage.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from asynccache.config import CacheConfig
from asynccache.errors import ConfigError, InvalidInputError
from asynccache.transfers.engine import CopyEngine
from asynccache.transfers.handles import CopyHandle
from asynccache.transfers.hybrid_copies import StateCopier, host_state_pool
from asynccache.transfers.hybrid_pools import MambaStatePool, SWASlotMap
from asynccache.transfers.pools import DevicePool, HostPool, KVShape
from asynccache.tree import EvictResult, InsertResult, RadixTree
from asynccache.tree.config import as_slots
from asynccache.tree.results import BackupRequest, LoadBackTicket


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
        # Device pools of the sidecars of the state pool: a copy-on-write copies them too.
        self.state_sidecars: list[Any] = []

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
            for pool in self.state_sidecars:
                pool.data[:, dst] = pool.data[:, int(slot)]
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


class HybridTier:
    """Host pools and copies of the SWA / Mamba components (see the module docstring)."""

    def __init__(self, config: CacheConfig, slots: HybridSlots, host_tokens: int,
                 pin: bool) -> None:
        self.slots = slots
        self.swa_host: HostPool | None = None
        if slots.swa_pool is not None:
            shape = KVShape(config.swa_layers, config.num_heads, config.head_dim,
                            config.torch_dtype)
            self.swa_host = HostPool.from_tokens(
                shape, config.swa_host_tokens or host_tokens, config.page_size,
                pin_memory=pin)
        self.mamba_host: MambaStatePool | None = None
        if slots.mamba_pool is not None:
            self.mamba_host = host_state_pool(
                slots.mamba_pool, config.mamba_host_states or config.mamba_states)
        self.swa_engine: CopyEngine | None = None
        self.states: StateCopier | None = None
        # Host slots owned by backups in flight, per component.
        self.inflight = {"swa": 0, "mamba": 0}

    def check_retraction_capacity(self) -> None:
        """Retraction backup parks a request's SWA KV and Mamba state here: each host pool must
        be at least as large as its device pool (raises :class:`ConfigError`)."""
        if self.swa_host is not None:
            assert self.slots.swa_pool is not None
            dev, host = self.slots.swa_pool.num_slots, self.swa_host.num_slots
            if host < dev:
                raise ConfigError(
                    f"retraction_backup needs host SWA capacity >= device SWA capacity: {host} "
                    f"host SWA slots (swa_host_tokens) < {dev} device SWA slots (swa_tokens)"
                )
        if self.mamba_host is not None:
            assert self.slots.mamba_pool is not None
            dev, host = self.slots.mamba_pool.allocator.total_size, \
                self.mamba_host.allocator.total_size
            if host < dev:
                raise ConfigError(
                    f"retraction_backup needs host Mamba states >= device Mamba states: {host} "
                    f"host states (mamba_host_states) < {dev} device states (mamba_states)"
                )

    async def start(self) -> None:
        if self.swa_host is not None:
            assert self.slots.swa_pool is not None
            self.swa_engine = CopyEngine(self.slots.swa_pool, self.swa_host,
                                         name="asynccache-swa-copy")
            await self.swa_engine.start()
        if self.mamba_host is not None:
            assert self.slots.mamba_pool is not None
            self.states = StateCopier(self.slots.mamba_pool, self.mamba_host)
            await self.states.start()

    async def aclose(self) -> None:
        if self.swa_engine is not None:
            await self.swa_engine.aclose()
        if self.states is not None:
            await self.states.aclose()

    # ------------------------------------------------------------------ host slots
    def _host_alloc(self, name: str, n: int) -> np.ndarray | None:
        if name == "swa":
            assert self.swa_host is not None
            got: np.ndarray | None = self.swa_host.allocator.alloc(n)
            return got
        assert self.mamba_host is not None
        return self.mamba_host.alloc(n)

    def _host_free(self, name: str, slots: np.ndarray) -> None:
        if not len(slots):
            return
        if name == "swa":
            assert self.swa_host is not None
            self.swa_host.allocator.free(slots)
        else:
            assert self.mamba_host is not None
            self.mamba_host.free(slots)

    def host_available(self, name: str) -> int:
        if name == "swa":
            assert self.swa_host is not None
            return int(self.swa_host.allocator.available_size)
        assert self.mamba_host is not None
        return self.mamba_host.available_size

    def take_host(self, name: str, n: int,
                  evict_host: Callable[[int], Any]) -> np.ndarray | None:
        """``n`` host slots of a component owned by an operation (a prefetch) until
        :meth:`give_host`; evicts host copies when short."""
        slots = self._host_alloc(name, n)
        if slots is None:
            evict_host(n - self.host_available(name))
            slots = self._host_alloc(name, n)
        if slots is not None:
            self.inflight[name] += len(slots)
        return slots

    def give_host(self, name: str, slots: np.ndarray, *, free: bool) -> None:
        self.inflight[name] -= len(slots)
        if free:
            self._host_free(name, slots)

    def alloc_backup(self, req: BackupRequest,
                     evict_host: Callable[[int], Any]) -> dict[str, np.ndarray] | None:
        """Host slots for the component values of ``req`` (evicting host copies if short);
        None, with nothing taken, when any component pool falls short."""
        got: dict[str, np.ndarray] = {}
        for name, dev in req.component_slots.items():
            slots = self._host_alloc(name, len(dev))
            if slots is None:
                evict_host(len(dev) - self.host_available(name))
                slots = self._host_alloc(name, len(dev))
            if slots is None:
                for n, s in got.items():
                    self._host_free(n, s)
                return None
            got[name] = slots
        for name, slots in got.items():
            self.inflight[name] += len(slots)
        return got

    def release_backup(self, parts: Mapping[str, np.ndarray], *, free: bool) -> None:
        """A backup's component host slots leave flight: committed to the tree, or freed."""
        for name, slots in parts.items():
            self.inflight[name] -= len(slots)
            if free:
                self._host_free(name, slots)

    def submit_d2h(self, req: BackupRequest, parts: Mapping[str, np.ndarray]) -> list[CopyHandle]:
        out = []
        for name, host in parts.items():
            dev = req.component_slots[name]
            if name == "swa":  # the tree names SWA data by FULL slots
                assert self.swa_engine is not None and self.slots.swa_map is not None
                out.append(self.swa_engine.submit_d2h(self.slots.swa_map.translate(dev), host))
            else:
                assert self.states is not None
                out.append(self.states.submit_d2h(dev, host))
        return out

    def free_host(self, frees: Mapping[str, list[np.ndarray]]) -> None:
        for name, arrays in frees.items():
            for slots in arrays:
                self._host_free(name, slots)

    # ------------------------------------------------------------------ load-back
    def alloc_load(self, sizes: Mapping[str, int]) -> dict[str, np.ndarray] | None:
        """Device slots of the component parts of a load-back; None (nothing taken) when a
        pool falls short. SWA slots come unpaired: the ticket's ``swa_pairs`` pair them."""
        got: dict[str, np.ndarray] = {}
        for name, n in sizes.items():
            if name == "full" or not n:
                continue
            slots: np.ndarray | None
            if name == "swa":
                assert self.slots.swa_map is not None
                slots = self.slots.swa_map.swa.alloc(n)
            else:
                assert self.slots.mamba_pool is not None
                slots = self.slots.mamba_pool.alloc(n)
            if slots is None:
                self.free_load_parts(got)
                return None
            got[name] = slots
        return got

    def free_load_parts(self, parts: Mapping[str, np.ndarray]) -> None:
        """Give back component device slots of a load that did not happen (never paired)."""
        for name, slots in parts.items():
            if name == "swa":
                assert self.slots.swa_map is not None
                self.slots.swa_map.swa.free(slots)
            else:
                assert self.slots.mamba_pool is not None
                self.slots.mamba_pool.free(slots)

    def pair(self, ticket: LoadBackTicket) -> None:
        if ticket.swa_pairs is not None:
            assert self.slots.swa_map is not None
            self.slots.swa_map.adopt(*ticket.swa_pairs)

    def submit_h2d(self, ticket: LoadBackTicket) -> dict[str, CopyHandle]:
        """The load-back's SWA (layer by layer) and Mamba (whole) copies, by component."""
        out: dict[str, CopyHandle] = {}
        for name, dev in ticket.component_device_slots.items():
            host = ticket.component_host_slots[name]
            if name == "swa":
                assert self.swa_engine is not None
                out[name] = self.swa_engine.submit_h2d_layerwise(host, dev)
            else:
                assert self.states is not None
                out[name] = self.states.submit_h2d(host, dev)
        return out

    def abort_load(self, ticket: LoadBackTicket, full_frees: list[np.ndarray]) -> None:
        """A failed load-back: unpair and free its SWA slots, free its states, then its FULL
        slots."""
        swa = ticket.component_device_slots.get("swa")
        if swa is not None:
            assert self.slots.swa_map is not None
            self.slots.swa_map.free_swa(swa)
        mamba = ticket.component_device_slots.get("mamba")
        if mamba is not None:
            assert self.slots.mamba_pool is not None
            self.slots.mamba_pool.free(mamba)
        for slots in full_frees:
            self.slots.free_full(slots)

    # ------------------------------------------------------------------ accounting
    def check(self, tree: RadixTree) -> None:
        for name in tree.components[1:]:
            held = len(tree.component_host_slots(name))
            if name == "swa":
                assert self.swa_host is not None
                pool: Any = self.swa_host.allocator
            else:
                pool = self.mamba_host
            assert pool is not None
            used = int(pool.used_size)
            if used != held + self.inflight[name]:
                raise AssertionError(
                    f"{name} host accounting: pool uses {used} slots, tree holds {held} and "
                    f"backups in flight {self.inflight[name]}"
                )

    def release(self, tree: RadixTree) -> None:
        """Free every component host slot the tree holds (the cache is closing)."""
        for name in tree.components[1:]:
            slots = tree.component_host_slots(name)
            if len(slots):
                self._host_free(name, slots)
