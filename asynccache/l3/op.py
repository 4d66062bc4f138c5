"""One storage prefetch in flight (:class:`PrefetchOp`), and the part only hybrid caches have
(:class:`HybridPrefetch`). Data only: the storage tier (:mod:`asynccache.l3.tier`) runs it and
owns its tasks."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from asynccache.tree import LockReceipt, RadixKey

#: A rank's state of the current component target (reduced by MIN over the ranks): reading
#: it, could not read one of its objects, or holds it (also: no target).
FETCHING = 0
FAILED = 1
HELD = 2


@dataclass(eq=False)
class HybridPrefetch:
    """What a prefetch of a hybrid (SWA / Mamba) cache tracks of its component objects
    (:mod:`asynccache.l3.hybrid`).

    ``restorable_pages``: the restorable prefix the hit query found (pages); ``parts``: host
    slots of the fetched SWA window / state, restoring the ``parts_pages``-page prefix (0:
    none); ``parts_new``: being fetched to replace them; ``parts_settled``: fetching them is
    over; ``stored``: what storage said of component objects (False: missing or could not be
    read).

    Several ranks (:mod:`asynccache.l3.hybrid_ranks`): ``cand`` is the deepest restorable
    arrived prefix found here (-1: searching; ``cand_gen`` tells searches apart) within ``cap``
    pages; ``target`` the agreed prefix whose components are being read (0: none) and
    ``target_status`` this rank's state of that read; ``blocked``: no host slots were left for
    components while stopping; ``no_room``: the cand that last found no component host slots
    (while transferring); ``failed_targets``: targets some rank could not read (agreed).
    """

    restorable_pages: int = 0
    parts: dict[str, np.ndarray] | None = None
    parts_pages: int = 0
    parts_new: dict[str, np.ndarray] | None = None
    parts_settled: bool = False
    stored: dict[str, bool] = field(default_factory=dict)
    cand: int = -1
    cand_gen: int = 0
    cap: int = 0
    target: int = 0
    target_status: int = HELD
    blocked: bool = False
    no_room: int = 0
    failed_targets: set[int] = field(default_factory=set)


@dataclass(eq=False)
class PrefetchOp:
    """One prefetch in flight. ``completed_tokens`` grows as batches land (visible progress)."""

    key: RadixKey
    start: int  # tokens of the key already cached when the prefetch started
    requested_tokens: int
    keys: list[str]
    pin: LockReceipt
    started: float
    host_slots: np.ndarray | None = None
    hit_tokens: int = 0
    completed_tokens: int = 0
    outcome: str = "issued"
    finished: bool = False
    reserved_tokens: int = 0  # counted against the prefetch capacity until released
    # several ranks (asynccache/ranks/agreement.py): the agreed phase and figures
    phase: str = "query"  # query -> transfer -> [stopping: hybrid] -> stopped (done: revoked)
    local_hit: int = -1  # pages this rank found (-1: query still running)
    want_pages: int = 0
    stop_policy: str | None = None  # set by finish_prefetch
    agreed_tokens: int | None = None
    hybrid: HybridPrefetch | None = None  # hybrid caches only

    @property
    def hy(self) -> HybridPrefetch:
        """The hybrid part (only called where the cache is hybrid)."""
        assert self.hybrid is not None, "not a hybrid cache's prefetch"
        return self.hybrid
