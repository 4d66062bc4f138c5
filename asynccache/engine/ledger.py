"""The slot ledger: which device pages callers hold, and how many host slots operations hold.

A page is *held* from the moment the cache hands it out (``alloc_device``, ``extend``, a
load-back's destination before the tree takes it, a restore) until its holder frees it or the
tree adopts it (an insert). The holder is an owner tag per page: :data:`CALLER`, or the tag of
the request whose ``extend`` / restore took it (a request's slots are released only by its own
release or insert; ``free_device`` and a plain ``insert`` refuse them). Every slot a caller gives back (``insert``,
``free_device``) is checked here first: in range, whole pages, no page twice, each page held by
a caller. Slots the tree owns, slots never handed out and slots already freed are refused with
an :class:`InvalidInputError` naming the slot, before anything changes: a caller can no longer
make the tree adopt slots another request is about to be given (wrong KV), nor free the tree's.

Host slots are held the same way by *operations* (backups in flight, storage writes and
prefetches, buffer-mode staging, retracted requests, a caller's ``take_host``) from ``take_host``
until they are freed or the tree adopts them: ``free_host`` refuses host slots of the tree's
host copies, never handed out or already freed, so a caller can no longer free a page a cached
prefix still reads from. The ledger is the only writer of both counts, and
:meth:`SlotLedger.check_accounting` is the accounting half of ``sanity_check``.

Synchronous, single-owner (the cache's loop); no I/O.
"""

from __future__ import annotations

import numpy as np

from asynccache.errors import InvalidInputError
from asynccache.transfers.allocator import PageAllocator
from asynccache.transfers.indices import SlotIndices

#: The owner tag of pages held by the caller itself (``alloc_device``, ``take_host``); a
#: request's pages carry the request's own tag (:attr:`CacheRequest.tag`, from 2 up); 0: none.
CALLER = 1


class Holdings:
    """Per page of one pool: who holds it (an owner tag; 0: no one), and how many are held."""

    __slots__ = ("_alloc", "_held", "_holder", "_ps", "_stamp", "pages")

    def __init__(self, allocator: PageAllocator, holder: str) -> None:
        self._alloc = allocator
        self._ps = allocator.page_size
        self._held = np.zeros(allocator.num_pages, dtype=np.int64)
        self._stamp = np.zeros(allocator.num_pages, dtype=np.int64)
        self._holder = holder  # the end of the "not held" error: who hands slots out
        self.pages = 0

    @property
    def tokens(self) -> int:
        return self.pages * self._ps

    def hand_out(self, slots: np.ndarray, owner: int = CALLER) -> None:
        """``slots`` (whole pages the allocator just returned, so not validated again) are
        now held by ``owner``."""
        pages = slots if self._ps == 1 else slots[:: self._ps] // self._ps
        if self._held[pages].any():
            bad = int(pages[int(np.argmax(self._held[pages] != 0))])
            raise AssertionError(f"page {bad} handed out twice")
        self._held[pages] = owner
        self.pages += len(pages)

    def check(self, slots: SlotIndices, name: str, owner: int = CALLER) -> np.ndarray:
        """The page ids of ``slots`` if ``owner`` holds all of them (nothing changes), else
        :class:`InvalidInputError` naming the first bad slot."""
        pages = self._alloc.pages_of(slots, name=name)
        n = len(pages)
        if n == 0:
            return pages
        wrong = self._held[pages] != owner
        if wrong.any():
            at = int(np.argmax(wrong))
            slot = int(pages[at]) * self._ps
            held_by = int(self._held[pages[at]])
            where = f"{name}: slot {slot} (position {at * self._ps})"
            if owner == CALLER and held_by > CALLER:
                raise InvalidInputError(f"{where} belongs to a request (extend): abort_req / "
                                        "cache_finished_req releases it")
            if owner != CALLER:
                raise InvalidInputError(f"{where} is not held by request {owner}: it was "
                                        "never handed to it (extend), was already freed, or "
                                        "belongs to the cache or to another holder")
            raise InvalidInputError(f"{where} is not held by {self._holder}")
        if n > 1:
            order = np.arange(n, dtype=np.int64)
            self._stamp[pages] = order
            seen = self._stamp[pages]
            if seen.tobytes() != order.tobytes():
                at = int(np.flatnonzero(seen != order)[0])
                raise InvalidInputError(
                    f"{name}: slot {int(pages[at]) * self._ps} appears twice"
                )
        return pages

    def release(self, slots: SlotIndices, name: str, owner: int = CALLER) -> np.ndarray:
        """``owner`` gives ``slots`` up: checked as :meth:`check`, then no longer held.
        Returns their page ids."""
        pages = self.check(slots, name, owner)
        self.release_pages(pages)
        return pages

    def release_pages(self, pages: np.ndarray) -> None:
        """Release pages :meth:`check` returned (nothing changed them since)."""
        self._held[pages] = 0
        self.pages -= len(pages)

    def take_all(self) -> np.ndarray:
        """Every slot still held, now held by no one."""
        pages = np.flatnonzero(self._held)
        self._held[:] = 0
        self.pages = 0
        if self._ps == 1:
            return pages.astype(np.int64)
        base = pages.astype(np.int64)[:, None] * self._ps
        out: np.ndarray = (base + np.arange(self._ps, dtype=np.int64)).reshape(-1)
        return out


_DEVICE_HOLDER = ("the caller: it was never handed out by alloc_device / extend, was already "
                  "freed, or belongs to the cache (a cached prefix's slots are the tree's)")
_HOST_HOLDER = ("an operation: it was never handed out by take_host, was already freed, or "
                "belongs to the cache (a host copy's slots are the tree's)")


class SlotLedger:
    """Device pages held by callers and host pages held by operations. The only writer of
    both counts."""

    __slots__ = ("_dev", "_host")

    def __init__(self, allocator: PageAllocator, host: PageAllocator | None = None) -> None:
        self._dev = Holdings(allocator, _DEVICE_HOLDER)
        self._host = Holdings(host, _HOST_HOLDER) if host is not None else None

    @property
    def held_tokens(self) -> int:
        """Device slots held by callers (handed out, not yet freed or adopted)."""
        return self._dev.tokens

    @property
    def host_tokens(self) -> int:
        """Host slots operations hold (taken from the host pool, not the tree's)."""
        return self._host.tokens if self._host is not None else 0

    def _host_pages(self) -> Holdings:
        if self._host is None:
            raise InvalidInputError("this cache has no host pool")
        return self._host

    def host_taken(self, slots: np.ndarray) -> None:
        """An operation took ``slots`` (fresh from the host allocator) from the host pool."""
        self._host_pages().hand_out(slots)

    def host_returned(self, slots: SlotIndices, name: str = "slots") -> np.ndarray:
        """An operation gives ``slots`` back (to be freed, or adopted by the tree): refused
        (:class:`InvalidInputError` naming the first bad slot, nothing changed) unless
        operations hold all of them. Returns their page ids."""
        return self._host_pages().release(slots, name)

    def check_accounting(self, tree_device: int, device_used: int,
                         tree_host: int | None = None, host_used: int | None = None) -> None:
        """Every allocated slot has one owner: device ``used == tree + callers``, host
        ``used == tree + operations`` (host figures None: no host pool)."""
        if device_used != tree_device + self.held_tokens:
            raise AssertionError(
                f"device accounting: allocator uses {device_used} slots, tree holds "
                f"{tree_device} and callers {self.held_tokens}"
            )
        if host_used is not None and host_used != (tree_host or 0) + self.host_tokens:
            raise AssertionError(
                f"host accounting: allocator uses {host_used} slots, tree holds "
                f"{tree_host} and operations (backups in flight, staging, "
                f"retracted requests) {self.host_tokens}"
            )

    def hand_out(self, slots: np.ndarray, owner: int = CALLER) -> None:
        """``slots`` (whole pages the cache's allocator just returned, so not validated again)
        now belong to ``owner`` (the caller, or a request's tag)."""
        self._dev.hand_out(slots, owner)

    def check(self, slots: SlotIndices, name: str = "slots", owner: int = CALLER) -> np.ndarray:
        """The page ids of ``slots`` if ``owner`` holds all of them (nothing changes), else
        :class:`InvalidInputError` naming the first bad slot."""
        return self._dev.check(slots, name, owner)

    def release(self, slots: SlotIndices, name: str = "slots", owner: int = CALLER) -> np.ndarray:
        """``owner`` gives ``slots`` up (freed, or adopted by the tree): checked as
        :meth:`check`, then no longer held. Returns their page ids (checked: the allocator can
        free them without validating the slots again)."""
        return self._dev.release(slots, name, owner)

    def release_pages(self, pages: np.ndarray) -> None:
        """Release pages :meth:`check` returned (nothing changed them since)."""
        self._dev.release_pages(pages)

    def take_all(self) -> np.ndarray:
        """Every slot callers still hold, now held by no one (the cache closes: requests
        interrupted by it give their slots back)."""
        return self._dev.take_all()
