"""asynccache: an asyncio-native hierarchical prefix KV cache for LLM serving.

The package namespace is lazy: ``import asynccache.errors`` (which transfers/ and storage/ use)
does not pull in the engine, so the layers import in one direction only.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "AsyncCacheError",
    "CacheConfig",
    "CacheRequest",
    "HierarchicalCache",
    "LoadBack",
    "RadixKey",
]
__version__ = "0.1.0"

_WHERE = {
    "AsyncCacheError": "asynccache.errors",
    "CacheConfig": "asynccache.config",
    "CacheRequest": "asynccache.requests",
    "HierarchicalCache": "asynccache.cache",
    "LoadBack": "asynccache.loadback",
    "RadixKey": "asynccache.tree.keys",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'asynccache' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
