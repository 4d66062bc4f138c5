"""Drivers that run one write-back workload on SGLang's real tree and on ours, side by side.

``SGLangWriteBack`` drives SGLang 0.5.23's own ``UnifiedTreeCore`` (its Python core, or the
Rust core its cache uses by default) the way its ``UnifiedRadixCache`` does under
``--hicache-write-policy write_back`` for a FULL-only model: an eviction backs each un-backed
victim up, retires the copy's acknowledgement and demotes the victim before the walk picks the
next one; a load-back pins, commits and then finishes the loaded path; host eviction is the
tree's ``drive_host_eviction``. The copies themselves are not simulated (slot numbers only): the
tree decides the victims, the cache only moves data. Only the tree core is needed, so the
driver imports without SGLang's serving stack (``openai`` and friends).

``OursWriteBack`` runs the same operations on asynccache's ``RadixTree``: an eviction commits
the backups it asks for and evicts again until it has freed enough (what the engine's
``evict_async`` does), a load-back starts and commits at once. Every operation ends with the
tree's ``sanity_check``.

Both drivers also run the other write policies (``write_policy="write_through"`` or
``"write_through_selective"``): the backups an insert asks for are copied and acknowledged at
once, and an eviction deletes an un-backed victim. ``prefetch`` is the last step of a storage
prefetch (L3 -> L2): the fetched pages after a match go into the host tier with the tree's host
insert (SGLang's ``insert_host`` under the match's anchor, ours ``insert_host(key, start, ..)``),
optionally after another request cached part of them on device meanwhile; it returns which of
the fetched pages the tree gave back.

Both report what happened through the trees' KV events, so nothing depends on node ids: every
page is named by its token path from the root (the events' block hashes are chained, so a hash
names one path). ``evict_host`` returns the pages whose host copies went, in order;
``resident`` says which pages each tier holds.

``Differential`` holds what the FULL and hybrid differential state machines
(``test_sglang_write_back.py``, ``test_sglang_hybrid_write_back.py``) share.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from asynccache.tree import RadixTree
from asynccache.tree.events import BlockRemoved, BlockStored

try:
    from asynccache.integrations.sglang_import_guard import missing_package_stand_in

    with missing_package_stand_in():
        import torch
        from sglang.srt.disaggregation.kv_events import BlockRemoved as SgRemoved
        from sglang.srt.disaggregation.kv_events import BlockStored as SgStored
        from sglang.srt.environ import envs
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.mem_cache.unified_cache.cache_action import BackupKV
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
        from sglang.srt.mem_cache.unified_cache.components.full import FullComponent
        from sglang.srt.mem_cache.unified_cache.tree_core_registry import create_tree_core
        from sglang.srt.mem_cache.unified_cache.unified_tree_core import (  # noqa: F401
            UnifiedTreeCore,  # (importing it registers the Python core)
        )
        from sglang.srt.mem_cache.utils import get_hash_str
    SGLANG_PROBLEM: str | None = None
except Exception as exc:  # not installed (scripts/install_sglang_cpu.sh installs it)
    SGLANG_PROBLEM = f"SGLang's tree core does not import here ({exc!r})"

FULL = None if SGLANG_PROBLEM else ComponentType.FULL


def rust_core_problem() -> str | None:
    """Why SGLang's Rust tree core cannot be driven here, or None (SGLang quietly falls back
    to its Python core where the Rust one is unsupported)."""
    if SGLANG_PROBLEM is not None:
        return SGLANG_PROBLEM
    try:
        got = SGLangWriteBack(backend="rust").backend
    except Exception as exc:
        return f"SGLang's Rust tree core does not load here ({exc!r})"
    return None if "Rust" in got else f"SGLang chose its {got} instead of the Rust core"


Page = tuple[str, tuple[int, ...]]  # (medium: "gpu" or "cpu", token path from the root)


def _paths(events: list[Any], names: dict[int, tuple[int, ...]], ps: int,
           stored_type: type, removed_type: type, resident: set[Page]) -> list[Page]:
    """Record the pages ``events`` store (hash -> token path; ``resident`` gains them) and
    return the removals, in order, as (medium, path) pairs (``resident`` loses them)."""
    out = []
    for e in events:
        medium = "cpu" if "CPU" in str(e.medium) else "gpu"
        if isinstance(e, stored_type):
            prev = names.get(e.parent_block_hash, ()) if e.parent_block_hash is not None else ()
            for i, h in enumerate(e.block_hashes):
                prev = prev + tuple(e.token_ids[i * ps : (i + 1) * ps])
                names[h] = prev
                resident.add((medium, prev))
        elif isinstance(e, removed_type):
            gone = [(medium, names[h]) for h in e.block_hashes]
            resident.difference_update(gone)
            out.extend(gone)
    return out


WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")


class SGLangWriteBack:
    """SGLang's ``UnifiedTreeCore`` (backend ``"python"`` or ``"rust"``) under write-back (or
    ``write_policy``)."""

    def __init__(self, page_size: int = 1, backend: str = "python", policy: str = "lru",
                 write_policy: str = "write_back") -> None:
        assert SGLANG_PROBLEM is None, SGLANG_PROBLEM
        assert write_policy in WRITE_POLICIES, write_policy
        self.ps = page_size
        self.write_policy = write_policy
        params = CacheInitParams(
            req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=page_size,
            disable=False, tree_components=(FULL,), eviction_policy=policy,
            enable_kv_cache_events=True, tree_core_backend=backend)
        with envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.override(backend):
            # (the component reads only these of its cache on the paths driven here)
            owner = SimpleNamespace(enable_session_radix_cache=False, page_size=page_size,
                                    is_swa_enabled=False)
            core = create_tree_core(backend, params, {FULL: FullComponent(owner, params)})
        self._adopt(core, (FULL,))

    def _adopt(self, core: Any, kinds: tuple[Any, ...]) -> None:
        """Take ``core`` (with the component types ``kinds``) as the cache does under
        write-back (or the driver's ``write_policy``), and start the driver's own
        bookkeeping."""
        self.core = core
        self.kinds = kinds
        self.backend = type(core).__name__
        core.set_hicache_enabled()
        policy = getattr(self, "write_policy", "write_back")
        core.is_write_back = policy == "write_back"
        # (what the cache sets; write-back counts no hits)
        core.write_through_threshold = 1 if policy == "write_through" else 2
        self.next_slot = 0
        self.names: dict[int, tuple[int, ...]] = {}
        self.resident: set[Page] = set()
        self.locks: list[tuple[int, Any]] = []

    def _slots(self, n: int) -> Any:
        out = torch.arange(self.next_slot, self.next_slot + n, dtype=torch.int64)
        self.next_slot += n
        return out

    def _key(self, tokens: list[int]) -> Any:
        return RadixKey(array("q", tokens))

    def removed(self) -> list[Page]:
        return _paths(self.core.take_events(), self.names, self.ps, SgStored, SgRemoved,
                      self.resident)

    def pages(self) -> set[Page]:
        """The pages each tier holds now (as the KV events tell)."""
        self.removed()
        return set(self.resident)

    def _actions(self, actions: list[Any]) -> None:
        # Under write-back an insert or a match only frees duplicate slots or moves a pending
        # copy to a split fragment. Under the write-through policies an insert's backups are
        # copied and acknowledged at once (root first, as the action lists them).
        backups = [a for a in actions if isinstance(a, BackupKV)]
        assert not (backups and self.core.is_write_back), actions
        for a in backups:
            for nid in a.node_ids:
                self._backup(nid)

    def insert(self, tokens: list[int], **params: Any) -> None:
        """Insert ``tokens`` (``params``: more ``InsertParams`` fields)."""
        step = self.core.begin_insert(InsertParams(key=self._key(tokens),
                                                   value=self._slots(len(tokens)), **params))
        try:
            while True:
                self._actions(step.actions)
                if step.result is not None:
                    break
                step = self.core.resume_insert()
        finally:
            self._actions(self.core.end_insert())

    def match(self, tokens: list[int]) -> tuple[int, int, Any]:
        m = self.core.match_prefix(MatchPrefixParams(key=self._key(tokens)))
        self._actions(m.cache_actions)
        return m.device_prefix_len, m.host_hit_length, m

    def _spent(self, res: Any) -> dict[Any, int]:
        """Take a step result's frees and actions (the cache frees the slots; SGLang's results
        assert at disposal that they were taken) and return its evicted counts."""
        self._actions(res.cache_actions)
        res.cache_actions.clear()
        res.device_frees.clear()
        res.host_frees.clear()
        return dict(res.tracker)

    def _place_components(self, comp: Any) -> None:
        """Give the component data of a backup its host slots (none in a FULL-only tree)."""
        assert not comp

    def _backup(self, node_id: Any) -> None:
        """The cache's write-back copy of one victim: commit, mark pending, retire the ack."""
        device_value, comp = self.core.build_backup_spec(node_id)
        assert device_value.numel()
        self._place_components(comp)
        self.core.commit_backup(node_id, self._slots(len(device_value)) + 10**6, comp)
        ids = self.core.mark_write_through_pending([node_id], ack_id=node_id)
        self.core.finish_write_through(ids, node_id)

    def evict(self, num_tokens: int) -> int:
        """Evict ``num_tokens`` FULL tokens (the FULL walk, as the cache's ``_evict`` runs it)."""
        tracker = {ct: 0 for ct in self.kinds}

        def add(delta: dict[Any, int]) -> None:
            for ct, k in delta.items():
                tracker[ct] = tracker.get(ct, 0) + k

        if num_tokens <= 0:
            return 0
        self.core.evict_device_start(FULL, num_tokens)
        try:
            while True:
                step = self.core.evict_device_next_node(FULL, dict(tracker))
                add(self._spent(step))
                node_id = step.node_id
                if node_id is None:
                    if not step.made_progress:
                        break
                    continue
                leaf = self.core.evict_device_leaf(node_id, self.core.is_write_back)
                add(self._spent(leaf))
                if leaf.backup_kv is not None:
                    for nid in leaf.backup_kv.node_ids:
                        self._backup(nid)
                    add(self._spent(self.core.demote(node_id)))
        finally:
            self.core.evict_device_end(FULL)
        return tracker[FULL]

    def load(self, tokens: list[int]) -> int:
        """Match ``tokens`` and load its host hit back (as the cache's ``load_back`` then its
        ``loading_check``); returns the tokens loaded."""
        _, host, m = self.match(tokens)
        if not host:
            return 0
        node = m.best_match_node
        host_lock = self.core.inc_host_lock_ref(node).to_dec_params()
        path_lock = self.core.inc_lock_ref(node).to_dec_params()
        kv, comp = self.core.build_load_back_spec(node)
        assert not comp
        n = len(kv.host_indices)
        assert n == host, (n, host)
        device = self._slots(n)
        self.core.dec_lock_ref(node, path_lock)
        self.core.commit_load_back(node, device, kv, comp)
        hold = self.core.inc_lock_ref(node).to_dec_params()
        # the copy lands: loading_check
        self.core.dec_lock_ref(node, hold)
        self.core.dec_host_lock_ref(node, host_lock)
        self.core.finish_load_back(node)
        return n

    def lock(self, tokens: list[int]) -> bool:
        dev, _, m = self.match(tokens)
        if not dev:
            return False
        node = m.last_device_node
        self.locks.append((node, self.core.inc_lock_ref(node).to_dec_params()))
        return True

    def unlock(self) -> None:
        node, params = self.locks.pop(0)
        self.core.dec_lock_ref(node, params)

    def evict_host(self, num_tokens: int) -> tuple[int, list[tuple[int, ...]]]:
        self.removed()
        freed = self._spent(self.core.drive_host_eviction(FULL, num_tokens)).get(FULL, 0)
        gone = self.removed()
        assert all(m == "cpu" for m, _ in gone), gone
        return freed, [p for _, p in gone]

    def prefetch(self, tokens: list[int], meanwhile: Sequence[list[int]] = ()) -> list[int]:
        """The end of a storage prefetch of ``tokens`` (as the cache's
        ``_handle_prefetch_result``): the pages after the match go into the host tier under the
        match's anchor (its ``last_host_node``, host-locked meanwhile). ``meanwhile``: keys
        other requests insert on device while the pages are read. Returns the offsets
        (tokens into the fetched span) whose host slots the cache frees: the first
        ``prefix_len`` (pages the tree already had), or all when the insert was dropped."""
        dev, host, m = self.match(tokens)
        anchor = m.last_host_node
        start = dev + host
        pin = self.core.inc_host_lock_ref(anchor).to_dec_params()
        for other in meanwhile:
            self.insert(other)
        span = tokens[start:]
        chain = get_hash_str(tokens, None, self.ps) if tokens else []
        res = self.core.insert_host(anchor, self._key(span), self._slots(len(span)) + 3 * 10**6,
                                    chain[start // self.ps :])
        self._actions(res.cache_actions)
        self.core.dec_host_lock_ref(anchor, pin)
        freed = len(span) if res.host_insert_dropped else res.prefix_len
        return list(range(freed))


class OursWriteBack:
    """asynccache's ``RadixTree`` under write-back, driven like :class:`SGLangWriteBack`."""

    def __init__(self, page_size: int = 1, policy: str = "lru",
                 write_policy: str = "write_back", **tree: Any) -> None:
        """``tree``: more ``RadixTree`` arguments (the hybrid driver's components)."""
        assert write_policy in WRITE_POLICIES, write_policy
        self.ps = page_size
        self.tree = RadixTree(page_size=page_size, host_enabled=True, write_policy=write_policy,
                              eviction_policy=policy, enable_kv_events=True, **tree)
        self.next_slot = 0
        self.names: dict[int, tuple[int, ...]] = {}
        self.resident: set[Page] = set()
        self.locks: list[Any] = []

    def _slots(self, n: int) -> np.ndarray:
        out = np.arange(self.next_slot, self.next_slot + n, dtype=np.int64)
        self.next_slot += n
        return out

    def removed(self) -> list[Page]:
        return _paths(self.tree.take_events(), self.names, self.ps, BlockStored, BlockRemoved,
                      self.resident)

    def pages(self) -> set[Page]:
        """The pages each tier holds now (as the KV events tell)."""
        self.removed()
        return set(self.resident)

    def insert(self, tokens: list[int], *, check: bool = True, **params: Any) -> None:
        """Insert ``tokens`` (``params``: more ``insert`` arguments); write-through backups
        are copied and committed at once, root first. ``check``: run ``sanity_check``."""
        res = self.tree.insert(tokens, self._slots(len(tokens)), **params)
        for b in res.backups:
            self.tree.commit_backup(b.op_id, self._slots(len(b.device_slots)) + 10**6)
        if check:
            self.tree.sanity_check()

    def match(self, tokens: list[int]) -> tuple[int, int, Any]:
        m = self.tree.match_prefix(tokens)
        self.tree.sanity_check()
        return m.device_prefix_len, m.host_hit_length, m

    def evict(self, num_tokens: int) -> int:
        """Evict as the engine's ``evict_async`` does: rounds of ``tree.evict``, each round's
        write-back copies committed before the next, which asks for at least the tokens of the
        last round's victims that still wait for their demotion (the tree counts them toward
        the target; the reference demotes each victim before it takes the next)."""
        freed = owed = 0
        while (want := max(num_tokens - freed, owed)) > 0:
            res = self.tree.evict(want)
            freed += res.num_evicted
            if not res.backups:
                break
            owed = res.pending_tokens
            for b in res.backups:
                self._commit(b)
        self.tree.sanity_check()
        return freed

    def _commit(self, req: Any) -> Any:
        """The engine's copy of one write-back backup, committed (fresh host slots)."""
        return self.tree.commit_backup(req.op_id, self._slots(len(req.device_slots)) + 10**6)

    def load(self, tokens: list[int]) -> int:
        _, host, m = self.match(tokens)
        if not host:
            return 0
        need = self.tree.load_back_sizes(m.best_node)["full"]
        assert need == host, (need, host)
        ticket = self.tree.start_load_back(m.best_node, self._slots(need))
        self.tree.commit_load_back(ticket.op_id)
        self.tree.sanity_check()
        return need

    def lock(self, tokens: list[int]) -> bool:
        dev, _, m = self.match(tokens)
        if not dev:
            return False
        self.locks.append(self.tree.lock(m.last_device_node))
        self.tree.sanity_check()
        return True

    def unlock(self) -> None:
        self.tree.unlock(self.locks.pop(0))
        self.tree.sanity_check()

    def evict_host(self, num_tokens: int) -> tuple[int, list[tuple[int, ...]]]:
        self.removed()
        res = self.tree.evict_host(num_tokens)
        self.tree.sanity_check()
        gone = self.removed()
        assert all(m == "cpu" for m, _ in gone), gone
        return res.num_evicted, [p for _, p in gone]

    def prefetch(self, tokens: list[int], meanwhile: Sequence[list[int]] = ()) -> list[int]:
        """:meth:`SGLangWriteBack.prefetch` on ours, as the cache's L3 tier ends a prefetch:
        the pages after the match (from ``device_prefix_len + host_hit_length``) go in with
        ``insert_host``, the match's best node host-locked meanwhile."""
        m = self.tree.match_prefix(tokens)
        start = m.device_prefix_len + m.host_hit_length
        pin = self.tree.lock_host(m.best_node)
        for other in meanwhile:
            self.insert(other, check=False)  # (checked once, at the end)
        span = self._slots(len(tokens) - start) + 3 * 10**6
        res = self.tree.insert_host(tokens, start, span)
        self.tree.unlock_host(pin)
        self.tree.sanity_check()
        back = np.concatenate(res.device_frees) if res.device_frees else span[:0]
        assert len(np.unique(back)) == len(back) and np.isin(back, span).all(), (back, span)
        assert not np.isin(back, self.tree.host_slots()).any()
        kept = int(np.isin(span, self.tree.host_slots()).sum())
        assert kept + len(back) == len(span), (kept, back, span)
        return sorted(int(i) for i in back - span[0]) if len(span) else []


POLICIES = ["lru", "mru", "fifo", "filo", "lfu", "priority"]  # (the ones both trees have)
pages = st.integers(1, 6)


class Differential(RuleBasedStateMachine):
    """The rules and helpers the differential machines share. A subclass's ``setup`` sets
    ``ps``, ``ref`` (SGLang's driver) and ``ours`` (ours, driven alike), and adds the rules
    that draw keys."""

    ps: int
    ref: Any
    ours: Any

    def _tokens(self, key: list[int]) -> list[int]:
        """Page symbols -> tokens (page ``p`` is ``10p, 10p+1, ...``)."""
        return [10 * p + j for p in key for j in range(self.ps)]

    def _same_events(self, sort: bool = False) -> None:
        got, want = self.ours.removed(), self.ref.removed()
        if sort:
            got, want = sorted(got), sorted(want)
        assert got == want

    @rule(n=pages)
    def evict(self, n: int) -> None:
        got, want = self.ours.evict(n * self.ps), self.ref.evict(n * self.ps)
        gone, ref_gone = sorted(self.ours.removed()), sorted(self.ref.removed())
        assert got == want
        assert gone == ref_gone

    @precondition(lambda self: hasattr(self, "ours") and self.ours.locks)
    @rule()
    def unlock(self) -> None:
        self.ours.unlock()
        self.ref.unlock()


def driver_params(policy: str = "lru", ours_marks: Any = ()) -> list[Any]:
    """``pytest.param``s of a factory per driver (ours, SGLang's Python and Rust cores, each
    skipped where it cannot run) for ``@pytest.mark.parametrize("make", ...)``."""
    sg = pytest.mark.skipif(SGLANG_PROBLEM is not None, reason=SGLANG_PROBLEM or "")
    rust = rust_core_problem()
    return [
        pytest.param(lambda: OursWriteBack(policy=policy), id="ours", marks=ours_marks),
        pytest.param(lambda: SGLangWriteBack(backend="python", policy=policy),
                     id="sglang-python", marks=sg),
        pytest.param(lambda: SGLangWriteBack(backend="rust", policy=policy), id="sglang-rust",
                     marks=pytest.mark.skipif(rust is not None, reason=rust or "")),
    ]
