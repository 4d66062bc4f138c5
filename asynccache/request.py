"""A request's view of the cache (:class:`CacheRequest`), its KV parked in host memory
(:class:`RetractedKV`), and the checks and pin moves every request call shares. Data and
synchronous helpers only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from asynccache.errors import InvalidInputError
from asynccache.tree import LockReceipt, MatchResult, RadixKey, RadixTree
from asynccache.tree.results import EMPTY_SLOTS

if TYPE_CHECKING:
    from asynccache.l3 import PrefetchOp


@dataclass(eq=False)
class RetractedKV:
    """A request's KV parked in host memory: ``num_tokens`` tokens in ``host_slots``.

    Hybrid caches: ``swa_host_slots`` hold the SWA KV of the tokens from ``swa_from`` on (to the
    end of ``host_slots``), ``mamba_host_slot`` the request's Mamba state (None: none).
    """

    rid: str
    num_tokens: int
    host_slots: np.ndarray
    state: str = "held"  # held | restoring | restored | discarded
    swa_from: int = 0
    swa_host_slots: np.ndarray = field(default_factory=lambda: EMPTY_SLOTS)
    mamba_host_slot: int | None = None

    @property
    def component_host_slots(self) -> dict[str, np.ndarray]:
        """The hybrid components' host slots (only the components the backup has)."""
        out: dict[str, np.ndarray] = {}
        if len(self.swa_host_slots):
            out["swa"] = self.swa_host_slots
        if self.mamba_host_slot is not None:
            out["mamba"] = np.array([self.mamba_host_slot], dtype=np.int64)
        return out


@dataclass(eq=False)
class CacheRequest:
    """A request's view of the cache.

    ``slots[i]`` is the device slot holding the KV of token ``i`` for the ``computed`` tokens so
    far; the first ``prefix_len`` slots belong to the tree (cached prefix, kept alive by
    ``receipt``), the rest to the request. ``spare`` holds allocated, not yet used slots of the
    request's last page. While ``pending_loads`` is not empty, wait for them
    (:meth:`HierarchicalCache.wait_loads`) before reading the prefix KV.
    """

    rid: str
    key: RadixKey
    slots: np.ndarray
    prefix_len: int
    last_node: int
    best_node: int
    host_hit_length: int
    receipt: LockReceipt | None
    host_receipt: LockReceipt | None = None  # pins the host hit until it is loaded or dropped
    pending_loads: tuple[int, ...] = ()
    spare: np.ndarray = field(default_factory=lambda: EMPTY_SLOTS)
    inserted_len: int = 0
    finished: bool = False
    priority: int = 0  # passed to every insert of this request (the "priority" policy uses it)
    session_id: str | None = None
    session_generation: int | None = None
    retracted: RetractedKV | None = None  # KV parked in host memory by HierarchicalCache.retract
    mamba_state: int | None = None  # hybrid: the request's own Mamba state slot
    swa_evicted: int = 0  # hybrid: SWA slots of tokens below this were freed (out of window)
    prefetch: PrefetchOp | None = None  # started by HierarchicalCache.begin_prefetch
    # The cache that admitted it: every request call checks it (another cache's request would
    # free and insert slots of the wrong pools).
    owner: Any = field(default=None, repr=False, compare=False)
    # Its own slots' owner tag in the cache's slot ledger (2 and up): only this request's
    # release or insert gives them up (free_device refuses them).
    tag: int = field(default=0, repr=False, compare=False)

    @property
    def computed(self) -> int:
        return len(self.slots)

    def match(self) -> MatchResult:
        """The request's current match, as the tree reported it."""
        return MatchResult(self.slots, self.prefix_len, self.last_node, self.best_node,
                           self.host_hit_length, self.pending_loads)


def check_request(req: Any, owner: object) -> CacheRequest:
    """``req`` is a request ``owner`` admitted (else InvalidInputError naming it)."""
    if not isinstance(req, CacheRequest):
        raise InvalidInputError(
            f"expected a CacheRequest (from admit), got {type(req).__name__}: {req!r}"
        )
    if req.owner is not owner:
        raise InvalidInputError(
            f"request {req.rid} was admitted by another cache; it can only be used there"
        )
    return req


def check_active(req: Any, owner: object) -> CacheRequest:
    """:func:`check_request`, and ``req`` is neither finished nor retracted."""
    checked = check_request(req, owner)
    if checked.finished:
        raise InvalidInputError(f"request {checked.rid} is already finished")
    if checked.retracted is not None:
        raise InvalidInputError(f"request {checked.rid} is retracted: restore it first")
    return checked


def release_pins(tree: RadixTree, req: CacheRequest) -> None:
    if req.receipt is not None:
        tree.unlock(req.receipt)
        req.receipt = None
    if req.host_receipt is not None:
        tree.unlock_host(req.host_receipt)
        req.host_receipt = None


def rematch(tree: RadixTree, req: CacheRequest) -> None:
    """Refresh ``req`` from the tree's current state, moving its pins to the new match."""
    m = tree.match_prefix(req.key)
    dev = tree.lock(m.last_device_node)
    host = tree.lock_host(m.best_node) if m.host_hit_length else None
    release_pins(tree, req)
    req.receipt, req.host_receipt = dev, host
    req.slots = m.device_indices
    req.prefix_len = m.device_prefix_len
    req.last_node = m.last_device_node
    req.best_node = m.best_node
    req.host_hit_length = m.host_hit_length
    req.pending_loads = m.pending_loads
