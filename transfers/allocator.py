"""Page allocator: hands out whole pages of slot indices from a fixed pool.

A numpy free stack of page ids plus an "allocated" bitmap; ``alloc`` and ``free`` are a
handful of vectorised numpy calls each (a few microseconds for a thousand tokens). A slot
table (``table[page] == the page's slots``, 8 bytes per slot, far below the KV bytes per slot)
turns "expand pages to slots" into one row gather and "are these whole, in-range pages" into
one gather and a byte comparison.

Pages come back in ascending runs where possible: the stack is initialised so that a fresh
pool hands out pages 0, 1, 2, ... and ``free`` pushes pages so that the next ``alloc`` of the
same size returns them in the same order. Contiguous destination runs let the copy engine
move many pages per copy call.

Not thread-safe: the owner (the cache's event loop) is the only caller.
"""

from __future__ import annotations

import operator

import numpy as np

from asynccache.errors import (
    ConfigError,
    DoubleFreeError,
    InvalidInputError,
    PoolExhaustedError,
)
from asynccache.transfers.indices import SlotIndices, as_slot_array


def positive_int(value: object, name: str) -> int:
    """``value`` as an int > 0, else :class:`ConfigError` naming it."""
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    try:
        ivalue = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(f"{name} must be a positive int, got {value!r}") from None
    if ivalue <= 0:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return ivalue


def _count(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidInputError(f"{name} must be an int, got {value!r}")
    n = int(value)
    if n < 0:
        raise InvalidInputError(f"{name} must be >= 0, got {n}")
    return n


# pages_of at page_size 1: up to this many slots, a table gather and a byte comparison check
# the range faster than a reduction (measured: 0.6 vs 0.9 us at 256 slots, 4.0 vs 1.2 at 4096).
_GATHER_MAX = 512

# pages_of at page_size > 1: requests of at least this many slots are checked in chunks of
# _CHUNK slots gathered into a reused scratch buffer (compared into a reused bool buffer), so the
# check allocates nothing of the request's size. Fresh arrays of that size cost page faults
# whenever malloc hands them out of fresh mmap'd memory: 102,400 slots (page 64) took 1.6 ms with
# a fresh gather and two tobytes copies against 0.06 ms chunked (scripts/bench_allocator.py).
# Below the threshold the one-shot gather is cheaper (fixed costs of the chunk loop).
_CHUNKED_MIN = 8192
_CHUNK = 32768


class PageAllocator:
    """Allocates whole pages of ``page_size`` slots out of ``num_slots`` slots.

    ``num_slots`` must be a positive multiple of ``page_size``. Slot indices are numpy int64
    arrays; ``free`` and :meth:`pages_of` also accept torch integer tensors and lists.
    """

    __slots__ = (
        "_allocated",
        "_arange",
        "_eq_buf",
        "_num_pages",
        "_page_size",
        "_row_buf",
        "_shift",
        "_stack",
        "_stamp",
        "_table",
        "_top",
    )

    def __init__(self, num_slots: int, page_size: int) -> None:
        num_slots = positive_int(num_slots, "num_slots")
        page_size = positive_int(page_size, "page_size")
        if num_slots % page_size:
            raise ConfigError(f"num_slots={num_slots} is not a multiple of page_size={page_size}")
        self._page_size = page_size
        # log2(page_size) when it is a power of two (a shift is cheaper than a division).
        self._shift = page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1
        self._num_pages = num_pages = num_slots // page_size
        # Free stack: the top is the end; initialised descending so page 0 is handed out first.
        self._stack = np.arange(num_pages - 1, -1, -1, dtype=np.int64)
        self._top = num_pages
        self._allocated = np.zeros(num_pages, dtype=np.uint8)
        self._table = np.arange(num_slots, dtype=np.int64).reshape(num_pages, page_size)
        self._arange = np.arange(num_pages, dtype=np.int64)
        # Scratch for duplicate detection in free(): stamp[p] = position of p in the request.
        self._stamp = np.zeros(num_pages, dtype=np.int64)
        # Scratch of pages_of's chunked check (made on first use: small pools never need it).
        self._row_buf: np.ndarray | None = None
        self._eq_buf: np.ndarray | None = None

    # ------------------------------------------------------------------ accounting
    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def total_size(self) -> int:
        """Number of slots managed (free + allocated)."""
        return self._num_pages * self._page_size

    @property
    def available_size(self) -> int:
        """Number of free slots."""
        return self._top * self._page_size

    @property
    def used_size(self) -> int:
        """Number of allocated slots."""
        return (self._num_pages - self._top) * self._page_size

    def __repr__(self) -> str:
        return (
            f"PageAllocator(total_size={self.total_size}, page_size={self._page_size}, "
            f"used_size={self.used_size})"
        )

    # ------------------------------------------------------------------ alloc
    def alloc(self, num_tokens: int, *, raise_if_full: bool = False) -> np.ndarray | None:
        """Allocate ``num_tokens`` slots (a multiple of ``page_size``) as whole pages.

        Returns the slot indices (numpy int64), or ``None`` when not enough slots are free
        (:class:`PoolExhaustedError` instead when ``raise_if_full``).
        """
        n = _count(num_tokens, "num_tokens")
        if n % self._page_size:
            raise InvalidInputError(
                f"num_tokens={n} is not a multiple of page_size={self._page_size}"
            )
        pages = self.alloc_pages(n // self._page_size, raise_if_full=raise_if_full)
        if pages is None:
            return None
        if self._page_size == 1:
            return pages
        return self._table.take(pages, 0).reshape(-1)

    def alloc_pages(self, num_pages: int, *, raise_if_full: bool = False) -> np.ndarray | None:
        """Allocate ``num_pages`` pages; returns page ids (numpy int64) or ``None``."""
        n = _count(num_pages, "num_pages")
        top = self._top
        if n > top:
            if raise_if_full:
                raise PoolExhaustedError(
                    f"cannot allocate {n} pages ({n * self._page_size} slots): "
                    f"only {top} pages free"
                )
            return None
        pages = self._stack[top - n : top][::-1].copy()
        self._allocated[pages] = 1
        self._top = top - n
        return pages

    # ------------------------------------------------------------------ free
    def free(self, indices: SlotIndices) -> None:
        """Return whole pages of slots to the pool.

        Atomic: raises :class:`DoubleFreeError` naming the slot (and frees nothing) when any
        slot is not currently allocated or appears twice; :class:`InvalidInputError` (and
        frees nothing) for slots out of range or not forming whole pages.
        """
        pages = self.pages_of(indices)
        if pages.shape[0]:
            self._free_pages(pages)

    def free_pages(self, pages: SlotIndices) -> None:
        """Return pages (page ids) to the pool; atomic like :meth:`free`."""
        arr = as_slot_array(pages, name="pages")
        if arr.shape[0] == 0:
            return
        # One reduction checks both ends: a negative id is a huge unsigned one.
        if int(arr.view(np.uint64).max()) >= self._num_pages:
            bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
            raise InvalidInputError(f"page {bad} out of range [0, {self._num_pages})")
        self._free_pages(arr)

    def _free_pages(self, pages: np.ndarray) -> None:
        n = pages.shape[0]
        ps = self._page_size
        flags = self._allocated[pages]
        if flags.tobytes() != b"\x01" * n:
            bad = int(pages[int(np.argmin(flags))])
            raise DoubleFreeError(
                f"slot {bad * ps} (page {bad}) is not currently allocated; nothing was freed"
            )
        if n > 1:  # a page twice in one request: the later position wins the stamp
            order = self._arange[:n]
            stamp = self._stamp
            stamp[pages] = order
            seen = stamp[pages]
            if seen.tobytes() != order.tobytes():
                bad = int(pages[int(np.flatnonzero(seen != order)[0])])
                raise DoubleFreeError(
                    f"slot {bad * ps} (page {bad}) appears twice in one free; nothing was freed"
                )
        self._allocated[pages] = 0
        top = self._top
        self._stack[top : top + n] = pages[::-1]
        self._top = top + n

    # ------------------------------------------------------------------ queries
    def pages_of(self, indices: SlotIndices, *, name: str = "indices") -> np.ndarray:
        """Page ids of whole-page slot ``indices`` (in order); validates shape and range.

        Raises :class:`InvalidInputError` naming the first slot that is out of range or
        breaks the "whole pages" rule (``page_size`` consecutive slots from a multiple of it).
        """
        slots = as_slot_array(indices, name=name)
        n = slots.shape[0]
        ps = self._page_size
        if n == 0:
            return slots
        if n % ps:
            raise InvalidInputError(f"{name} has {n} slots, not a multiple of page_size={ps}")
        if ps == 1:
            # Every int64 is a whole page of one slot: only the range needs checking. Large
            # requests check it with one reduction (a negative slot is a huge unsigned one);
            # small ones with the gather below, cheaper than a reduction's fixed cost.
            if n > _GATHER_MAX:
                if int(slots.view(np.uint64).max()) >= self._num_pages:
                    self._raise_bad_slots(slots, name)
                return slots
            pages = slots
        elif self._shift >= 0:
            pages = slots[::ps] >> self._shift
        else:
            pages = slots[::ps] // ps
        if n >= _CHUNKED_MIN and ps > 1:
            if not self._rows_match(pages, slots):
                self._raise_bad_slots(slots, name)
            return pages
        try:
            rows = self._table.take(pages, 0)
        except IndexError:
            rows = None
        # Negative pages wrap in numpy; their table rows then differ from the input slots.
        if rows is None or rows.tobytes() != slots.tobytes():
            self._raise_bad_slots(slots, name)
        return pages

    def _rows_match(self, pages: np.ndarray, slots: np.ndarray) -> bool:
        """Whether ``table[pages]`` equals ``slots``, checked chunk by chunk in reused buffers.

        Out-of-range pages are clipped to a valid row, never an error: a clipped row starts at
        another multiple of ``page_size`` than the slot it came from (``pages`` is that slot
        divided by ``page_size``), so it cannot match and the slots are reported as bad.
        """
        ps = self._page_size
        row_buf, eq_buf = self._row_buf, self._eq_buf
        if row_buf is None or eq_buf is None:
            chunk = max(_CHUNK // ps, 1) * ps
            self._row_buf = row_buf = np.empty(chunk, dtype=np.int64)
            self._eq_buf = eq_buf = np.empty(chunk, dtype=np.bool_)
        rows_per_chunk = row_buf.shape[0] // ps
        table = self._table
        num = pages.shape[0]
        for start in range(0, num, rows_per_chunk):
            part = pages[start : start + rows_per_chunk]
            m = part.shape[0] * ps
            gathered = row_buf[:m]
            table.take(part, 0, out=gathered.reshape(-1, ps), mode="clip")
            eq = eq_buf[:m]
            np.equal(gathered, slots[start * ps : start * ps + m], out=eq)
            if not eq.all():
                return False
        return True

    def is_allocated(self, indices: SlotIndices) -> np.ndarray:
        """Per slot: whether it is currently allocated (bool array, same length)."""
        slots = as_slot_array(indices)
        if slots.shape[0] and (int(slots.min()) < 0 or int(slots.max()) >= self.total_size):
            raise InvalidInputError(
                f"indices out of range [0, {self.total_size}): "
                f"min={int(slots.min())}, max={int(slots.max())}"
            )
        flags: np.ndarray = self._allocated[slots // self._page_size].astype(bool)
        return flags

    def reset(self) -> None:
        """Free everything (the pool is as new)."""
        self._stack[:] = np.arange(self._num_pages - 1, -1, -1, dtype=np.int64)
        self._top = self._num_pages
        self._allocated[:] = 0

    def check_invariants(self) -> None:
        """Verify the free stack and the bitmap agree (for tests; O(num_pages))."""
        free = self._stack[: self._top]
        if np.unique(free).shape[0] != self._top:
            raise AssertionError("free stack holds a page twice")
        if self._allocated[free].any():
            raise AssertionError("a page is both free and allocated")
        if int(self._allocated.sum()) != self._num_pages - self._top:
            raise AssertionError("allocated bitmap does not balance with the free stack")

    def _raise_bad_slots(self, slots: np.ndarray, name: str) -> None:
        total = self.total_size
        out = np.flatnonzero((slots < 0) | (slots >= total))
        if out.shape[0]:
            raise InvalidInputError(
                f"{name} holds slot {int(slots[out[0]])}, out of range [0, {total})"
            )
        ps = self._page_size
        grid = slots.reshape(-1, ps)
        expected = self._table[grid[:, 0] // ps]
        row = int(np.flatnonzero((grid != expected).any(axis=1))[0])
        raise InvalidInputError(
            f"{name} is not made of whole pages (page_size={ps}): the page at position "
            f"{row * ps} holds slots {grid[row].tolist()[:8]}{'...' if ps > 8 else ''}"
        )
