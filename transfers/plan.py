"""Copy plans: how to move a list of pages between two page views with few copy calls.

A plan sorts the (source page, destination page) pairs by destination and cuts them into
*runs* of consecutive destination pages. A run whose sources are consecutive too is a single
strided copy; any other run is copied page by page.

On CPU tensors the copies are numpy assignments on byte views: single-threaded memcpy-speed
loops that release the GIL, issued from the engine's worker thread. Measured on the 2-core box
(``scripts/bench_transfers.py --strategies``), this beats the torch alternatives *when issued
from a worker thread*: ``index_select(out=)`` and per-page ``copy_`` open an OpenMP parallel
region per call, and a second OpenMP team (the worker's, next to the main thread's) pays a
fork/join cost that halves their throughput; "gather into contiguous staging, then
``index_copy_``" pays two passes plus a slow scatter. Large contiguous runs go through torch
``copy_`` (one parallel region amortised over many MiB). See ``docs/transfers.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asynccache.errors import InvalidInputError

# A contiguous run at least this large goes through torch copy_ (intra-op threads).
TORCH_RUN_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class Run:
    """``length`` destination pages from ``dst_start``; sources from ``src_start`` or ``sources``."""

    dst_start: int
    length: int
    src_start: int
    sources: tuple[int, ...] | None  # None: src_start .. src_start + length - 1


def _as_numpy_bytes(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's bytes (the last dimension in bytes; bf16 included)."""
    return t.view(torch.uint8).numpy()


@dataclass(frozen=True, slots=True)
class CopyPlan:
    num_pages: int
    runs: tuple[Run, ...]

    def execute(self, src: torch.Tensor, dst: torch.Tensor, dim: int) -> None:
        """Copy along page dimension ``dim`` of two same-shaped page views (last dim stride 1)."""
        if not self.runs:
            return
        if src.device.type != "cpu" or dst.device.type != "cpu":
            self._execute_torch(src, dst, dim)
            return
        s_np, d_np = _as_numpy_bytes(src), _as_numpy_bytes(dst)
        page_bytes = src.select(dim, 0).numel() * src.element_size()
        lead: tuple[Any, ...] = (slice(None),) * dim
        for run in self.runs:
            d0, k = run.dst_start, run.length
            if run.sources is None:
                if k * page_bytes >= TORCH_RUN_BYTES:
                    dst.narrow(dim, d0, k).copy_(src.narrow(dim, run.src_start, k))
                else:
                    s0 = run.src_start
                    d_np[(*lead, slice(d0, d0 + k))] = s_np[(*lead, slice(s0, s0 + k))]
            else:
                for j, s in enumerate(run.sources):
                    d_np[(*lead, d0 + j)] = s_np[(*lead, s)]

    def _execute_torch(self, src: torch.Tensor, dst: torch.Tensor, dim: int) -> None:
        for run in self.runs:
            out = dst.narrow(dim, run.dst_start, run.length)
            if run.sources is None:
                out.copy_(src.narrow(dim, run.src_start, run.length))
            else:
                idx = torch.tensor(run.sources, dtype=torch.int64, device=src.device)
                torch.index_select(src, dim, idx, out=out)


def make_plan(src_pages: np.ndarray, dst_pages: np.ndarray) -> CopyPlan:
    """Plan copying page ``src_pages[i]`` to page ``dst_pages[i]`` for every ``i``.

    Raises :class:`InvalidInputError` when lengths differ or a destination page repeats.
    """
    n = int(dst_pages.shape[0])
    if int(src_pages.shape[0]) != n:
        raise InvalidInputError(f"source has {src_pages.shape[0]} pages but destination has {n}")
    if n == 0:
        return CopyPlan(0, ())
    if n == 1:
        return CopyPlan(1, (Run(int(dst_pages[0]), 1, int(src_pages[0]), None),))
    step = np.diff(dst_pages)
    if (step > 0).all():
        d, s = dst_pages, src_pages
    else:
        order = np.argsort(dst_pages, kind="stable")
        d, s = dst_pages[order], src_pages[order]
        step = np.diff(d)
        if not step.all():
            dup = int(d[int(np.flatnonzero(step == 0)[0])])
            raise InvalidInputError(f"destination page {dup} appears twice in one copy")
    cuts = np.flatnonzero(step != 1) + 1
    starts = np.concatenate(([0], cuts)).tolist()
    ends = np.concatenate((cuts, [n])).tolist()
    # breaks[i] = number of source discontinuities among pairs (0,1) .. (i-1,i)
    breaks = np.concatenate(([0], np.cumsum(np.diff(s) != 1))).tolist()
    d_list = d.tolist()
    s_list = s.tolist()
    runs = []
    for a, b in zip(starts, ends, strict=True):
        if breaks[b - 1] == breaks[a]:
            runs.append(Run(d_list[a], b - a, s_list[a], None))
        else:
            runs.append(Run(d_list[a], b - a, s_list[a], tuple(s_list[a:b])))
    return CopyPlan(n, tuple(runs))


def identity_pages(n: int) -> np.ndarray:
    """Pages ``0 .. n-1`` (a contiguous staging buffer seen as a page view)."""
    return np.arange(n, dtype=np.int64)
