"""KV events for routers: which blocks are stored where, with coalescing."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Medium(StrEnum):
    GPU = "GPU"
    CPU_PINNED = "CPU_PINNED"
    DISK = "DISK"
    EXTERNAL = "EXTERNAL"


@dataclass(slots=True)
class BlockStored:
    """Pages stored on a medium; ``parent_block_hash`` links the first page to its prefix.
    ``token_ids``: the pages' tokens; in an EAGLE tree their bigrams, as ``(t_i, t_i+1)``
    tuples (the reference's payload)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[Any]
    block_size: int
    medium: Medium
    lora_id: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: Medium


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventRecorder:
    """Collects events, merging consecutive compatible ones; drained with :meth:`take`."""

    events: list[KVEvent] = field(default_factory=list)

    def stored(
        self,
        hashes: list[int],
        parent: int | None,
        token_ids: list[Any],
        block_size: int,
        medium: Medium,
        lora_name: str | None,
        cache_salt: str | None,
    ) -> None:
        if not hashes:
            return
        last = self.events[-1] if self.events else None
        if (
            isinstance(last, BlockStored)
            and last.medium is medium
            and last.lora_name == lora_name
            and last.cache_salt == cache_salt
            and last.block_hashes[-1] == parent
        ):
            last.block_hashes.extend(hashes)
            last.token_ids.extend(token_ids)
            return
        self.events.append(
            BlockStored(
                block_hashes=list(hashes),
                parent_block_hash=parent,
                token_ids=list(token_ids),
                block_size=block_size,
                medium=medium,
                lora_name=lora_name,
                cache_salt=cache_salt,
            )
        )

    def removed(self, hashes: list[int], medium: Medium) -> None:
        if not hashes:
            return
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved) and last.medium is medium:
            last.block_hashes.extend(hashes)
            return
        self.events.append(BlockRemoved(block_hashes=list(hashes), medium=medium))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        out, self.events = self.events, []
        return out
