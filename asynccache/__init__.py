"""asynccache: an asyncio-native hierarchical prefix KV cache for LLM serving.

Everything a scheduler needs imports from here: the engine (``HierarchicalCache``,
``CacheConfig``, ``StoragePolicy``...), storage (``open_backend``, the backends), rank groups
(``TorchRankGroup``) and the whole exception hierarchy (``AsyncCacheError`` and its subclasses).

The namespace is lazy: a name is imported on first use, so ``import asynccache`` (or
``import asynccache.errors``, which ``asynccache.transfers`` and ``asynccache.storage`` use) does
not pull in the engine or torch, and the layers import in one direction only. Importing it does
not configure logging either (see ``asynccache.logs``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # precise types for the errors (a light module); the rest resolve lazily
    from asynccache.errors import (
        AsyncCacheError,
        ClosedError,
        ConfigError,
        CorruptObjectError,
        DoubleFreeError,
        InvalidInputError,
        LockError,
        OwnerError,
        PoolExhaustedError,
        RankGroupError,
        StorageError,
        TransferError,
        UnknownNodeError,
    )

__version__ = "0.1.0"

_ERRORS = "asynccache.errors"
_WHERE = {
    # the engine
    "CacheConfig": "asynccache.config",
    "CacheRequest": "asynccache.request",
    "HierarchicalCache": "asynccache.cache",
    "LoadBack": "asynccache.engine",
    "BigramKey": "asynccache.tree.keys",
    "RadixKey": "asynccache.tree.keys",
    "RetractedKV": "asynccache.retraction",
    "StoragePolicy": "asynccache.l3",
    "StreamingSession": "asynccache.sessions",
    # sidecar pools (``cache.register_sidecar_pool(spec)`` / ``cache.sidecar(name)``)
    "Sidecar": "asynccache.engine.sidecars",
    "SidecarSpec": "asynccache.transfers.sidecars",
    # KV events (``cache.take_events()``)
    "AllBlocksCleared": "asynccache.tree.events",
    "BlockRemoved": "asynccache.tree.events",
    "BlockStored": "asynccache.tree.events",
    "KVEvent": "asynccache.tree.events",
    # ranks
    "RankGroup": "asynccache.ranks",
    "SingleRank": "asynccache.ranks",
    "TorchRankGroup": "asynccache.ranks",
    # storage (L3)
    "CorruptPageError": "asynccache.storage.pageformat",
    "FileBackend": "asynccache.storage.file",
    "S3Backend": "asynccache.storage.s3",
    "StorageBackend": "asynccache.storage.base",
    "StorageLayout": "asynccache.storage.base",
    "open_backend": "asynccache.storage.factory",
    # errors
    "AsyncCacheError": _ERRORS,
    "ClosedError": _ERRORS,
    "ConfigError": _ERRORS,
    "CorruptObjectError": _ERRORS,
    "DoubleFreeError": _ERRORS,
    "InvalidInputError": _ERRORS,
    "LockError": _ERRORS,
    "OwnerError": _ERRORS,
    "PoolExhaustedError": _ERRORS,
    "RankGroupError": _ERRORS,
    "StorageError": _ERRORS,
    "TransferError": _ERRORS,
    "UnknownNodeError": _ERRORS,
}

__all__ = [
    "AllBlocksCleared",
    "AsyncCacheError",
    "BigramKey",
    "BlockRemoved",
    "BlockStored",
    "CacheConfig",
    "CacheRequest",
    "ClosedError",
    "ConfigError",
    "CorruptObjectError",
    "CorruptPageError",
    "DoubleFreeError",
    "FileBackend",
    "HierarchicalCache",
    "InvalidInputError",
    "KVEvent",
    "LoadBack",
    "LockError",
    "OwnerError",
    "PoolExhaustedError",
    "RadixKey",
    "RankGroup",
    "RankGroupError",
    "RetractedKV",
    "S3Backend",
    "Sidecar",
    "SidecarSpec",
    "SingleRank",
    "StorageBackend",
    "StorageError",
    "StorageLayout",
    "StoragePolicy",
    "StreamingSession",
    "TorchRankGroup",
    "TransferError",
    "UnknownNodeError",
    "open_backend",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'asynccache' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
