"""asynccache: an asyncio-native hierarchical prefix KV cache for LLM serving."""

from asynccache.errors import AsyncCacheError

__all__ = ["AsyncCacheError"]
__version__ = "0.1.0"
