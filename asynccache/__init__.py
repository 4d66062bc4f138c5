"""asynccache: an asyncio-native hierarchical prefix KV cache for LLM serving."""

from asynccache.cache import CacheRequest, HierarchicalCache, LoadBack
from asynccache.config import CacheConfig
from asynccache.errors import AsyncCacheError
from asynccache.tree import RadixKey

__all__ = [
    "AsyncCacheError",
    "CacheConfig",
    "CacheRequest",
    "HierarchicalCache",
    "LoadBack",
    "RadixKey",
]
__version__ = "0.1.0"
