"""What the tree returns: results, lock receipts and the actions the caller executes.

The tree never touches a pool. Slots it gives up come back in ``device_frees`` /
``host_frees`` (free each array exactly once); copies it wants come back as
:class:`BackupRequest` objects (run them, then ``commit_backup`` or ``abort_backup``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

EMPTY_SLOTS = np.empty(0, dtype=np.int64)
EMPTY_SLOTS.flags.writeable = False


@dataclass(frozen=True, slots=True)
class BackupRequest:
    """Copy ``device_slots`` (the node's KV) to host, then call ``commit_backup(op_id, ...)``.

    The node stays device-locked until the commit or abort, so it cannot be evicted while
    half-written. ``write_back`` is True when the copy was asked for by eviction.
    Hybrid trees: ``component_slots`` maps a component (``"swa"``, ``"mamba"``) to its device
    data to copy too (absent: the node has none on device): SWA by the node's FULL slots (copy
    from their full->SWA translation), Mamba the state slot; commit with a host slot array of
    the same length per component.
    """

    op_id: int
    node_id: int
    device_slots: np.ndarray
    write_back: bool = False
    component_slots: dict[str, np.ndarray] = field(default_factory=dict)
    # A write-back victim's parent, taken in the same call as its children: if its copy
    # fails it stays on device (it is not dropped like a victim that was a leaf).
    after_children: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.device_slots)


@dataclass(frozen=True, slots=True)
class LoadBackTicket:
    """A load-back in flight: copy ``host_slots`` into ``device_slots``, then commit it.

    Hybrid trees: also copy ``component_host_slots[name]`` into ``component_device_slots[name]``
    for each component. ``swa_pairs`` pairs the FULL device slots of the tokens whose SWA is
    loaded with their new SWA device slots (for the caller's full->SWA map). On an abort the
    component device slots are the caller's again.
    """

    op_id: int
    node_ids: tuple[int, ...]
    host_slots: np.ndarray
    device_slots: np.ndarray
    component_host_slots: dict[str, np.ndarray] = field(default_factory=dict)
    component_device_slots: dict[str, np.ndarray] = field(default_factory=dict)
    swa_pairs: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.device_slots)


@dataclass(frozen=True, slots=True)
class LockReceipt:
    """Proof of a lock; pass it back to ``unlock`` / ``unlock_host`` exactly once."""

    token: int
    node_id: int
    delta: int  # tokens that moved from evictable to protected (device) or host-pinned (host)
    host: bool = False
    swa_span: int = 0  # hybrid trees: tokens whose SWA the lock pins (its window boundary)
    mamba_locked: bool = False  # hybrid trees: the anchor's Mamba state is pinned


@dataclass(frozen=True, slots=True)
class SessionRef:
    """A session's reference on a node's path; pass it to ``release_session_ref`` once.

    Unlike a lock it protects nothing: it only makes eviction take the path's nodes last. If
    the node is deleted, the reference moves to its nearest surviving ancestor.
    """

    token: int
    node_id: int


@dataclass(slots=True)
class MatchResult:
    """Where the longest cached prefix of a key lives.

    ``device_indices`` are the device slots of the first ``device_prefix_len`` tokens (read-only).
    ``best_node`` is the deepest matched node, device or host (anchor for load-back and storage
    prefetch); ``host_hit_length`` the tokens from the device prefix's end to ``best_node``'s,
    which a load-back makes device-usable (on host only, in a FULL-only tree; a hybrid tree also
    counts nodes whose FULL KV is on device but whose SWA / Mamba part must come from host).
    ``pending_loads`` names load-backs still copying pages that follow the device prefix (they
    count in ``host_hit_length`` until they commit): wait for them, then match again.

    Hybrid trees (SWA / Mamba components): the device prefix ends at the deepest node every
    component accepts; ``full_kv_hit_length`` counts every matched FULL token regardless.
    ``swa_branching_seqlen`` / ``mamba_branching_seqlen`` (None when not applicable): where a
    new SWA window / Mamba state could be checkpointed past the usable prefix.
    ``mamba_cow_slot``: with ``cow_mamba=True``, the state slot the caller must copy into a
    fresh slot of its own (copy-on-write is the caller's action).
    """

    device_indices: np.ndarray
    device_prefix_len: int
    last_device_node: int
    best_node: int
    host_hit_length: int
    pending_loads: tuple[int, ...] = ()
    full_kv_hit_length: int = 0
    swa_branching_seqlen: int | None = None
    mamba_branching_seqlen: int | None = None
    mamba_cow_slot: int | None = None

    @property
    def total_hit_length(self) -> int:
        return self.device_prefix_len + self.host_hit_length


@dataclass(slots=True)
class InsertResult:
    """Outcome of an insert.

    ``prefix_len``: tokens of the key already cached (device or host) before the insert.
    ``cached_len``: tokens the tree now holds for the key (the key length rounded down to a page;
    the caller keeps the slots of the unaligned tail). ``last_node``: node ending at
    ``cached_len``. ``device_frees``: the caller's slots that duplicate cached KV — free them.
    ``backups``: write-through copies to run, root first. ``intents``: with storage intents on
    (buffer-only host mode), the nodes that reached the write threshold, root first: write them
    to storage (nothing is pinned or marked for them).
    Hybrid trees name SWA data by FULL slots. ``component_frees["swa"]``: the caller's FULL
    slots whose SWA side the tree does not take (a partly freed page above the SWA floor, the
    out-of-window part of a cached SWA tombstone); ``component_frees["mamba"]``: the caller's
    state when the tree does not take it; ``mamba_exist``: the last node already held a Mamba
    state. ``swa_adopted``: (a node's FULL slots, the caller's FULL slots) for every SWA
    tombstone recovered from caller slots that are not the node's own — the full->SWA map must
    now pair the node's slots with the caller's SWA side.
    """

    prefix_len: int
    cached_len: int
    last_node: int
    device_frees: list[np.ndarray] = field(default_factory=list)
    backups: list[BackupRequest] = field(default_factory=list)
    intents: list[int] = field(default_factory=list)
    component_frees: dict[str, list[np.ndarray]] = field(default_factory=dict)
    mamba_exist: bool = False
    swa_adopted: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)


@dataclass(slots=True)
class EvictResult:
    """Device eviction outcome.

    ``num_evicted``: device tokens freed now (``device_frees``). ``host_frees``: host slots of
    dropped subtrees. ``backups``: write-back copies the caller must run; once committed those
    nodes are demoted by the next ``evict`` call (``pending_tokens`` counts them).
    Hybrid trees: ``swa_num_evicted`` (SWA tokens) and ``mamba_num_evicted`` (states) freed,
    in ``component_frees[name]``: SWA as the FULL slots whose SWA side goes (a deleted leaf's
    FULL slots are in ``device_frees`` too), Mamba as state slots; host copies of component
    values dropped with deleted nodes in ``component_host_frees[name]``.
    """

    num_evicted: int = 0
    pending_tokens: int = 0
    device_frees: list[np.ndarray] = field(default_factory=list)
    host_frees: list[np.ndarray] = field(default_factory=list)
    backups: list[BackupRequest] = field(default_factory=list)
    dropped_host_tokens: int = 0
    swa_num_evicted: int = 0
    mamba_num_evicted: int = 0
    component_frees: dict[str, list[np.ndarray]] = field(default_factory=dict)
    component_host_frees: dict[str, list[np.ndarray]] = field(default_factory=dict)


@dataclass(slots=True)
class HostEvictResult:
    """Host eviction outcome; hybrid trees also free the host copies of component values
    (``component_host_frees[name]``)."""

    num_evicted: int = 0
    host_frees: list[np.ndarray] = field(default_factory=list)
    component_host_frees: dict[str, list[np.ndarray]] = field(default_factory=dict)
