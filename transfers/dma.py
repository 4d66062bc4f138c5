"""Byte segments of a direct-DMA piece, and the copies that move them.

The staged worker's direct path (:mod:`asynccache.transfers.staged`) moves a piece as a list
of *segments* between a pinned host pool and the device side of a staging slot. A segment is
``(host offset, slot offset, width, rows, host pitch, slot pitch)``: ``rows`` rows of
``width`` bytes, each row ``host pitch`` / ``slot pitch`` bytes after the one before (a plain
contiguous copy has one row). One segment per run of consecutive host pages, whatever the
layout and the layer range:

* :func:`page_first_segments`: the host pool holds each page as one block ``(L, KV, R)``; the
  slot holds the piece page-major ``(n, layers, KV, R)``. Whole pages: one row per run; a
  layer group: one row per page of the run (the group's bytes of each page);
* :func:`layer_first_segments`: the host pool is ``(L, KV, P, R)``, each (layer, K/V) row of
  pages contiguous; the slot holds the piece the same way, ``(layers, KV, n, R)``: one row per
  (layer, K/V) of the range, ``run length x R`` bytes each.

A piece can also move with no DMA at all (*zero-copy*): one gather kernel reads the piece's host
pages straight over the link into the slot (H->D), or one scatter kernel writes the slot straight
into them (D->H), through :func:`device_alias`, a CUDA tensor over the pinned pool's own bytes
(:func:`zero_copy_views`). One kernel per piece whatever the fragmentation: measured on an H200,
random pages of 64 KiB ... 2 MiB move at 0.85-0.89 of the pinned ``copy_`` peak that way, where a
DMA per page costs ~12-19 µs of issuing each.

A :class:`SegmentCopier` issues segments:

* on CUDA, one ``cudaMemcpyAsync`` (one row) or ``cudaMemcpy2DAsync`` (several) per segment
  on the copy stream, called through ``ctypes`` on the CUDA runtime torch itself loaded
  (measured on an H200: a ``copy_`` of two tensor slices costs ~15 µs of Python per DMA, which
  bounds 256 KiB copies to ~12 GB/s of a 54 GB/s link; the raw call costs a few µs);
* elsewhere (CPU pools in tests, or no runtime found), the same segments as ``copy_`` between
  strided byte views -- the offsets and pitches the GPU uses are the ones the CPU tests check.
"""

from __future__ import annotations

import ctypes
from typing import Any, TypeAlias

import numpy as np
import torch

from asynccache.logs import get_logger
from asynccache.transfers.plan import runs

_log = get_logger("asynccache.transfers.dma")

#: cudaMemcpyDefault: the direction follows from the pointers (unified addressing).
_MEMCPY_DEFAULT = 4

_runtime: Any = None  # the ctypes handle, False once looked for and not found

#: (host offset, slot offset, width, rows, host pitch, slot pitch), in bytes.
Segment: TypeAlias = tuple[int, int, int, int, int, int]


def _runs(host_pages: np.ndarray) -> list[tuple[int, int, int]]:
    found = runs(host_pages)
    assert found is not None
    return found


def page_first_segments(host_pages: np.ndarray, layers: tuple[int, int], num_layers: int,
                        layer_page_bytes: int) -> list[Segment]:
    """The layers ``[a, b)`` of ``host_pages`` of a page_first pool (page ``p`` at ``p *
    num_layers * layer_page_bytes``) to / from a slot holding them page-major, ``(b - a) *
    layer_page_bytes`` bytes a page: one segment per run of consecutive host pages."""
    a, b = layers
    seg = (b - a) * layer_page_bytes
    page = num_layers * layer_page_bytes
    if b - a == num_layers:  # whole pages: a run is one contiguous block on both sides
        return [(first * page, i * seg, length * seg, 1, length * seg, length * seg)
                for i, first, length in _runs(host_pages)]
    return [(first * page + a * layer_page_bytes, i * seg, seg, length, page, seg)
            for i, first, length in _runs(host_pages)]


def layer_first_segments(host_pages: np.ndarray, layers: tuple[int, int], kv: int,
                         row_bytes: int, host_num_pages: int) -> list[Segment]:
    """The layers ``[a, b)`` of ``host_pages`` of a layer_first pool ``(L, kv, P, R)`` (``R =
    row_bytes`` a page and K/V half) to / from a slot holding them as ``(b - a, kv, n, R)``:
    one segment per run of consecutive host pages, a row per (layer, K/V)."""
    a, b = layers
    n = int(host_pages.shape[0])
    host_pitch, slot_pitch = host_num_pages * row_bytes, n * row_bytes
    base = a * kv * host_pitch
    return [(base + first * row_bytes, i * row_bytes, length * row_bytes, (b - a) * kv,
             host_pitch, slot_pitch) for i, first, length in _runs(host_pages)]


def _find_runtime() -> Any:
    """The CUDA runtime library torch loaded (by its path in this process's maps, so that
    no second copy is loaded), with ``cudaMemcpyAsync`` typed; None if not found."""
    global _runtime
    if _runtime is not None:
        return _runtime or None
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:  # address perms offset dev inode [path]
                fields = line.split()
                path = fields[5] if len(fields) > 5 else ""
                if "libcudart.so" in path and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    lib = None
    for name in (*paths, "libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name)
            fn = lib.cudaMemcpyAsync
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                       ctypes.c_void_p]
        fn.restype = ctypes.c_int
        # cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream)
        fn2d = lib.cudaMemcpy2DAsync
        fn2d.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                         ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        fn2d.restype = ctypes.c_int
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        _log.debug("cuda_runtime_found", path=name)
        break
    else:
        lib = None
        _log.warning("cuda_runtime_not_found", fallback="torch copy_ per segment")
    _runtime = lib if lib is not None else False
    return lib


#: A direct piece whose DMA segments average fewer bytes than this moves zero-copy instead
#: (one kernel) when the engine is left to choose: a DMA costs ~15 µs of issuing on an H200,
#: the link moves 1 MiB in ~19 µs.
ZERO_COPY_BELOW = 1 << 20


def run_count(host_pages: np.ndarray) -> int:
    """How many runs of consecutive pages ``host_pages`` holds: the DMA segments of a piece."""
    n = int(host_pages.shape[0])
    return 0 if n == 0 else 1 + int(np.count_nonzero(np.diff(host_pages) != 1))


def prefers_zero_copy(segments: int, nbytes: int) -> bool:
    """Whether a piece of ``nbytes`` that DMA would move as ``segments`` copies moves faster
    as one zero-copy kernel (see :data:`ZERO_COPY_BELOW`): several segments of small average
    size."""
    return segments > 1 and nbytes < ZERO_COPY_BELOW * segments


def device_alias(host: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over the bytes of ``host``, a contiguous tensor in pinned (page-locked,
    registered) memory: no copy; kernels that read or write it cross the link. Unified
    addressing gives registered host memory the same address on the device; torch checks the
    pointer is registered (else it raises). The alias does not keep ``host`` alive."""
    if host.device.type != "cpu" or not host.is_contiguous():
        raise ValueError("only a contiguous CPU tensor can be aliased on the device")

    class _Pinned:
        __cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": np.dtype(str(host.dtype).removeprefix("torch.")).str,
            "data": (host.data_ptr(), False),
            "version": 3,
            "strides": None,
        }

    return torch.as_tensor(_Pinned(), device="cuda")


def as_words(t: torch.Tensor) -> torch.Tensor:
    """``t`` (uint8, last dim contiguous) viewed as the widest integers its rows allow: index
    kernels move an element per thread, so bytes run ~8x slower than 8-byte words (an H200's
    gather of 16 MiB pages-worth of bytes: 110 µs)."""
    width = int(t.shape[-1])
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if width % size == 0 and t.storage_offset() % size == 0 and all(
                st % size == 0 for st in t.stride()[:-1]):
            return t.view(dtype)
    return t


def zero_copy_views(host: torch.Tensor, stage: torch.Tensor, page_first: bool,
                    layers: tuple[int, int], kv: int, rb: int) -> tuple[torch.Tensor,
                                                                        torch.Tensor, int]:
    """(host side, slot side, page dim) of a zero-copy piece, as integer words: ``host`` is
    the pool's bytes in memory order (page_first ``(P, L, KV, rb)``, layer_first ``(L, KV,
    P, rb)``; on CUDA its :func:`device_alias`), ``stage`` the slot's device bytes holding the
    piece in the same order (page_first ``(n, layers, KV * rb)``, layer_first ``(layers, KV,
    n, rb)``); the host pages are indexed along the page dim. H->D: ``index_select(host,
    dim, pages, out=stage)``; D->H: ``host.index_copy_(dim, pages, stage)``."""
    a, b = layers
    if page_first:
        num_pages = int(host.shape[0])
        side = host.view(num_pages, -1, kv * rb)[:, a:b]
        return as_words(side), as_words(stage.view(-1, b - a, kv * rb)), 0
    return as_words(host[a:b]), as_words(stage), 2


class SegmentCopier:
    """Issues segments between one host byte tensor and device byte buffers (see the module
    docstring). ``raw``: use the CUDA runtime's copies (CUDA only; default: when the runtime
    is found)."""

    def __init__(self, host: torch.Tensor, cuda: bool, raw: bool | None = None) -> None:
        if host.dtype != torch.uint8 or not host.is_contiguous():
            raise ValueError("the host side must be a contiguous uint8 tensor")
        self.host = host.view(-1)
        lib = _find_runtime() if cuda and raw is not False else None
        self._lib: Any = lib
        self.raw = lib is not None

    def copy(self, segs: list[Segment], dev: torch.Tensor, to_host: bool, stream: Any) -> None:
        """Queue ``segs`` between ``self.host`` and ``dev`` (a flat uint8 buffer) on
        ``stream`` (the current stream; a CUDA stream when raw)."""
        if self._lib is None:
            host = self.host
            for h, d, width, rows, hp, dp in segs:
                hv = host[h : h + (rows - 1) * hp + width].as_strided((rows, width), (hp, 1))
                dv = dev[d : d + (rows - 1) * dp + width].as_strided((rows, width), (dp, 1))
                if to_host:
                    hv.copy_(dv, non_blocking=True)
                else:
                    dv.copy_(hv, non_blocking=True)
            return
        memcpy, memcpy2d = self._lib.cudaMemcpyAsync, self._lib.cudaMemcpy2DAsync
        kind, handle = _MEMCPY_DEFAULT, stream.cuda_stream
        hptr, dptr = self.host.data_ptr(), dev.data_ptr()
        for h, d, width, rows, hp, dp in segs:
            dst, dpitch, src, spitch = ((hptr + h, hp, dptr + d, dp) if to_host
                                        else (dptr + d, dp, hptr + h, hp))
            if rows == 1:
                rc = memcpy(dst, src, width, kind, handle)
            else:
                rc = memcpy2d(dst, dpitch, src, spitch, width, rows, kind, handle)
            if rc:
                msg = self._lib.cudaGetErrorString(rc).decode(errors="replace")
                raise RuntimeError(f"DMA of {rows} x {width} bytes failed: CUDA error {rc} "
                                   f"({msg})")
