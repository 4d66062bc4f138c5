"""What the engine believes is stored in L3: a bounded LRU of page keys plus in-flight writes.

Used by the storage tier and the buffer-only host mode to write a page to storage only once. The
belief is advisory:
a stale positive (the backend evicted or lost the page) costs skipped writes until a prefetch's
hit query comes up short and :meth:`StorageExistenceCache.invalidate_beyond` forgets the pages
past the shortfall; a missing entry costs a redundant write the backend deduplicates. Served KV
never depends on it: reads always go to the backend and are verified there.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Final

from asynccache.errors import ConfigError, InvalidInputError
from asynccache.storage.base import listen_for_evictions, stop_listening

DEFAULT_MAX_ENTRIES: Final = 512 * 1024


class StorageExistenceCache:
    """A bounded LRU of page keys believed stored, and refcounted keys being written.

    ``covered(keys)`` is true when every key is believed stored or is being written. Keys being
    written are never dropped by the LRU bound; they join the LRU when their write succeeds.
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ConfigError(f"max_entries must be an int >= 1, got {max_entries!r}")
        self.max_entries = max_entries
        self._lru: OrderedDict[str, None] = OrderedDict()
        self._inflight: dict[str, int] = {}
        self.dropped = 0  # entries pushed out by the bound
        self.invalidated = 0  # entries forgotten after a short hit query

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: object) -> bool:
        return key in self._lru

    @property
    def inflight(self) -> int:
        """Distinct keys with a write in flight."""
        return len(self._inflight)

    def add(self, keys: Iterable[str]) -> None:
        """Believe ``keys`` stored (most recent last); the least recently used go past the bound."""
        lru = self._lru
        for k in keys:
            lru[k] = None
            lru.move_to_end(k)
        while len(lru) > self.max_entries:
            lru.popitem(last=False)
            self.dropped += 1

    def touch(self, key: str) -> bool:
        """Mark ``key`` recently used; False when it is not believed stored."""
        if key not in self._lru:
            return False
        self._lru.move_to_end(key)
        return True

    def covered(self, keys: Sequence[str]) -> bool:
        """True when every key is believed stored or being written (refreshes their recency)."""
        for k in keys:
            if k in self._inflight:
                continue
            if not self.touch(k):
                return False
        return True

    def missing(self, keys: Sequence[str]) -> list[int]:
        """Indices of the keys neither believed stored nor being written."""
        return [i for i, k in enumerate(keys) if k not in self._inflight and not self.touch(k)]

    def begin_write(self, keys: Iterable[str]) -> None:
        """``keys`` are being written: they count as covered until :meth:`end_write`."""
        for k in keys:
            self._inflight[k] = self._inflight.get(k, 0) + 1

    def end_write(self, keys: Sequence[str], stored: Sequence[bool]) -> None:
        """The write of ``keys`` ended; the pages with ``stored[i]`` true join the LRU."""
        if len(keys) != len(stored):
            raise InvalidInputError(f"{len(keys)} keys but {len(stored)} outcomes")
        for k in keys:
            n = self._inflight.get(k)
            if n is None:
                raise InvalidInputError(f"no write of {k!r} in flight")
            if n == 1:
                del self._inflight[k]
            else:
                self._inflight[k] = n - 1
        self.add(k for k, ok in zip(keys, stored, strict=True) if ok)

    def forget(self, keys: Iterable[str]) -> int:
        """Stop believing ``keys`` stored (a read of them failed, or the backend said it removed
        them); returns how many were believed. Keys being written stay covered."""
        gone = 0
        for k in keys:
            if self._lru.pop(k, 0) is None:
                gone += 1
        self.invalidated += gone
        return gone

    def resize(self, max_entries: int) -> None:
        """Bound the belief to ``max_entries`` keys from now on (the oldest go first)."""
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ConfigError(f"max_entries must be an int >= 1, got {max_entries!r}")
        self.max_entries = max_entries
        self.add(())

    def invalidate_beyond(self, chain: Sequence[str], keep_pages: int) -> int:
        """A hit query found only the first ``keep_pages`` pages of ``chain``: forget the rest.

        Keys being written stay covered (their write decides). Returns how many were forgotten.
        """
        if isinstance(keep_pages, bool) or not isinstance(keep_pages, int) or not \
                0 <= keep_pages <= len(chain):
            raise InvalidInputError(
                f"keep_pages must be an int in [0, {len(chain)}], got {keep_pages!r}"
            )
        return self.forget(chain[keep_pages:])

    def clear(self) -> None:
        """Forget every belief (the backend was cleared or replaced); writes in flight stay."""
        self._lru.clear()


def listen(backend: object, belief: StorageExistenceCache) -> None:
    """Forget pages as soon as ``backend`` says they are gone (capacity eviction, a corrupt or
    missing page, ``delete`` / ``clear``), where it can tell (``add_eviction_listener``)."""
    listen_for_evictions(backend, belief.forget)


def unlisten(backend: object, belief: StorageExistenceCache) -> None:
    stop_listening(backend, belief.forget)
