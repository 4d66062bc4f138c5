"""Byte segments of a direct-DMA piece, and the copies that move them.

The staged worker's direct path (:mod:`asynccache.transfers.staged`) moves a piece as a list
of *segments* ``(host offset, device offset, bytes)`` between a page_first host pool (each page
one contiguous block) and the device side of a staging slot, which holds the piece page-major.
:func:`segments` computes them (numpy, no tensors); a :class:`SegmentCopier` issues them:

* on CUDA, one ``cudaMemcpyAsync`` per segment on the copy stream, called through ``ctypes`` on
  the CUDA runtime torch itself loaded (measured on an H200: a ``copy_`` of two tensor slices
  costs ~15 µs of Python per DMA, which bounds 256 KiB copies to ~12 GB/s of a 54 GB/s
  link; the raw call costs a few µs);
* elsewhere (CPU pools in tests, or no runtime found), the same segments as ``copy_`` between
  flat byte views -- the offsets the GPU uses are the ones the CPU tests check.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

from asynccache.logs import get_logger
from asynccache.transfers.plan import runs

_log = get_logger("asynccache.transfers.dma")

#: cudaMemcpyDefault: the direction follows from the pointers (unified addressing).
_MEMCPY_DEFAULT = 4

_runtime: Any = None  # the ctypes handle, False once looked for and not found


def segments(host_pages: np.ndarray, layers: tuple[int, int], num_layers: int,
             layer_page_bytes: int) -> list[tuple[int, int, int]]:
    """``(host offset, slot offset, bytes)`` of the layers ``[a, b)`` of ``host_pages``
    (page_first host pool: page ``p`` at ``p * num_layers * layer_page_bytes``; slot: the
    pages one after the other, ``(b - a) * layer_page_bytes`` each). Whole pages: one segment
    per run of consecutive host pages; a layer group: one per page."""
    a, b = layers
    seg = (b - a) * layer_page_bytes
    page = num_layers * layer_page_bytes
    if b - a == num_layers:
        whole = runs(host_pages)
        assert whole is not None
        return [(first * page, i * seg, length * seg) for i, first, length in whole]
    offs = (host_pages.astype(np.int64) * page + a * layer_page_bytes).tolist()
    return [(h, i * seg, seg) for i, h in enumerate(offs)]


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
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        _log.debug("cuda_runtime_found", path=name)
        break
    else:
        lib = None
        _log.warning("cuda_runtime_not_found", fallback="torch copy_ per segment")
    _runtime = lib if lib is not None else False
    return lib


class SegmentCopier:
    """Issues segments between one host byte tensor and device byte buffers (see the module
    docstring). ``raw``: use ``cudaMemcpyAsync`` (CUDA only; default: when the runtime is
    found)."""

    def __init__(self, host: torch.Tensor, cuda: bool, raw: bool | None = None) -> None:
        if host.dtype != torch.uint8 or not host.is_contiguous():
            raise ValueError("the host side must be a contiguous uint8 tensor")
        self.host = host.view(-1)
        lib = _find_runtime() if cuda and raw is not False else None
        self._memcpy = lib.cudaMemcpyAsync if lib is not None else None
        self._lib: Any = lib
        self.raw = self._memcpy is not None

    def copy(self, segs: list[tuple[int, int, int]], dev: torch.Tensor, to_host: bool,
             stream: Any) -> None:
        """Queue ``segs`` between ``self.host`` and ``dev`` (a flat uint8 buffer) on
        ``stream`` (the current stream; a CUDA stream when raw)."""
        if self._memcpy is None:
            host = self.host
            for h, d, n in segs:
                if to_host:
                    host[h : h + n].copy_(dev[d : d + n], non_blocking=True)
                else:
                    dev[d : d + n].copy_(host[h : h + n], non_blocking=True)
            return
        memcpy, kind, handle = self._memcpy, _MEMCPY_DEFAULT, stream.cuda_stream
        hp, dp = self.host.data_ptr(), dev.data_ptr()
        for h, d, n in segs:
            rc = (memcpy(hp + h, dp + d, n, kind, handle) if to_host
                  else memcpy(dp + d, hp + h, n, kind, handle))
            if rc:
                msg = self._lib.cudaGetErrorString(rc).decode(errors="replace")
                raise RuntimeError(f"cudaMemcpyAsync of {n} bytes failed: CUDA error {rc} "
                                   f"({msg})")
