"""The parts of one cache, built once from its config: pools, tree, hybrid slots, metrics, and
its lifecycle state. Data only: every service of the cache gets the same bundle."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asynccache.config import CacheConfig
from asynccache.engine.hybrid_slots import HybridSlots, HybridTier
from asynccache.engine.sidecars import Sidecars
from asynccache.errors import ClosedError, ConfigError
from asynccache.metrics import CacheMetrics
from asynccache.transfers.pools import DevicePool, HostPool, KVShape
from asynccache.tree import RadixTree, TreeConfig


class Lifecycle:
    """``new`` -> ``running`` -> ``closing`` -> ``closed``; every call checks it."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = "new"

    @property
    def running(self) -> bool:
        return self.state == "running"

    def check_open(self) -> None:
        if self.state != "running":
            raise ClosedError(f"cache is {self.state}; use 'async with HierarchicalCache(...)'")


@dataclass(frozen=True, eq=False)
class Parts:
    config: CacheConfig
    page_size: int
    shape: KVShape
    device_pool: DevicePool
    host_pool: HostPool | None
    tree: RadixTree
    hybrid: HybridSlots | None  # SWA / Mamba pools (None: FULL only)
    metrics: CacheMetrics
    life: Lifecycle
    sidecars: Sidecars  # extra per-token pools on a source pool's slots (registered later)

    @property
    def hybrid_tier(self) -> HybridTier | None:
        """The host side of the hybrid components (None: FULL only, or no host tier)."""
        return self.hybrid.tier if self.hybrid is not None else None

    @classmethod
    def build(cls, config: CacheConfig, metrics: CacheMetrics | None = None) -> Parts:
        shape = KVShape(config.num_layers, config.num_heads, config.head_dim, config.torch_dtype)
        if config.device_tokens is not None:
            device_pool = DevicePool.from_tokens(shape, config.device_tokens, config.page_size,
                                                 device=config.device)
        else:
            assert config.device_bytes is not None
            device_pool = DevicePool.from_bytes(shape, config.device_bytes, config.page_size,
                                                device=config.device)
        host_pool: HostPool | None = None
        if config.host_enabled:
            pin = torch.cuda.is_available() and device_pool.device.type == "cuda"
            if config.host_tokens:
                host_pool = HostPool.from_tokens(shape, config.host_tokens, config.page_size,
                                                 layout=config.host_layout, pin_memory=pin)
            else:
                assert config.host_bytes
                host_pool = HostPool.from_bytes(shape, config.host_bytes, config.page_size,
                                                layout=config.host_layout, pin_memory=pin)
        if (config.retraction_backup and host_pool is not None
                and host_pool.num_slots < device_pool.num_slots):
            raise ConfigError(
                f"retraction_backup needs host capacity >= device capacity: "
                f"{host_pool.num_slots} host slots < {device_pool.num_slots} device slots"
            )
        tree = RadixTree(TreeConfig(
            page_size=config.page_size,
            eviction_policy=config.eviction_policy,
            host_enabled=config.host_tier,
            write_policy=config.write_policy,
            enable_kv_events=config.enable_kv_events,
            enable_page_hashes=config.enable_page_hashes,
            enable_sessions=config.enable_sessions,
            sliding_window=config.sliding_window,
            mamba=config.mamba_states > 0,
            eagle=config.eagle,
            device_tokens=device_pool.num_slots,
        ))
        hybrid = HybridSlots(config, device_pool) if config.hybrid else None
        if hybrid is not None and host_pool is not None:
            hybrid.tier = HybridTier(config, hybrid, host_pool.num_slots,
                                     pin=host_pool.kv.is_pinned())
            if config.retraction_backup:
                hybrid.tier.check_retraction_capacity()
        metrics = metrics if metrics is not None else CacheMetrics()
        if host_pool is not None:
            metrics.host_total_tokens.set(host_pool.num_slots)
        return cls(config, config.page_size, shape, device_pool, host_pool, tree, hybrid,
                   metrics, Lifecycle(), Sidecars(
                       device_pool, host_pool, _sources(device_pool, host_pool, hybrid),
                       hybrid.state_sidecars if hybrid is not None else None))


def _sources(device_pool: DevicePool, host_pool: HostPool | None,
             hybrid: HybridSlots | None) -> dict[str, tuple[int, int | None, int]]:
    """The pools a sidecar can ride: (device slots, host slots or None, page size) each."""
    ps = device_pool.page_size
    out: dict[str, tuple[int, int | None, int]] = {
        "kv": (device_pool.num_slots, host_pool.num_slots if host_pool is not None else None, ps)}
    if hybrid is None:
        return out
    tier = hybrid.tier
    if hybrid.swa_pool is not None:
        host = tier.swa_host if tier is not None else None
        out["swa"] = (hybrid.swa_pool.num_slots, host.num_slots if host is not None else None, ps)
    if hybrid.mamba_pool is not None:
        states = tier.mamba_host if tier is not None else None
        out["mamba"] = (hybrid.mamba_pool.allocator.total_size,
                        states.allocator.total_size if states is not None else None, 1)
    return out
