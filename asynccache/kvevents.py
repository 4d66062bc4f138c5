"""msgpack encoding of KV events, in the reference's wire shape.

A batch is ``[ts, [event, ...], attn_dp_rank]``; each event is an array whose first element is
its tag: ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, cache_salt, session_id, lora_name]``, ``["BlockRemoved", block_hashes, medium]``,
``["AllBlocksCleared"]``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import msgpack

from asynccache.tree.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Medium


def event_to_wire(ev: KVEvent) -> list[Any]:
    if isinstance(ev, BlockStored):
        return ["BlockStored", ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size,
                ev.lora_id, ev.medium.value, ev.cache_salt, ev.session_id, ev.lora_name]
    if isinstance(ev, BlockRemoved):
        return ["BlockRemoved", ev.block_hashes, ev.medium.value]
    if isinstance(ev, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {ev!r}")


def event_from_wire(item: list[Any]) -> KVEvent:
    tag = item[0]
    if tag == "BlockStored":
        return BlockStored(block_hashes=list(item[1]), parent_block_hash=item[2],
                           token_ids=list(item[3]), block_size=item[4], lora_id=item[5],
                           medium=Medium(item[6]), cache_salt=item[7], session_id=item[8],
                           lora_name=item[9])
    if tag == "BlockRemoved":
        return BlockRemoved(block_hashes=list(item[1]), medium=Medium(item[2]))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event tag {tag!r}")


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
