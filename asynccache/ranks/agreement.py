"""Agreement of the ranks of one instance: deferred completions retired at agreed ticks.

With one rank a copy commits the tree in its done-callback. With several ranks each rank's
copies, storage writes and reads finish at different times, so committing on completion would
let two ranks see different trees at the same scheduler call. Instead, with a multi-rank
:class:`~asynccache.ranks.RankGroup`:

* a completion whose commit changes the tree (a D->H backup, an H->D load-back, a storage write
  that holds a host pin) is queued in a FIFO *lane* in submission order and only marked ready
  when it finishes locally. Hybrid caches queue the copies of one operation over every pool
  (FULL KV, SWA KV, Mamba states) as one item, so its component values commit with it;
* :meth:`Agreement.sync` (a *tick*) snapshots, on every rank, how far each lane is ready (an
  absolute index), the first item of each lane that *failed* here, and each prefetch's local
  state, all-reduces them in ONE collective (element-wise MIN; MAX as the MIN of negated
  values) and then retires exactly the agreed number of completions in order and applies the
  agreed prefetch decisions. An item that failed on any rank is retired as failed on every
  rank (its commit is told the failure), and a tick retires nothing past it, so a copy that
  failed on one rank commits on none;
* the tick also compares the tree and pool state every rank must share (nodes, tokens per
  tier, and for hybrid caches every component's device units and every pool's usage): ranks
  that took different decisions fail with "ranks diverged" at the next tick;
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
#: The cache's own state (``tree_state``, named by ``state_names``) goes between "tick" and
#: "copies retired".
TREE_STATE = ("tree nodes", "device tokens", "host tokens")
CHECKS = ("tick", *TREE_STATE, "copies retired", "storage writes retired", "prefetches")
#: "No item of this lane failed here" in the failure vector of a tick.
NO_FAILURE = 2**62
#: Prefetches one tick carries (the vector has a fixed size on every rank, so ranks that
#: disagree on how many there are get a clear error, not a collective of mismatched sizes —
#: which gloo answers by aborting the process). Later ones wait for a following tick.
TICK_PREFETCHES = 32
ENTRY_WIDTH = 6
#: How long a tick with nothing retired waits for local progress before the next one.
IDLE_WAIT_S = 0.005


@dataclass(eq=False, slots=True)
class _Deferred:
    ready: Callable[[], bool]
    apply: Callable[[BaseException | None], object]  # told the failure agreed for the item
    token: int  # id() of the handle / task it stands for
    failed: Callable[[], bool] | None = None  # once ready: did it fail here?


class PeerCopyError(RuntimeError):
    """A copy that completed here but failed on another rank: it is retired as failed on
    every rank (so nothing of it commits anywhere)."""


def _copy_failed(handle: Any) -> bool:
    try:
        handle.result()
    except Exception:
        return True
    return False


class Agreement:
    """The deferred-completion lanes and the tick of one multi-rank cache."""

    def __init__(self, group: Any, storage: Callable[[], Any],
                 tree_state: Callable[[], Sequence[int]] = tuple,
                 state_names: Sequence[str] = TREE_STATE) -> None:
        self.group = group
        self._storage = storage  # -> the attached StorageTier (or None), asked for its entries
        self._tree_state = tree_state  # -> one int per name of ``state_names``: must agree
        self.checks = ("tick", *state_names, *CHECKS[1 + len(TREE_STATE):])
        self.lanes: dict[str, deque[_Deferred]] = {name: deque() for name in LANES}
        self.retired: dict[str, int] = dict.fromkeys(LANES, 0)  # absolute, equal on every rank
        self._pending: set[int] = set()
        self._progress = asyncio.Event()
        self._tick: asyncio.Future[int] | None = None
        self.ticks = 0
        #: completions that were done here but not yet on some peer at a tick (held back)
        self.held_back = 0
        #: items retired as failed, on every rank, because they failed on some rank
        self.failed_items = 0
        #: set when a tick failed (a peer died or timed out): later ticks agree with this rank
        #: alone, so the cache can still drain and close; its tree may then differ from peers'.
        self.failed: RankGroupError | None = None

    # ------------------------------------------------------------------ deferring
    def defer(self, lane: str, ready: Callable[[], bool],
              apply: Callable[[BaseException | None], object], token: int,
              failed: Callable[[], bool] | None = None) -> None:
        self.lanes[lane].append(_Deferred(ready, apply, token, failed))
        self._pending.add(token)

    def defer_copy(self, handle: Any, apply: Callable[[BaseException | None], object]) -> None:
        """Commit ``handle`` (a copy, or a :class:`~asynccache.transfers.hybrid_copies.GroupHandle` of
        one operation's copies over several pools) at the tick that agrees it finished on
        every rank. ``apply`` gets None, or a :class:`PeerCopyError` when the copy succeeded
        here but failed on another rank (then it must undo it as a failed copy; a local
        failure it reads from the handle itself)."""
        self.defer("copies", lambda: handle.finished, apply, id(handle),
                   lambda: _copy_failed(handle))
        handle.add_done_callback(lambda _h: self._progress.set())

    def defer_task(self, task: asyncio.Task[Any], apply: Callable[[], object]) -> None:
        """Run ``apply`` at the tick that agrees ``task`` (a storage write) ended everywhere."""
        self.defer("storage", task.done, lambda _err: apply(), id(task))
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
    def _ready_through(self, lane: str) -> tuple[int, int]:
        """(absolute index the lane is ready to, absolute index of its first ready item that
        failed here or :data:`NO_FAILURE`)."""
        n = 0
        first_failed = NO_FAILURE
        for item in self.lanes[lane]:
            if not item.ready():
                break
            if first_failed == NO_FAILURE and item.failed is not None and item.failed():
                first_failed = self.retired[lane] + n
            n += 1
        return self.retired[lane] + n, first_failed

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
        lanes = [self._ready_through(lane) for lane in LANES]
        counts = [c for c, _ in lanes] + [f for _, f in lanes]
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
                bad = ", ".join(f"{name} {a}..{b}" for name, a, b in zip(self.checks, lo, hi,
                                                                       strict=False) if a != b)
                err = RankGroupError(
                    f"rank {getattr(self.group, 'rank', '?')}: ranks diverged at a tick ({bad}); "
                    "every rank must make the same cache calls in the same order")
                self.failed = self.failed or err
                _log.error("ranks_diverged", error=str(err))
                done.set_exception(err)
                return
            agreed = agreed[2 * k :]
            nl = len(LANES)
            self.held_back += sum(c - a for c, a in zip(counts[:nl], agreed[:nl], strict=True))
            n = self._retire(agreed[:nl], agreed[nl : 2 * nl])
            if ops:
                rest = agreed[2 * nl:]
                tier.apply_agreement(ops, [rest[i * ENTRY_WIDTH:(i + 1) * ENTRY_WIDTH]
                                           for i in range(len(ops))])
            self.ticks += 1
            done.set_result(n)

        reduced.add_done_callback(apply)
        return await asyncio.shield(done)

    def _retire(self, agreed: Sequence[int], failures: Sequence[int]) -> int:
        n = 0
        for lane, upto, failed_at in zip(LANES, agreed, failures, strict=True):
            q = self.lanes[lane]
            if failed_at < upto:  # retire through the failed item; the rest at a later tick
                upto = failed_at + 1
                self.failed_items += 1
            while self.retired[lane] < upto:
                item = q.popleft()
                index = self.retired[lane]
                self.retired[lane] += 1
                self._pending.discard(item.token)
                n += 1
                err = None
                if index == failed_at:
                    err = PeerCopyError(
                        f"a copy of this operation failed on a peer rank (lane {lane}, item "
                        f"{index}); every rank retires it as failed")
                try:
                    item.apply(err)
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
