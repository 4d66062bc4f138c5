"""Sidecar pools: extra per-token buffers whose slots are a source pool's slots.

A sidecar (a draft model's KV, a DSA indexer's keys, any per-token buffer) has no allocator of
its own: the KV written for slot ``s`` of its *source* pool (the FULL KV pool, the SWA pool or
the Mamba state pool) is accompanied by the sidecar's data at slot ``s`` of the sidecar pool,
on the device and on the host alike. So a sidecar moves wherever its source moves: its copy
engine *rides* the source's (:meth:`~asynccache.transfers.engine.CopyEngine.add_rider`), and
every copy submitted to the source copies the same slots of the sidecar too, in the same
handle.

* :class:`SidecarSpec`: what a sidecar is (name, source pool, per-token shape and dtype,
  layers, hit policy); validated on construction (:class:`ConfigError` naming the bad value).
* :class:`SidecarShape` / :class:`SidecarPool`: the pool, ``(layers, slots, *token_shape)``,
  seen by the copy engine as ``(layers, 1, pages, page elements)`` page views (as
  :class:`~asynccache.transfers.hybrid_pools.StatePages` does for Mamba states), so copies use
  the machinery of KV pages: fences, the staging ring, host-page ordering, layer-wise loads.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal, TypeAlias

import torch

from asynccache.errors import ConfigError, InvalidInputError
from asynccache.transfers.allocator import PageAllocator, positive_int
from asynccache.transfers.indices import as_slot_array
from asynccache.transfers.pools import KVPool, parse_dtype, register_host_memory

SourcePool: TypeAlias = Literal["kv", "swa", "mamba"]
HitPolicy: TypeAlias = Literal["all_pages", "trailing_pages"]

SOURCES: Final = ("kv", "swa", "mamba")
HIT_POLICIES: Final = ("all_pages", "trailing_pages")
#: Names a sidecar cannot take (the pools and storage objects of the cache itself).
RESERVED_NAMES: Final = frozenset({"kv", "full", "swa", "mamba"})
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


@dataclass(frozen=True, slots=True)
class SidecarSpec:
    """One sidecar pool.

    ``name``: its name (lowercase letters, digits, ``_``; storage objects are
    ``<page key>.<name>``). ``source``: the pool whose slot indices it shares (``"kv"``,
    ``"swa"`` or ``"mamba"``). ``token_shape`` / ``dtype``: one slot's data in one layer.
    ``num_layers``: its layers (a layered sidecar loads back layer by layer).
    ``hit_policy``: how a storage prefetch treats it: ``"all_pages"`` (needed for every page;
    with a ``"kv"`` source a prefetch keeps the longest prefix whose KV *and* sidecar pages
    arrived) or ``"trailing_pages"`` (all or nothing: a missing sidecar object discards the
    prefetch). ``host_slots``: its host pool (None: the source's host capacity; fewer is a
    :class:`ConfigError`).
    """

    name: str
    source: SourcePool = "kv"
    token_shape: tuple[int, ...] = (1,)
    dtype: torch.dtype | str = torch.float16
    num_layers: int = 1
    hit_policy: HitPolicy = "all_pages"
    host_slots: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name) or (
                self.name in RESERVED_NAMES):
            raise ConfigError(
                f"sidecar name {self.name!r} must be 1-32 lowercase letters, digits or '_' "
                f"(starting with a letter), not one of {sorted(RESERVED_NAMES)}")
        if self.source not in SOURCES:
            raise ConfigError(f"sidecar {self.name!r}: unknown source pool {self.source!r}; "
                              f"expected one of {list(SOURCES)}")
        if self.hit_policy not in HIT_POLICIES:
            raise ConfigError(f"sidecar {self.name!r}: unknown hit_policy {self.hit_policy!r}; "
                              f"expected one of {list(HIT_POLICIES)}")
        shape = self.token_shape
        if isinstance(shape, int) and not isinstance(shape, bool):
            shape = (shape,)
        if not isinstance(shape, tuple | list) or not shape:
            raise ConfigError(f"sidecar {self.name!r}: token_shape must be a non-empty tuple "
                              f"of positive ints, got {self.token_shape!r}")
        object.__setattr__(self, "token_shape",
                           tuple(positive_int(d, f"sidecar {self.name!r} token_shape")
                                 for d in shape))
        try:
            object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        except ConfigError as exc:
            raise ConfigError(f"sidecar {self.name!r}: {exc}") from None
        object.__setattr__(self, "num_layers",
                           positive_int(self.num_layers, f"sidecar {self.name!r} num_layers"))
        if self.host_slots is not None:
            object.__setattr__(self, "host_slots",
                               positive_int(self.host_slots, f"sidecar {self.name!r} host_slots"))

    @property
    def clamps(self) -> bool:
        """A prefetch may keep a shorter prefix for it (KV-derived, needed for every page)."""
        return self.source == "kv" and self.hit_policy == "all_pages"

    @property
    def shape(self) -> SidecarShape:
        return SidecarShape(self.num_layers, self.token_shape, self.dtype)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class SidecarShape:
    """A sidecar pool's geometry: ``num_layers`` x ``token_shape`` of ``dtype`` per slot."""

    num_layers: int
    token_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def token_elements(self) -> int:
        return math.prod(self.token_shape)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one slot over all layers."""
        return self.num_layers * self.token_elements * self.itemsize

    def bytes_per_page(self, page_size: int) -> int:
        return self.bytes_per_token * page_size


class SidecarPool(KVPool):
    """``(num_layers, num_slots, *token_shape)`` of ``dtype``, zero-filled, with page views
    for the copy engine (see the module docstring). Its allocator only checks slot indices
    (slots are handed out by the source pool's allocator)."""

    kind: ClassVar[str] = "pool"
    shape: SidecarShape  # type: ignore[assignment]  # (a KVPool's is a KVShape)

    def __init__(self, shape: SidecarShape, num_slots: int, page_size: int, *,
                 device: torch.device | str = "cpu", pin_memory: bool = False) -> None:
        # No KVPool.__init__: its tensor has the KV layout.
        num_slots = positive_int(num_slots, "num_slots")
        page_size = positive_int(page_size, "page_size")
        if num_slots % page_size:
            raise ConfigError(f"a sidecar pool of {num_slots} slots is not whole pages of "
                              f"{page_size}")
        self.allocator = PageAllocator(num_slots, page_size)
        self.shape = shape
        self.page_size = page_size
        self.num_slots = num_slots
        self.num_pages = num_slots // page_size
        self.layout = "layer_first"
        self.device = torch.device(device)
        self.pinned = pin_memory
        dims = (shape.num_layers, num_slots, *shape.token_shape)
        try:
            data = torch.zeros(dims, dtype=shape.dtype, device=self.device)
        except (RuntimeError, MemoryError) as exc:
            raise ConfigError(f"cannot allocate a {self.kind} sidecar pool of {num_slots} slots "
                              f"({num_slots * shape.bytes_per_token} bytes) on {self.device}: "
                              f"{exc}") from exc
        if pin_memory:
            register_host_memory(data)
        self.kv = self.data = data
        self._page_view = data.view(shape.num_layers, 1, self.num_pages,
                                    page_size * shape.token_elements)

    def layer(self, i: int) -> torch.Tensor:
        """Layer ``i`` as ``(num_slots, *token_shape)`` (a view: writing it writes the pool)."""
        return self.data[i]

    def read_slots(self, indices: Any) -> torch.Tensor:
        """A copy of the data of slots ``indices`` (any slots, in order) as
        ``(num_layers, n, *token_shape)``."""
        slots = as_slot_array(indices, name="indices")
        if slots.shape[0] and (int(slots.min()) < 0 or int(slots.max()) >= self.num_slots):
            raise InvalidInputError(f"a slot of {slots.tolist()[:8]} is out of range "
                                    f"[0, {self.num_slots})")
        idx = torch.from_numpy(slots.copy()).to(self.device)
        return self.data.index_select(1, idx)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(shape={self.shape}, slots={self.num_slots}, "
                f"page_size={self.page_size}, device={self.device})")


class DeviceSidecarPool(SidecarPool):
    kind = "device"


class HostSidecarPool(SidecarPool):
    kind = "host"
