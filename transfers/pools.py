"""KV pools: real tensors holding the KV of every slot, each with its own page allocator.

Layouts (``P`` pages of ``page_size`` tokens, ``S = P * page_size`` slots):

* ``layer_first`` (device pools, the default for host pools): ``(L, 2, S, H, D)`` -- what an
  attention kernel wants: ``kv[layer, 0]`` is the K buffer of a layer, ``(S, H, D)``.
* ``page_first`` (host pools only): ``(P, L, 2, page_size, H, D)`` -- all layers of a page are
  one contiguous byte range, so an L3 page is a single buffer (:meth:`HostPool.page_buffer`).

Both layouts expose the same *page views* used by the copy engine: :meth:`KVPool.page_view`
is ``(L, 2, P, R)`` and :meth:`KVPool.layer_page_view` is ``(2, P, R)`` with
``R = page_size * H * D`` elements; for page_first they are strided views of the same memory.

Pools are allocated and touched (zero-filled) once, at construction.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeAlias

import torch

from asynccache.errors import ConfigError, InvalidInputError
from asynccache.logs import get_logger
from asynccache.transfers.allocator import PageAllocator, positive_int

_log = get_logger("asynccache.transfers.pools")

HostLayout: TypeAlias = Literal["layer_first", "page_first"]

_DTYPES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)


def register_host_memory(t: torch.Tensor) -> None:
    """Page-lock the memory of CPU tensor ``t`` in place (``cudaHostRegister`` through
    ``torch.cuda.cudart()``), unregistered when ``t`` is collected.

    Pinning with ``torch.empty(..., pin_memory=True)`` goes through torch's caching host
    allocator, which rounds every allocation up to a power of two: a 65 GiB pool would lock
    128 GiB. Registering a plain allocation locks exactly its bytes. CUDA only: without CUDA
    it raises :class:`ConfigError`.
    """
    if not torch.cuda.is_available():
        raise ConfigError("pinning host memory needs CUDA, which is not available")
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ConfigError("only a contiguous CPU tensor can be registered as pinned memory")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    ptr = t.data_ptr()
    rc = cudart.cudaHostRegister(ptr, nbytes, 0)
    code = int(getattr(rc, "value", rc))
    if code != 0:
        raise ConfigError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {code}")
    weakref.finalize(t, cudart.cudaHostUnregister, ptr)
    _log.debug("host_memory_registered", bytes=nbytes)


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``dtype`` as a supported torch dtype (fp16 / bf16 / fp32), else :class:`ConfigError`."""
    if isinstance(dtype, str):
        key = dtype.lower().removeprefix("torch.")
        if key not in _DTYPES:
            raise ConfigError(f"unknown dtype {dtype!r}; expected one of {sorted(set(_DTYPES))}")
        return _DTYPES[key]
    if isinstance(dtype, torch.dtype) and dtype in SUPPORTED_DTYPES:
        return dtype
    raise ConfigError(f"unsupported dtype {dtype!r}; expected one of {SUPPORTED_DTYPES}")


@dataclass(frozen=True, slots=True)
class KVShape:
    """The per-token KV geometry of a model: layers x (K, V) x heads x head_dim of ``dtype``."""

    num_layers: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "head_dim"):
            object.__setattr__(self, name, positive_int(getattr(self, name), name))
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token_per_layer(self) -> int:
        """Bytes of K and V of one token in one layer."""
        return 2 * self.num_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V of one token over all layers."""
        return self.num_layers * self.bytes_per_token_per_layer

    def bytes_per_page(self, page_size: int) -> int:
        return self.bytes_per_token * page_size


class KVPool:
    """Base of :class:`DevicePool` and :class:`HostPool`: a KV tensor plus its allocator."""

    kind: ClassVar[str] = "pool"

    def __init__(
        self,
        shape: KVShape,
        num_slots: int,
        page_size: int,
        *,
        device: torch.device | str = "cpu",
        layout: HostLayout = "layer_first",
        pin_memory: bool = False,
    ) -> None:
        if not isinstance(shape, KVShape):
            raise ConfigError(f"shape must be a KVShape, got {shape!r}")
        num_slots = positive_int(num_slots, "num_slots")
        page_size = positive_int(page_size, "page_size")
        if layout not in ("layer_first", "page_first"):
            raise ConfigError(f"unknown layout {layout!r}; expected 'layer_first' or 'page_first'")
        self.allocator = PageAllocator(num_slots, page_size)
        self.shape = shape
        self.page_size = page_size
        self.num_slots = num_slots
        self.num_pages = num_slots // page_size
        self.layout: HostLayout = layout
        self.device = torch.device(device)
        self.pinned = pin_memory
        L, H, D = shape.num_layers, shape.num_heads, shape.head_dim
        if layout == "layer_first":
            dims: tuple[int, ...] = (L, 2, num_slots, H, D)
        else:
            dims = (self.num_pages, L, 2, page_size, H, D)
        try:
            # Pinned pools are allocated exactly and registered (see register_host_memory):
            # torch's pinned allocator would round the allocation up to a power of two.
            kv = torch.empty(dims, dtype=shape.dtype, device=self.device)
        except (RuntimeError, MemoryError) as exc:
            raise ConfigError(
                f"cannot allocate a {self.kind} pool of {num_slots} slots "
                f"({num_slots * shape.bytes_per_token} bytes) on {self.device}: {exc}"
            ) from exc
        kv.zero_()  # touch every page now, not on the first copy
        if pin_memory:
            register_host_memory(kv)
        self.kv = kv
        R = page_size * H * D
        if layout == "layer_first":
            self._page_view = kv.view(L, 2, self.num_pages, R)
        else:
            self._page_view = kv.view(self.num_pages, L, 2, R).permute(1, 2, 0, 3)
        _log.debug(
            "pool_allocated",
            kind=self.kind,
            device=str(self.device),
            layout=layout,
            slots=num_slots,
            page_size=page_size,
            bytes=self.nbytes,
            pinned=pin_memory,
        )

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_tokens(cls, shape: KVShape, num_tokens: int, page_size: int, **kwargs: Any) -> Any:
        """A pool of ``num_tokens`` slots rounded down to whole pages (at least one page)."""
        num_tokens = positive_int(num_tokens, "num_tokens")
        page_size = positive_int(page_size, "page_size")
        pages = num_tokens // page_size
        if pages < 1:
            raise ConfigError(
                f"num_tokens={num_tokens} is smaller than one page (page_size={page_size})"
            )
        return cls(shape, pages * page_size, page_size, **kwargs)

    @classmethod
    def from_bytes(cls, shape: KVShape, num_bytes: int, page_size: int, **kwargs: Any) -> Any:
        """The largest pool of whole pages fitting in ``num_bytes`` of KV."""
        num_bytes = positive_int(num_bytes, "num_bytes")
        page_size = positive_int(page_size, "page_size")
        if not isinstance(shape, KVShape):
            raise ConfigError(f"shape must be a KVShape, got {shape!r}")
        page_bytes = shape.bytes_per_page(page_size)
        pages = num_bytes // page_bytes
        if pages < 1:
            raise ConfigError(
                f"num_bytes={num_bytes} is smaller than one page "
                f"({page_bytes} bytes = {page_size} tokens x {shape.bytes_per_token} bytes)"
            )
        return cls(shape, pages * page_size, page_size, **kwargs)

    # ------------------------------------------------------------------ geometry
    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @property
    def page_bytes(self) -> int:
        return self.shape.bytes_per_page(self.page_size)

    def page_view(self) -> torch.Tensor:
        """``(L, 2, P, R)`` view of the pool, the page dimension is 2."""
        return self._page_view

    def layer_page_view(self, layer: int) -> torch.Tensor:
        """``(2, P, R)`` view of one layer, the page dimension is 1."""
        return self._page_view[layer]

    def k_buffer(self, layer: int) -> torch.Tensor:
        """K of one layer as ``(S, H, D)`` (layer_first pools only)."""
        return self._slot_major(layer, 0)

    def v_buffer(self, layer: int) -> torch.Tensor:
        """V of one layer as ``(S, H, D)`` (layer_first pools only)."""
        return self._slot_major(layer, 1)

    def _slot_major(self, layer: int, kv_index: int) -> torch.Tensor:
        if self.layout != "layer_first":
            raise InvalidInputError("per-layer K/V buffers need a layer_first pool")
        return self.kv[layer, kv_index]

    def read_slots(self, indices: Any) -> torch.Tensor:
        """A copy of the KV of ``indices`` as ``(L, 2, n, H, D)`` (for tests and debugging)."""
        pages = self.allocator.pages_of(indices)
        idx = torch.from_numpy(pages).to(self.device)
        L, H, D = self.shape.num_layers, self.shape.num_heads, self.shape.head_dim
        out = torch.index_select(self._page_view, 2, idx)
        return out.reshape(L, 2, pages.shape[0] * self.page_size, H, D)

    def _page_index(self, first_slot: int) -> int:
        if isinstance(first_slot, bool) or not isinstance(first_slot, int):
            try:
                first_slot = int(first_slot)  # numpy / torch scalars
            except (TypeError, ValueError):
                raise InvalidInputError(f"first_slot must be an int, got {first_slot!r}") from None
        if first_slot < 0 or first_slot >= self.num_slots or first_slot % self.page_size:
            raise InvalidInputError(
                f"first_slot={first_slot} is not the first slot of a page "
                f"(page_size={self.page_size}, slots={self.num_slots})"
            )
        return first_slot // self.page_size

    def read_page(self, first_slot: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The bytes of one page, all layers, in page_first order ``(L, 2, page_size, H, D)``.

        Returns a uint8 CPU tensor of :attr:`page_bytes` bytes (``out`` when given).
        """
        page = self._page_index(first_slot)
        if out is None:
            out = torch.empty(self.page_bytes, dtype=torch.uint8)
        elif out.dtype != torch.uint8 or out.numel() != self.page_bytes:
            raise InvalidInputError(
                f"out must be a uint8 tensor of {self.page_bytes} bytes, "
                f"got {out.dtype} x {out.numel()}"
            )
        src = self._page_view.select(2, page)  # (L, 2, R)
        out.view(self.shape.dtype).view(src.shape).copy_(src)
        return out

    def write_page(self, first_slot: int, data: torch.Tensor) -> None:
        """Overwrite one page from bytes laid out as :meth:`read_page` returns them."""
        page = self._page_index(first_slot)
        if data.dtype != torch.uint8 or data.numel() != self.page_bytes:
            raise InvalidInputError(
                f"data must be a uint8 tensor of {self.page_bytes} bytes, "
                f"got {data.dtype} x {data.numel()}"
            )
        dst = self._page_view.select(2, page)
        dst.copy_(data.reshape(-1).view(self.shape.dtype).view(dst.shape))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(shape={self.shape}, slots={self.num_slots}, "
            f"page_size={self.page_size}, layout={self.layout!r}, device={self.device})"
        )


class DevicePool(KVPool):
    """The L1 pool: on CUDA when available (or ``device``), else CPU tensors. layer_first."""

    kind = "device"

    def __init__(
        self,
        shape: KVShape,
        num_slots: int,
        page_size: int,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"unknown device {device!r}") from exc
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device={device!r} but CUDA is not available")
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        super().__init__(shape, num_slots, page_size, device=dev, layout="layer_first")


class HostPool(KVPool):
    """The L2 pool in host RAM, pinned when CUDA is available; layer_first or page_first."""

    kind = "host"

    def __init__(
        self,
        shape: KVShape,
        num_slots: int,
        page_size: int,
        *,
        layout: HostLayout = "layer_first",
        pin_memory: bool | None = None,
    ) -> None:
        cuda = torch.cuda.is_available()
        if pin_memory is None:
            pin_memory = cuda
        elif pin_memory and not cuda:
            raise ConfigError("pin_memory=True needs CUDA, which is not available")
        super().__init__(
            shape, num_slots, page_size, device="cpu", layout=layout, pin_memory=bool(pin_memory)
        )

    def page_buffer(self, first_slot: int) -> torch.Tensor:
        """One page, all layers, as a contiguous uint8 view into the pool (page_first only).

        Writing to the view writes the pool: storage backends read and fill pages in place.
        """
        if self.layout != "page_first":
            raise InvalidInputError(
                "page_buffer needs a page_first host pool; use read_page / write_page instead"
            )
        page = self._page_index(first_slot)
        return self.kv[page].view(-1).view(torch.uint8)
