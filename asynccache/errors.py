"""The one exception hierarchy of asynccache.

Every error raised on purpose by asynccache, transfers or storage derives from
:class:`AsyncCacheError`, so a scheduler can catch the whole family at once.
Messages name the bad value.
"""

from __future__ import annotations


class AsyncCacheError(Exception):
    """Base class of every asynccache error."""


class ConfigError(AsyncCacheError, ValueError):
    """A configuration value is invalid (names the field and the value)."""


class InvalidInputError(AsyncCacheError, ValueError):
    """A call received a bad argument: non-int tokens, a value of the wrong length, ..."""


class LockError(AsyncCacheError):
    """A lock was released that is not held, or with a receipt of another node."""


class OwnerError(AsyncCacheError, RuntimeError):
    """A mutating call came from a thread other than the one owning the cache."""


class UnknownNodeError(AsyncCacheError, KeyError):
    """A node id does not (or no longer) name a node of the tree."""


class PoolExhaustedError(AsyncCacheError):
    """An allocator cannot satisfy a request (when the caller asked to raise)."""


class DoubleFreeError(AsyncCacheError):
    """A slot was freed that is not currently allocated."""


class TransferError(AsyncCacheError):
    """A copy between tiers failed."""


class ClosedError(AsyncCacheError, RuntimeError):
    """The object was closed; pending and later calls fail with this."""


class StorageError(AsyncCacheError):
    """An L3 backend call failed (callers degrade it to a miss or a skipped write)."""


class CorruptObjectError(StorageError):
    """A stored object failed its header or checksum verification."""


class RankGroupError(AsyncCacheError, RuntimeError):
    """A collective across ranks failed: a peer timed out, died or disagreed on the call order."""
