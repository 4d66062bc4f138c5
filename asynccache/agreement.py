"""Agreement of the ranks of one instance: deferred completions retired at agreed ticks.

With one rank a copy commits the tree in its done-callback. With several ranks each rank's
copies, storage writes and reads finish at different times, so committing on completion would
let two ranks see different trees at the same scheduler call. Instead, with a multi-rank
:class:`~asynccache.ranks.RankGroup`:

* a completion whose commit changes the tree (a D->H backup, an H->D load-back, a storage write
  that holds a host pin) is queued in a FIFO *lane* in submission order and only marked ready
  when it finishes locally;
* :meth:`Agreement.sync` (a *tick*) snapshots, on every rank, how far each lane is ready (an
  absolute index) and each prefetch's local state, all-reduces them in ONE collective
  (element-wise MIN; MAX as the MIN of negated values) and then retires exactly the agreed
  number of completions in order and applies the agreed prefetch decisions;
* every coroutine of the cache that waits for such a completion (``load_back``, ``flush``,
  ``alloc_device``, ``storage.drain``, ``finish_prefetch``...) waits by ticking
  (:meth:`Agreement.until`), so a sequential scheduler never has to call ``sync`` itself.

Contract: the ranks issue the same cache calls in the same order, from one driving task per
rank (a TP scheduler does). Rank-local events then only flip local "ready" marks; the tree,
the locks and the pools change only in the caller's calls and at ticks, identically everywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from asynccache.errors import RankGroupError
from asynccache.logs import get_logger

_log = get_logger("agreement")

#: The lanes, in the order their counts travel in a tick.
LANES = ("copies", "storage")
#: Agreed state every rank must share at a tick; each travels as MIN and MAX (negated MIN), and
#: a difference means the ranks no longer make the same calls (the contract below is broken).
CHECKS = ("tick", "tree nodes", "device tokens", "host tokens", "copies retired",
          "storage writes retired", "prefetches")
#: Prefetches one tick carries (the vector has a fixed size on every rank, so ranks that
#: disagree on how many there are get a clear error, not a collective of mismatched sizes —
#: which gloo answers by aborting the process). Later ones wait for a following tick.
TICK_PREFETCHES = 32
ENTRY_WIDTH = 3
#: How long a tick with nothing retired waits for local progress before the next one.
IDLE_WAIT_S = 0.005


@dataclass(eq=False, slots=True)
class _Deferred:
    ready: Callable[[], bool]
    apply: Callable[[], object]
    token: int  # id() of the handle / task it stands for


class Agreement:
    """The deferred-completion lanes and the tick of one multi-rank cache."""

    def __init__(self, group: Any, storage: Callable[[], Any],
                 tree_state: Callable[[], Sequence[int]] = tuple) -> None:
        self.group = group
        self._storage = storage  # -> the attached StorageTier (or None), asked for its entries
        self._tree_state = tree_state  # -> (nodes, device tokens, host tokens): must agree
        self.lanes: dict[str, deque[_Deferred]] = {name: deque() for name in LANES}
        self.retired: dict[str, int] = dict.fromkeys(LANES, 0)  # absolute, equal on every rank
        self._pending: set[int] = set()
        self._progress = asyncio.Event()
        self._tick: asyncio.Future[int] | None = None
        self.ticks = 0
        #: completions that were done here but not yet on some peer at a tick (held back)
        self.held_back = 0
        #: set when a tick failed (a peer died or timed out): later ticks agree with this rank
        #: alone, so the cache can still drain and close; its tree may then differ from peers'.
        self.failed: RankGroupError | None = None

    # ------------------------------------------------------------------ deferring
    def defer(self, lane: str, ready: Callable[[], bool], apply: Callable[[], object],
              token: int) -> None:
        self.lanes[lane].append(_Deferred(ready, apply, token))
        self._pending.add(token)

    def defer_copy(self, handle: Any, apply: Callable[[], object]) -> None:
        """Commit ``handle`` (a copy) at the tick that agrees it finished on every rank."""
        self.defer("copies", lambda: handle.finished, apply, id(handle))
        handle.add_done_callback(lambda _h: self._progress.set())

    def defer_task(self, task: asyncio.Task[Any], apply: Callable[[], object]) -> None:
        """Run ``apply`` at the tick that agrees ``task`` (a storage write) ended everywhere."""
        self.defer("storage", task.done, apply, id(task))
        task.add_done_callback(lambda _t: self._progress.set())

    def note_progress(self) -> None:
        self._progress.set()

    def is_pending(self, obj: Any) -> bool:
        return id(obj) in self._pending

    @property
    def pending(self) -> int:
        return len(self._pending)

    def lane_empty(self, lane: str) -> bool:
        return not self.lanes[lane]

    # ------------------------------------------------------------------ the tick
    def _ready_through(self, lane: str) -> int:
        n = 0
        for item in self.lanes[lane]:
            if not item.ready():
                break
            n += 1
        return self.retired[lane] + n

    async def sync(self) -> int:
        """One tick: agree on what is done on every rank and retire it. Returns items retired.

        Every rank must call it at the same point of the same call sequence. Cancelling the
        caller does not cancel the tick (the peers are in the collective): it still applies.
        """
        while self._tick is not None:  # a cancelled earlier tick still finishing
            await asyncio.shield(self._tick)
        tier = self._storage()
        ops, entries = tier.agreement_entries() if tier is not None else ([], [])
        ops, entries = ops[:TICK_PREFETCHES], entries[:TICK_PREFETCHES]
        padding = [0] * (ENTRY_WIDTH * (TICK_PREFETCHES - len(ops)))
        counts = [self._ready_through(lane) for lane in LANES]
        self._progress.clear()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int] = loop.create_future()
        self._tick = done
        checks = [self.ticks, *self._tree_state(), *self.retired.values(), len(ops)]
        values = (checks + [-c for c in checks] + counts + [v for e in entries for v in e]
                  + padding)
        if self.failed is not None:
            reduced: asyncio.Future[list[int]] = loop.create_future()
            reduced.set_result(values)
        else:
            try:
                reduced = self.group.submit_min(values)
            except RankGroupError as exc:
                self._tick = None
                self.failed = exc
                raise

        def apply(fut: asyncio.Future[list[int]]) -> None:
            self._tick = None
            try:
                agreed = fut.result()
            except BaseException as exc:
                err = exc if isinstance(exc, RankGroupError) else RankGroupError(
                    f"tick failed: {exc!r}")
                self.failed = self.failed or err
                _log.error("tick_failed", error=str(err))
                done.set_exception(err)
                return
            k = len(checks)
            lo, hi = agreed[:k], [-x for x in agreed[k : 2 * k]]
            if lo != hi:
                bad = ", ".join(f"{name} {a}..{b}" for name, a, b in zip(CHECKS, lo, hi,
                                                                       strict=False) if a != b)
                err = RankGroupError(
                    f"rank {getattr(self.group, 'rank', '?')}: ranks diverged at a tick ({bad}); "
                    "every rank must make the same cache calls in the same order")
                self.failed = self.failed or err
                _log.error("ranks_diverged", error=str(err))
                done.set_exception(err)
                return
            agreed = agreed[2 * k :]
            self.held_back += sum(c - a for c, a in zip(counts, agreed, strict=False))
            n = self._retire(agreed[: len(LANES)])
            if ops:
                rest = agreed[len(LANES):]
                tier.apply_agreement(ops, [rest[i * ENTRY_WIDTH:(i + 1) * ENTRY_WIDTH]
                                           for i in range(len(ops))])
            self.ticks += 1
            done.set_result(n)

        reduced.add_done_callback(apply)
        return await asyncio.shield(done)

    def _retire(self, agreed: Sequence[int]) -> int:
        n = 0
        for lane, upto in zip(LANES, agreed, strict=True):
            q = self.lanes[lane]
            while self.retired[lane] < upto:
                item = q.popleft()
                self.retired[lane] += 1
                self._pending.discard(item.token)
                n += 1
                try:
                    item.apply()
                except Exception as exc:  # a commit must not stop the others: log it
                    _log.error("deferred_commit_failed", lane=lane, error=repr(exc))
        return n

    async def until(self, done: Callable[[], bool]) -> None:
        """Tick until ``done()`` (a predicate on agreed state) holds.

        Between ticks that retired nothing it waits (locally) for a local completion or a
        few milliseconds, so waiting ranks do not spin collectives.
        """
        while not done():
            if await self.sync() == 0 and not done() and self._locally_waiting():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._progress.wait(), IDLE_WAIT_S)

    def _locally_waiting(self) -> bool:
        """True while something is unfinished *here* (then wait for it before the next tick;
        otherwise a peer is behind, and the next tick's collective waits for it instead)."""
        if self._progress.is_set():
            return False  # something finished since the last snapshot: tick at once
        if any(not item.ready() for lane in self.lanes.values() for item in lane):
            return True
        tier = self._storage()
        return tier is not None and tier.locally_busy()

    async def settle(self, objs: Sequence[Any]) -> None:
        """Wait until every copy handle / task in ``objs`` has been retired."""
        await self.until(lambda: not any(id(o) in self._pending for o in objs))
