"""Tiering: the L1/L2 engine of one cache.

Tree calls with their metrics (match, insert, lock), eviction (device and host), the one
evict-and-retry allocation loop, operation-owned host slots, and D->H backups with their
commits. It knows nothing of storage, buffers or requests: storage hears of backups and write
intents through :class:`~asynccache.engine.ports.StoragePorts`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np

from asynccache.engine.copies import CommitPolicy, CopyTracker, copy_error
from asynccache.engine.effects import Effects
from asynccache.engine.ledger import CALLER, SlotLedger
from asynccache.engine.parts import Parts
from asynccache.engine.slots import DeviceSlots, device_slots
from asynccache.errors import InvalidInputError, PoolExhaustedError
from asynccache.logs import get_logger
from asynccache.transfers.engine import CopyEngine
from asynccache.transfers.handles import CopyHandle, LayerwiseHandle
from asynccache.transfers.hybrid_copies import GroupHandle
from asynccache.transfers.indices import SlotIndices
from asynccache.tree import (
    BackupRequest,
    InsertResult,
    LockReceipt,
    MatchResult,
    RadixKey,
    as_key,
    as_slots,
)
from asynccache.tree.results import EMPTY_SLOTS

_log = get_logger("cache")

_MAX_ALLOC_ROUNDS = 64


class Tiering:
    """Device and host tiers of one cache (see the module docstring)."""

    def __init__(self, parts: Parts, commits: CommitPolicy) -> None:
        self.parts = parts
        self.tree = parts.tree
        self.page_size = parts.page_size
        self.commits = commits
        self.copies = CopyTracker()
        host = parts.host_pool
        self.ledger = SlotLedger(parts.device_pool.allocator,
                                 host.allocator if host is not None else None)
        self.slots: DeviceSlots = device_slots(parts.device_pool, parts.hybrid)
        self.effects = Effects(parts, self.slots, self.start_backups)
        self.copier: CopyEngine | None = None  # the KV copy engine (started with a host pool)
        self._matched = 0
        self._hits = 0

    # ------------------------------------------------------------------ keys and tree calls
    def key(self, key: RadixKey | Any) -> RadixKey:
        """``key`` as a RadixKey, its token ids checked against ``max_token_id``."""
        key = as_key(key)
        bound = self.parts.config.max_token_id
        if bound is not None and key.data:
            ids = np.frombuffer(key.data, dtype="<u4")
            if int(ids.max()) > bound:
                pos = int(np.argmax(ids > bound))
                raise InvalidInputError(
                    f"token id {int(ids[pos])} at position {pos} exceeds max_token_id {bound} "
                    "(CacheConfig: the model's largest token id)"
                )
        return key

    def match_prefix(self, key: RadixKey, *, cow_mamba: bool = False) -> MatchResult:
        """Longest cached prefix of a checked ``key`` (a disabled cache: none), counted."""
        if self.parts.config.disable:
            return MatchResult(EMPTY_SLOTS, 0, 0, 0, 0)
        res = self.tree.match_prefix(key, cow_mamba=cow_mamba)
        m = self.parts.metrics
        m.matched_tokens.inc(len(key))
        m.hit_tokens.inc(res.total_hit_length)
        self._matched += len(key)
        self._hits += res.total_hit_length
        if self._matched:
            m.hit_rate.set(self._hits / self._matched)
        return res

    def insert(self, key: RadixKey, value: Any, *, prev_prefix_len: int = 0,
               inserted_len: int = 0, priority: int = 0, swa_evicted_seqlen: int = 0,
               mamba_value: int | None = None, owner: int = CALLER) -> InsertResult:
        """Insert ``key`` -> ``value``; the slots the tree may adopt must be ``owner``'s (the
        caller's, or a request's tag)."""
        value, held = self._check_insert_slots(key, value, prev_prefix_len, owner)
        extra = self.slots_insert_args(value, prev_prefix_len, swa_evicted_seqlen, mamba_value)
        res = self.tree.insert(key, value, prev_prefix_len=prev_prefix_len,
                               inserted_len=inserted_len, priority=priority, **extra)
        self._release_inserted(held, res.cached_len)
        self.effects.inserted(res, mamba_value)
        return res

    def slots_insert_args(self, value: np.ndarray, prev_prefix_len: int,
                          swa_evicted_seqlen: Any, mamba_value: int | None) -> dict[str, Any]:
        """The hybrid arguments of a tree insert, checked (FULL-only caches: none)."""
        hy = self.parts.hybrid
        if hy is None:
            return {}
        if isinstance(swa_evicted_seqlen, bool) or not isinstance(swa_evicted_seqlen, int) or (
            not 0 <= swa_evicted_seqlen <= len(value)
        ):
            raise InvalidInputError(
                f"swa_evicted_seqlen must be an int in [0, {len(value)}], got {swa_evicted_seqlen!r}"
            )
        start = min(len(value), max(swa_evicted_seqlen, prev_prefix_len))
        hy.check_paired(value, start)
        evicted = {"swa": swa_evicted_seqlen} if hy.swa_map is not None else None
        return {"component_evicted_seqlens": evicted, "mamba_value": mamba_value}

    def _check_insert_slots(self, key: RadixKey, value: Any, prev_prefix_len: Any,
                            owner: int) -> tuple[np.ndarray, tuple[int, np.ndarray]]:
        """``value`` as slots, checked before the tree sees them: from the page of
        ``prev_prefix_len`` to the key's last whole page (what the tree adopts or gives back as
        duplicates) they must be whole pages the caller holds. Returns the slots and (that
        start, those pages) for :meth:`_release_inserted`. (Malformed arguments are left to the
        tree's own checks, which name them.)"""
        slots = as_slots(value, "value")
        ps = self.page_size
        end = len(key) - len(key) % ps
        if (isinstance(prev_prefix_len, bool) or not isinstance(prev_prefix_len, int)
                or not 0 <= prev_prefix_len <= len(slots) or len(slots) != len(key)):
            return slots, (end, EMPTY_SLOTS)
        lo = prev_prefix_len - prev_prefix_len % ps
        pages = self.ledger.check(slots[lo:end], "value", owner) if end > lo else EMPTY_SLOTS
        return slots, (lo, pages)

    def _release_inserted(self, held: tuple[int, np.ndarray], cached_len: int) -> None:
        """The caller's pages up to the insert's cached length are the tree's now (adopted, or
        freed as duplicates); those past it stay the caller's."""
        lo, pages = held
        n = max(0, cached_len - lo) // self.page_size
        if n:
            self.ledger.release_pages(pages[:n])

    def lock(self, node_id: int, *, skip: tuple[str, ...] = ()) -> LockReceipt:
        return self.tree.lock(node_id, skip=skip)

    def unlock(self, receipt: LockReceipt) -> int:
        return self.tree.unlock(receipt)

    # ------------------------------------------------------------------ device slots
    def round_up(self, n: int) -> int:
        ps = self.page_size
        return -(-n // ps) * ps

    def try_alloc(self, num_tokens: int, swa_tokens: int | None = None,
                  owner: int = CALLER) -> np.ndarray | None:
        """Slots for ``num_tokens`` (whole pages), evicting synchronously if short; None when
        even eviction cannot make room (then nothing is evicted: a shortfall beyond the
        evictable tokens fails whatever goes). They are the caller's (the ledger counts them)."""
        slots = self.slots.alloc(num_tokens, swa_tokens)
        if slots is None:
            full, swa = self.slots.shortfall(num_tokens, swa_tokens)
            if full <= self.tree.evictable_size:  # else evicting could not make room
                self.evict(full, swa_num_tokens=swa)
                slots = self.slots.alloc(num_tokens, swa_tokens)
        if slots is not None:
            self.ledger.hand_out(slots, owner)
        return slots

    async def alloc(self, num_tokens: int, swa_tokens: int | None = None,
                    owner: int = CALLER) -> np.ndarray:
        """Slots for ``num_tokens``, evicting (and writing back) as needed: the one allocation
        loop of the cache. Hybrid caches: FULL slots for all, SWA pairs for the last
        ``swa_tokens`` (None: all). Between tries it waits for copies in flight, which pin
        their victims until they land (write-back and write-through), and, for at most
        ``alloc_wait_s``, for storage writes when their host pins are what protects device
        pages (``tree.host_pinned_size``): a storage write can free nothing else, and a dead
        store must not stall the scheduler. Raises :class:`PoolExhaustedError` when nothing is
        left to wait for. The slots are ``owner``'s (the caller's, or a request's tag)."""
        deadline: float | None = None
        for _ in range(_MAX_ALLOC_ROUNDS):
            got = await self._attempt(num_tokens, swa_tokens, owner)
            if got is not None:
                return got
            in_flight = self.copies.all()
            if in_flight:
                await self.commits.settle(in_flight)
                continue
            ports = self.effects.ports
            if not ports.writes_pending() or not self.tree.host_pinned_size:
                break
            if self.commits.agreement is not None:
                # Several ranks must take the same decision: no local deadline (the drain
                # retires writes at agreed ticks).
                await ports.drain()
                continue
            loop = asyncio.get_running_loop()
            wait_s = self.parts.config.alloc_wait_s
            if deadline is None:
                deadline = loop.time() + wait_s
            left = deadline - loop.time()
            if left <= 0:
                raise PoolExhaustedError(
                    f"{self._alloc_error(num_tokens, swa_tokens)}; {self.tree.host_pinned_size} "
                    f"device tokens wait for storage writes that did not finish within "
                    f"alloc_wait_s={wait_s}"
                )
            # (drain() shields the writes: the timeout only stops this wait.)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ports.drain(), left)
        raise PoolExhaustedError(self._alloc_error(num_tokens, swa_tokens))

    async def _attempt(self, num_tokens: int, swa_tokens: int | None,
                       owner: int) -> np.ndarray | None:
        """:meth:`try_alloc`, but a FULL-only cache's eviction waits for its write-backs."""
        if not self.slots.evicts_async:
            return self.try_alloc(num_tokens, swa_tokens, owner)
        slots = self.slots.alloc(num_tokens)
        if slots is None:
            short = self.slots.shortfall(num_tokens)[0]
            if short > self.tree.evictable_size:
                return None  # evicting could not make room: keep the cache
            await self.evict_async(short)
            slots = self.slots.alloc(num_tokens)
        if slots is not None:
            self.ledger.hand_out(slots, owner)
        return slots

    def _alloc_error(self, num_tokens: int, swa_tokens: int | None) -> str:
        swa = f" with {swa_tokens} SWA slots" if swa_tokens is not None else ""
        t = self.tree
        return (f"cannot allocate {num_tokens} device slots{swa}: {self.slots.describe()}, "
                f"{t.evictable_size} evictable, {t.protected_size} locked, "
                f"{self.ledger.held_tokens} held by requests")

    def free(self, slots: Any, owner: int = CALLER) -> None:
        """Return slots ``owner`` holds (checked by the ledger first: nothing changes when one
        is not ``owner``'s)."""
        arr = as_slots(slots, "slots")
        if len(arr):
            self.free_checked(arr, self.ledger.check(arr, "slots", owner))

    def free_checked(self, slots: np.ndarray, pages: np.ndarray) -> None:
        """Free ``slots``, whose page ids ``pages`` the ledger's ``check`` returned for their
        holder (nothing changed them since)."""
        if len(slots):
            self.ledger.release_pages(pages)
            self.slots.free(slots, pages)

    # ------------------------------------------------------------------ host slots of operations
    def take_host(self, num_tokens: int, *, evict: bool = True) -> np.ndarray | None:
        """Host slots an operation owns (a backup, a prefetch, staging, a retracted request)
        until it gives them back (:meth:`free_host`) or the tree adopts them
        (:meth:`host_adopted`); None when the pool cannot provide them (``evict``: after
        evicting host copies)."""
        host = self.parts.host_pool
        if host is None:
            return None
        alloc = host.allocator
        slots = alloc.alloc(num_tokens)
        if slots is None and evict and num_tokens <= alloc.total_size:
            self.evict_host(num_tokens - alloc.available_size)
            slots = alloc.alloc(num_tokens)
        if slots is not None:
            self.ledger.host_taken(slots)
        return slots

    def free_host(self, slots: SlotIndices) -> None:
        """Give back operation-owned host slots from :meth:`take_host`; slots no operation
        holds (a host copy's, never handed out, already freed) are refused before anything is
        freed (:class:`InvalidInputError` naming one)."""
        if len(slots):
            host = self.parts.host_pool
            if host is None:
                raise InvalidInputError("free_host: this cache has no host pool")
            host.allocator.free_pages(self.ledger.host_returned(slots))

    def host_adopted(self, slots: np.ndarray) -> None:
        """The tree adopted (or freed itself) the host ``slots`` of an operation."""
        if len(slots):
            self.ledger.host_returned(slots)

    # ------------------------------------------------------------------ copies
    def submit_d2h(self, device_slots: np.ndarray, host_slots: np.ndarray) -> CopyHandle:
        """A D->H copy that ``flush``, allocation and close wait for."""
        assert self.copier is not None
        return self.copies.track(self.copier.submit_d2h(device_slots, host_slots))

    def submit_h2d(self, host_slots: np.ndarray, device_slots: np.ndarray) -> LayerwiseHandle:
        """A layer-wise H->D copy that ``flush``, allocation and close wait for."""
        assert self.copier is not None
        handle: LayerwiseHandle = self.copier.submit_h2d_layerwise(host_slots, device_slots)
        self.copies.track(handle)
        return handle

    async def settle(self, handles: Sequence[CopyHandle]) -> None:
        """Wait for copies to land (success or failure); their commits have run by then."""
        await self.commits.settle(handles)

    async def settle_all(self) -> None:
        await self.commits.settle(self.copies.all())

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int, *, swa_num_tokens: int = 0, mamba_num: int = 0) -> int:
        """Free at least ``num_tokens`` device tokens now if possible; returns tokens freed.
        Under write-back, un-backed victims start their write-back copy and are demoted by a
        later call (see :meth:`evict_async`)."""
        started = time.perf_counter()
        res = self.tree.evict(num_tokens, swa_num_tokens=swa_num_tokens, mamba_num=mamba_num)
        self.effects.evicted(res, started)
        return res.num_evicted

    async def evict_async(self, num_tokens: int) -> int:
        """Like :meth:`evict`, but waits for write-back copies and demotes their nodes."""
        fx = self.effects
        before = fx.evicted_total
        # Tokens of this call's victims that wait for their copies: the tree counts them
        # toward the target, and they are demoted by the next round once their copies landed,
        # also when the demotions of other victims reached the target meanwhile (the
        # reference demotes each victim before it takes the next).
        owed = 0
        while (want := max(num_tokens - (fx.evicted_total - before), owed)) > 0:
            started = time.perf_counter()
            res = self.tree.evict(want)
            handles = fx.evicted(res, started)
            if not res.backups:
                break
            owed = res.pending_tokens
            if not handles:
                continue  # no host memory: the victims were dropped (counted)
            await self.commits.settle(handles)
        return fx.evicted_total - before

    def evict_host(self, num_tokens: int, *, reclaim_duplicates: bool | None = None) -> int:
        if not self.parts.config.host_tier:
            return 0
        res = self.tree.evict_host(num_tokens, reclaim_duplicates=reclaim_duplicates)
        self.effects.host_evicted(res)
        return res.num_evicted

    # ------------------------------------------------------------------ backups (D -> H)
    def start_backups(self, reqs: Sequence[BackupRequest]) -> list[CopyHandle]:
        """Submit the D->H copies of ``reqs`` (a root-first chain); commits happen on completion."""
        handles: list[CopyHandle] = []
        failed = [False]  # shared by the chain: a failed ancestor aborts its descendants
        tier = self.parts.hybrid_tier
        for i, req in enumerate(reqs):
            host = self.take_host(req.num_tokens) if self.copier is not None else None
            parts: dict[str, np.ndarray] = {}
            if host is not None and req.component_slots:
                assert tier is not None
                got = tier.alloc_backup(req, self.evict_host)
                if got is None:  # all or nothing: a component pool is short
                    self.free_host(host)
                    self.parts.metrics.hybrid_skipped.labels(op="backup").inc()
                    host = None
                else:
                    parts = got
            if host is None:
                for rest in reqs[i:]:
                    self._backup_failed(rest, "host_pressure")
                break
            assert self.copier is not None
            handle = self.copier.submit_d2h(req.device_slots, host)
            if parts:
                assert tier is not None
                handle = GroupHandle([handle, *tier.submit_d2h(req, parts)])
            self.copies.add(req.op_id, handle)
            self.commits.on_done(handle, partial(self._backup_done, req, host, handle, failed,
                                                 parts))
            handles.append(handle)
        return handles

    def _backup_failed(self, req: BackupRequest, reason: str) -> None:
        self.tree.abort_backup(req.op_id)
        if req.write_back and not req.after_children:
            res = self.tree.drop(req.node_id)
            self.effects.evicted(res)
            self.parts.metrics.dropped_tokens.labels(reason=reason).inc(res.num_evicted)
        _log.info("backup_skipped", node=req.node_id, tokens=req.num_tokens, reason=reason)

    def _backup_done(self, req: BackupRequest, host: np.ndarray, handle: CopyHandle,
                     failed: list[bool], parts: dict[str, np.ndarray],
                     peer_error: BaseException | None = None) -> None:
        """Commit (or undo) a finished backup; ``peer_error``: several ranks, the copy failed on
        another rank, so it is undone here as well."""
        self.copies.discard(req.op_id)
        error = copy_error(handle) or peer_error
        if parts:
            tier = self.parts.hybrid_tier
            assert tier is not None
            tier.release_backup(parts, free=error is not None or failed[0])
        if error is not None or failed[0]:
            failed[0] = True
            self.free_host(host)
            if error is not None:
                _log.warning("backup_failed", node=req.node_id, error=repr(error))
            self._backup_failed(req, "backup_failed")
            return
        self.host_adopted(host)
        ids = self.tree.commit_backup(req.op_id, host, parts)
        self.effects.ports.node_backed_up(ids)
        result = handle.result()
        m = self.parts.metrics
        m.backup_tokens.inc(result.num_tokens)
        m.backup_bytes.inc(result.num_bytes)
        m.backup_duration.observe(result.duration_s)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the copy engines (none without a host tier)."""
        p = self.parts
        if p.host_pool is None:
            return
        self.copier = CopyEngine(p.device_pool, p.host_pool, name="asynccache-copy")
        await self.copier.start()
        tier = p.hybrid_tier
        if tier is not None:
            await tier.start()
        # Sidecars ride their source's engine: every copy of it copies their slots too.
        await p.sidecars.start({
            "kv": self.copier,
            "swa": tier.swa_engine if tier is not None else None,
            "mamba": tier.states.engine if tier is not None and tier.states is not None
            else None})

    def copiers(self) -> list[Any]:
        """Every copier the cache starts copies on (KV, SWA KV, Mamba states)."""
        out: list[Any] = [self.copier]
        tier = self.parts.hybrid_tier
        if tier is not None:
            out += [tier.swa_engine, tier.states.engine if tier.states is not None else None]
        out += self.parts.sidecars.engines()
        return [c for c in out if c is not None]

    async def stop_copiers(self) -> None:
        if self.copier is not None:
            await self.copier.aclose()
        if self.parts.hybrid_tier is not None:
            await self.parts.hybrid_tier.aclose()
        await self.parts.sidecars.aclose()  # after the engines they ride

    def agreed_state(self) -> list[int]:
        """What every rank's tree and pools must share at an agreement tick (names:
        :func:`~asynccache.engine.slots.agreed_state_names`)."""
        tree = self.tree
        return [tree.node_count, tree.device_size, tree.host_size,
                *self.slots.agreed_state(tree)]

    # ------------------------------------------------------------------ accounting and close
    def check(self) -> None:
        """Tree invariants plus pool accounting: every allocated slot has exactly one owner."""
        p = self.parts
        self.tree.sanity_check()
        host = p.host_pool
        self.ledger.check_accounting(
            self.tree.device_size, p.device_pool.allocator.used_size,
            self.tree.host_size if host is not None else None,
            host.allocator.used_size if host is not None else None)
        self.slots.check(self.tree)

    def release_all(self) -> None:
        """The cache closed: free every slot of the tree and of interrupted requests."""
        host = self.parts.host_pool
        tree_host = self.slots.release_tree(self.tree)
        held = self.ledger.take_all()  # requests the close interrupted
        self.slots.free(held)
        if host is not None:
            for slots in tree_host:
                host.allocator.free(slots)
