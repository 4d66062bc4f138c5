"""The sidecar pools of one cache: registered before it starts, carried by every copy.

A sidecar (:class:`~asynccache.transfers.sidecars.SidecarSpec`) shares the slot indices of its
source pool (FULL KV, SWA KV or Mamba states), so it needs no allocation, no tree state and no
accounting of its own: whatever the cache does with a source slot it does with the sidecar's.
At start its copy engine becomes a *rider* of the source's copy engine, so every copy of the
source -- D->H backups and write-backs, load-backs (layer by layer), retraction, buffer
staging -- copies the sidecar's slots too, in the same handle. Storage (L3) writes and reads
its pages as ``<page key>.<name>`` objects next to the source's (:mod:`asynccache.l3`,
:mod:`asynccache.buffer`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from asynccache.errors import ConfigError
from asynccache.transfers.engine import CopyEngine
from asynccache.transfers.pools import DevicePool, HostPool
from asynccache.transfers.sidecars import DeviceSidecarPool, HostSidecarPool, SidecarSpec

__all__ = ["Sidecar", "Sidecars", "sidecar_object"]


def sidecar_object(key: str, name: str) -> str:
    """The storage name of sidecar ``name``'s data for page (or state) ``key``."""
    return f"{key}.{name}"


@dataclass(eq=False)
class Sidecar:
    """One registered sidecar: its spec, its device pool (the model reads and writes it:
    ``device.layer(i)`` is ``(slots, *token_shape)``), its host pool and copy engine (None
    without a host tier; the engine exists once the cache started)."""

    spec: SidecarSpec
    device: DeviceSidecarPool
    host: HostSidecarPool | None
    engine: CopyEngine | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def host_pool(self) -> HostSidecarPool:
        """The host pool (the cache has a host tier: see :meth:`Sidecars.stored_with`)."""
        if self.host is None:
            raise ConfigError(f"sidecar {self.name!r} has no host pool (no host tier)")
        return self.host

    def object_name(self, key: str) -> str:
        return sidecar_object(key, self.spec.name)


@dataclass(frozen=True, slots=True)
class _Source:
    device_slots: int
    host_slots: int | None
    page_size: int


class Sidecars:
    """The sidecars of one cache, by registration order (see the module docstring)."""

    def __init__(self, device_pool: DevicePool, host_pool: HostPool | None,
                 sources: Mapping[str, tuple[int, int | None, int]],
                 state_sidecars: list[Any] | None = None) -> None:
        self._device = device_pool.device
        # (the hybrid slots' list: a Mamba state's copy-on-write copies its sidecars too)
        self._state_sidecars = state_sidecars
        self._pin = host_pool is not None and host_pool.pinned
        self._sources = {k: _Source(*v) for k, v in sources.items()}
        self._all: list[Sidecar] = []
        self._started = False

    def __iter__(self) -> Iterator[Sidecar]:
        return iter(self._all)

    def __len__(self) -> int:
        return len(self._all)

    def of(self, source: str) -> list[Sidecar]:
        """The sidecars of ``source`` (``"kv"``, ``"swa"``, ``"mamba"``), in rider order."""
        return [s for s in self._all if s.spec.source == source]

    def stored_with(self, source: str) -> list[Sidecar]:
        """The sidecars of ``source`` with a host pool: their objects ride its storage pages."""
        return [s for s in self.of(source) if s.host is not None]

    def all_or_nothing(self, source: str) -> bool:
        """A prefetch of ``source``'s pages is all or nothing: one of its sidecars cannot be
        cut short (not a KV-derived ``all_pages`` one)."""
        return any(not s.spec.clamps for s in self.stored_with(source))

    def get(self, name: str) -> Sidecar:
        for s in self._all:
            if s.spec.name == name:
                return s
        raise ConfigError(f"no sidecar pool named {name!r}; registered: "
                          f"{[s.spec.name for s in self._all]}")

    def register(self, spec: SidecarSpec) -> Sidecar:
        """Add ``spec``'s pools (before the cache starts). :class:`ConfigError`, with nothing
        registered, for a duplicate name, a source this cache does not have, or a host pool
        smaller than its source's host capacity."""
        if not isinstance(spec, SidecarSpec):
            raise ConfigError(f"spec must be a SidecarSpec, got {spec!r}")
        if self._started:
            raise ConfigError(f"sidecar {spec.name!r}: register sidecar pools before the cache "
                              "starts (its copies must carry them from the first one)")
        if any(s.spec.name == spec.name for s in self._all):
            raise ConfigError(f"a sidecar pool named {spec.name!r} is registered already")
        src = self._sources.get(spec.source)
        if src is None:
            raise ConfigError(f"sidecar {spec.name!r}: source pool {spec.source!r} is not a pool "
                              f"of this cache (it has {sorted(self._sources)})")
        host = None
        if src.host_slots is not None:
            n = spec.host_slots if spec.host_slots is not None else src.host_slots
            if n < src.host_slots:
                raise ConfigError(
                    f"sidecar {spec.name!r}: host_slots={n} < {src.host_slots}, the host "
                    f"capacity of its source pool {spec.source!r} (its slots are the source's)")
            if n % src.page_size:
                raise ConfigError(f"sidecar {spec.name!r}: host_slots={n} is not whole pages "
                                  f"of {src.page_size}")
            host = HostSidecarPool(spec.shape, n, src.page_size, pin_memory=self._pin)
        device = DeviceSidecarPool(spec.shape, src.device_slots, src.page_size,
                                   device=self._device)
        sidecar = Sidecar(spec, device, host)
        self._all.append(sidecar)
        if spec.source == "mamba" and self._state_sidecars is not None:
            self._state_sidecars.append(device)
        return sidecar

    # ------------------------------------------------------------------ lifecycle
    async def start(self, engines: Mapping[str, CopyEngine | None]) -> None:
        """Start each sidecar's copy engine and make it ride its source's (``engines``: the
        started engine of each source pool)."""
        self._started = True
        for s in self._all:
            source = engines.get(s.spec.source)
            if s.host is None or source is None:
                continue
            s.engine = CopyEngine(s.device, s.host, name=f"asynccache-copy-sidecar-{s.name}")  # type: ignore[arg-type]
            await s.engine.start()
            source.add_rider(s.engine)

    def engines(self) -> list[CopyEngine]:
        return [s.engine for s in self._all if s.engine is not None]

    async def aclose(self) -> None:
        """Close the engines (after their sources: every copy they rode has landed)."""
        for engine in self.engines():
            await engine.aclose()
