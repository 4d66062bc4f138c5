"""Copy plans: how to move a list of pages between two page views with few copy calls.

A plan sorts the (source page, destination page) pairs by destination and cuts them into
*segments*: maximal stretches where the destination pages **and** the source pages are
consecutive. A segment is one strided copy, whatever its length; pairs that line up with no
neighbour are segments of one page. (Sorting by source would find the same segments: a segment
is a set of pairs ``(s + i, d + i)``, adjacent in either order.)

On CPU tensors the copies are numpy assignments on byte views: single-threaded memcpy-speed
loops that release the GIL, so two threads can run two parts of one plan at once
(:meth:`CopyPlan.copy_part` copies the pairs at positions ``[lo, hi)`` of the sorted order, for
a range of layers). Measured on the 2-core box (``scripts/bench_transfers.py --strategies``),
this beats the torch alternatives *when issued from worker threads*: ``index_select(out=)`` and
per-page ``copy_`` open an OpenMP parallel region per call, and a second OpenMP team (the
worker's, next to the main thread's) pays a fork/join cost that halves their throughput;
"gather into contiguous staging, then ``index_copy_``" pays two passes plus a slow scatter.
See ``docs/transfers.md``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asynccache.errors import InvalidInputError


@dataclass(frozen=True, slots=True)
class Segment:
    """``length`` pages: source ``src_start + i`` -> destination ``dst_start + i``."""

    dst_start: int
    src_start: int
    length: int


def as_numpy_bytes(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's bytes (the last dimension in bytes; bf16 included)."""
    return t.view(torch.uint8).numpy()


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """Segments in destination order; ``starts[i]`` is the position of segment ``i``'s first pair."""

    num_pages: int
    segments: tuple[Segment, ...]
    starts: tuple[int, ...]

    def execute(self, src: torch.Tensor, dst: torch.Tensor, dim: int) -> None:
        """Copy along page dimension ``dim`` of two same-shaped page views (last dim stride 1)."""
        if not self.segments:
            return
        lead: tuple[Any, ...] = (slice(None),) * dim
        if src.device.type != "cpu" or dst.device.type != "cpu":
            for seg in self.segments:
                dst.narrow(dim, seg.dst_start, seg.length).copy_(
                    src.narrow(dim, seg.src_start, seg.length)
                )
            return
        self._copy(as_numpy_bytes(src), as_numpy_bytes(dst), lead, 0, self.num_pages)

    def copy_part(
        self, src: np.ndarray, dst: np.ndarray, layers: slice, lo: int, hi: int
    ) -> None:
        """Copy the pairs at sorted positions ``[lo, hi)`` for ``layers`` of two numpy byte
        views shaped ``(L, 2, P, R)`` (the page dimension is 2)."""
        self._copy(src, dst, (layers, slice(None)), lo, hi)

    def _copy(self, s_np: np.ndarray, d_np: np.ndarray, lead: tuple[Any, ...],
              lo: int, hi: int) -> None:
        starts, segs = self.starts, self.segments
        k = bisect.bisect_right(starts, lo) - 1
        while k < len(segs) and starts[k] < hi:
            seg, first = segs[k], starts[k]
            a = max(lo, first) - first
            b = min(hi, first + seg.length) - first
            d0, s0 = seg.dst_start + a, seg.src_start + a
            d_np[(*lead, slice(d0, d0 + b - a))] = s_np[(*lead, slice(s0, s0 + b - a))]
            k += 1


def _by_destination(src_pages: np.ndarray, dst_pages: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(destinations ascending, their sources, steps between destinations) of two page lists
    of at least two pairs; :class:`InvalidInputError` when a destination page repeats."""
    step = np.diff(dst_pages)
    if (step > 0).all():
        return dst_pages, src_pages, step
    order = np.argsort(dst_pages, kind="stable")
    d, s = dst_pages[order], src_pages[order]
    step = np.diff(d)
    if not step.all():
        dup = int(d[int(np.flatnonzero(step == 0)[0])])
        raise InvalidInputError(f"destination page {dup} appears twice in one copy")
    return d, s, step


#: Up to this many pairs, check_pairs looks for a repeated destination with a Python set.
_SET_CHECK_MAX = 512


def check_pairs(src_pages: np.ndarray, dst_pages: np.ndarray) -> None:
    """What :func:`make_plan` checks (equal lengths, no destination page twice), without
    building the plan (the direct copy path moves pages by index and needs none)."""
    n = int(dst_pages.shape[0])
    if int(src_pages.shape[0]) != n:
        raise InvalidInputError(f"source has {src_pages.shape[0]} pages but destination has {n}")
    if n <= 1:
        return
    # a set of a few hundred ints costs less than numpy's calls
    if n <= _SET_CHECK_MAX and len(set(dst_pages.tolist())) == n:
        return
    _by_destination(src_pages, dst_pages)  # sorts, and names the repeated page


def make_plan(src_pages: np.ndarray, dst_pages: np.ndarray) -> CopyPlan:
    """Plan copying page ``src_pages[i]`` to page ``dst_pages[i]`` for every ``i``.

    Raises :class:`InvalidInputError` when lengths differ or a destination page repeats.
    """
    n = int(dst_pages.shape[0])
    if int(src_pages.shape[0]) != n:
        raise InvalidInputError(f"source has {src_pages.shape[0]} pages but destination has {n}")
    if n == 0:
        return CopyPlan(0, (), ())
    if n == 1:
        return CopyPlan(1, (Segment(int(dst_pages[0]), int(src_pages[0]), 1),), (0,))
    d, s, step = _by_destination(src_pages, dst_pages)
    cuts = np.flatnonzero((step != 1) | (np.diff(s) != 1)) + 1
    starts = np.concatenate(([0], cuts))
    lengths = np.diff(np.concatenate((starts, [n])))
    segments = tuple(
        Segment(dd, ss, ln)
        for dd, ss, ln in zip(d[starts].tolist(), s[starts].tolist(), lengths.tolist(),
                              strict=True)
    )
    return CopyPlan(n, segments, tuple(starts.tolist()))


def runs(ids: np.ndarray, most: int | None = None) -> list[tuple[int, int, int]] | None:
    """``ids`` as runs of consecutive ids, in order: (position in ``ids``, first id, length);
    None when there would be more than ``most`` runs (nothing of that size is built)."""
    n = int(ids.shape[0])
    if n == 0:
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    if most is not None and len(breaks) >= most:
        return None
    starts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), n]
    return [(a, int(ids[a]), b - a) for a, b in zip(starts, ends, strict=True)]


def identity_pages(n: int) -> np.ndarray:
    """Pages ``0 .. n-1`` (a contiguous staging buffer seen as a page view)."""
    return np.arange(n, dtype=np.int64)
