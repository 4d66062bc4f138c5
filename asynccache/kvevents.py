"""msgpack encoding of KV events, in SGLang's and vLLM's wire shape.

A batch is the array ``[ts, [event, ...], attn_dp_rank]``. Each event is a *tagged map*: the
key ``"type"`` names its class and every other key is a field; optional fields that are None
(``medium``, ``cache_salt``, ``session_id``, ``lora_name``) are left out, so a router decoding
with SGLang's own ``KVEventBatch`` (msgspec, ``tag=True, omit_defaults=True``) reads it
unchanged::

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | None,
     "token_ids": [...], "block_size": n, "lora_id": i | None, "medium": "GPU",
     "cache_salt": s, "session_id": s, "lora_name": s}
    {"type": "BlockRemoved", "block_hashes": [...], "medium": "CPU_PINNED"}
    {"type": "AllBlocksCleared"}

EAGLE caches report each page's bigrams as ``token_ids`` (pairs ``[t_i, t_i+1]`` on the wire,
tuples once decoded), as the reference does. :mod:`asynccache.eventpub` publishes batches over
ZMQ.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import msgpack

from asynccache.tree.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Medium

_OPTIONAL = ("cache_salt", "session_id", "lora_name")


def event_to_wire(ev: KVEvent) -> dict[str, Any]:
    if isinstance(ev, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored", "block_hashes": ev.block_hashes,
            "parent_block_hash": ev.parent_block_hash, "token_ids": ev.token_ids,
            "block_size": ev.block_size, "lora_id": ev.lora_id, "medium": ev.medium.value,
        }
        for name in _OPTIONAL:
            value = getattr(ev, name)
            if value is not None:
                out[name] = value
        return out
    if isinstance(ev, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": ev.block_hashes,
                "medium": ev.medium.value}
    if isinstance(ev, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {ev!r}")


def event_from_wire(item: Mapping[str, Any]) -> KVEvent:
    if not isinstance(item, Mapping):
        raise ValueError(f"a KV event is a tagged map, got {type(item).__name__}: {item!r}")
    tag = item.get("type")
    if tag == "BlockStored":
        return BlockStored(block_hashes=list(item["block_hashes"]),
                           parent_block_hash=item["parent_block_hash"],
                           token_ids=[tuple(t) if isinstance(t, list | tuple) else t
                                      for t in item["token_ids"]],
                           block_size=item["block_size"],
                           lora_id=item.get("lora_id"), medium=Medium(item["medium"]),
                           cache_salt=item.get("cache_salt"), session_id=item.get("session_id"),
                           lora_name=item.get("lora_name"))
    if tag == "BlockRemoved":
        return BlockRemoved(block_hashes=list(item["block_hashes"]), medium=Medium(item["medium"]))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event type {tag!r}")


def encode_batch(events: Iterable[KVEvent], *, ts: float | None = None,
                 attn_dp_rank: int | None = None) -> bytes:
    """One msgpack message carrying ``events``."""
    message: bytes = msgpack.packb(  # msgpack has no type hints: packb returns Any
        [time.time() if ts is None else ts, [event_to_wire(e) for e in events], attn_dp_rank],
        use_bin_type=True,
    )
    return message


def decode_batch(data: bytes) -> tuple[float, list[KVEvent], int | None]:
    ts, items, rank = msgpack.unpackb(data, raw=False)
    return ts, [event_from_wire(i) for i in items], rank
