"""The synchronous tree core: radix tree, eviction policies, locks, hashes and KV events."""

from asynccache.tree.config import WRITE_POLICIES, TreeConfig, as_slots
from asynccache.tree.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Medium
from asynccache.tree.hashing import chain_digests, chain_seed, event_hash, storage_key
from asynccache.tree.keys import (
    DEFAULT_NAMESPACE,
    BigramKey,
    Namespace,
    RadixKey,
    as_bigram_key,
    as_key,
)
from asynccache.tree.queues import POLICIES
from asynccache.tree.results import (
    BackupRequest,
    EvictResult,
    HostEvictResult,
    InsertResult,
    LoadBackTicket,
    LockReceipt,
    MatchResult,
    SessionRef,
)
from asynccache.tree.tree import RadixTree

__all__ = [
    "DEFAULT_NAMESPACE",
    "POLICIES",
    "WRITE_POLICIES",
    "AllBlocksCleared",
    "BackupRequest",
    "BigramKey",
    "BlockRemoved",
    "BlockStored",
    "EvictResult",
    "HostEvictResult",
    "InsertResult",
    "KVEvent",
    "LoadBackTicket",
    "LockReceipt",
    "MatchResult",
    "Medium",
    "Namespace",
    "RadixKey",
    "RadixTree",
    "SessionRef",
    "TreeConfig",
    "as_bigram_key",
    "as_key",
    "as_slots",
    "chain_digests",
    "chain_seed",
    "event_hash",
    "storage_key",
]
