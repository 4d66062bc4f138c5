"""Hypothesis stateful test of the tree against an exact reference model.

The model knows, for every cached token position (a namespace plus the token prefix ending at
that position), which device slot and which host slot the tree must hold for it. Every tree
result is predicted from the model or checked against it; after every step the tree's
``sanity_check()`` runs, the tree's whole content is compared with the model, and slot
accounting is balanced: every slot the test handed to the tree is either held by the tree
exactly once or was given back exactly once (freed, or the unaligned tail the caller keeps).
A router-side model of the KV events (which hashes are stored on GPU / CPU) must equal the
event hashes of the model's device and host pages.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from typing import Any

import numpy as np
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from asynccache.errors import InvalidInputError, LockError
from asynccache.tree import (
    POLICIES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Medium,
    RadixKey,
    RadixTree,
)
from tests.tree.stateful_cases import machine_case, stateful_settings

NAMESPACES = (None, "lora")
# A cached token position: (extra_key, tokens up to the end of its page, offset in the page).
# Nodes hold whole pages, so the page-ending prefix names a page uniquely.
Pos = tuple[str | None, tuple[int, ...], int]
Page = tuple[str | None, tuple[int, ...]]  # (extra_key, tokens up to the end of a page)


# ---------------------------------------------------------------- independent hashes
def _part(value: str | None) -> bytes:
    if value is None:
        return b"\x00"
    raw = value.encode()
    return b"\x01" + struct.pack("<Q", len(raw)) + raw


_SEEDS = {
    ns: (
        b"" if ns is None
        else hashlib.sha256(b"sglang-cache-namespace-v1" + _part(ns) + _part(None)).digest(),
        None if ns is None
        else hashlib.sha256(b"sglang-kv-event-namespace-v1" + _part(ns) + _part(None)).digest(),
    )
    for ns in NAMESPACES
}
_DIGESTS: dict[tuple[int, Page], bytes] = {}


def _digest(ps: int, path: Page) -> bytes:
    """SHA-256 chain digest of the page ending at ``path`` (path length is a page multiple)."""
    got = _DIGESTS.get((ps, path))
    if got is None:
        ns, toks = path
        seed = _SEEDS[ns][0]  # namespaced pages hash seed || previous digest (zeros) || page
        first = bytes(32) if seed else b""
        prev = first if len(toks) == ps else _digest(ps, (ns, toks[:-ps]))
        got = hashlib.sha256(seed + prev + struct.pack(f"<{ps}I", *toks[-ps:])).digest()
        _DIGESTS[(ps, path)] = got
    return got


def _event_hash(ps: int, path: Page) -> int:
    d = _digest(ps, path)
    seed = _SEEDS[path[0]][1]
    if seed is None:
        return int(struct.unpack(">q", d[:8])[0])
    return int(struct.unpack(">q", hashlib.sha256(seed + d[:8]).digest()[:8])[0])


def _positions(anchor: Page, ps: int) -> set[Pos]:
    """Every position of every page from the root down to the page ``anchor``."""
    ns, toks = anchor
    return {(ns, toks[:k], o) for k in range(ps, len(toks) + 1, ps) for o in range(ps)}


_SMALL = st.integers(0, 3)
_ANY = st.integers(0, 2**16)
_LENGTH = st.integers(0, 9)
_BITS = st.integers(0, 2**9 - 1)


class TreeMachine(RuleBasedStateMachine):
    HOST = False
    WRITE_POLICY = "write_through_selective"

    # ------------------------------------------------------------ set-up
    @initialize(
        ps=st.sampled_from([1, 2, 4]),
        policy=st.sampled_from(sorted(POLICIES)),
        events=st.booleans(),
    )
    def setup(self, ps: int, policy: str, events: bool) -> None:
        self.ps = ps
        self.events_on = events
        self.tree = RadixTree(
            page_size=ps,
            eviction_policy=policy,
            host_enabled=self.HOST,
            write_policy=self.WRITE_POLICY,
            enable_kv_events=events,
            enable_page_hashes=events,
            device_tokens=16 * ps,  # the arc policy's capacity (small: p and the ghosts move)
        )
        self.next_dev = 0
        self.next_host = 1_000_000
        self.dev_given: set[int] = set()
        self.dev_back: set[int] = set()  # freed by the tree or kept by the caller
        self.host_given: set[int] = set()
        self.host_back: set[int] = set()
        self.model_dev: dict[Pos, int] = {}
        self.model_host: dict[Pos, int] = {}
        self.dev_owner: dict[int, Pos] = {}
        self.host_owner: dict[int, Pos] = {}
        self.receipts: list[tuple[Any, Page | None]] = []
        self.host_receipts: list[tuple[Any, Page | None]] = []
        self.backups: dict[int, tuple[Any, Page]] = {}  # op -> (request, anchor page)
        self.loads: dict[int, tuple[Any, list[Pos]]] = {}  # op -> (ticket, positions)
        self.history: list[tuple[str | None, tuple[int, ...]]] = []
        self.history_set: set[tuple[str | None, tuple[int, ...]]] = set()
        self.router: dict[Medium, set[int]] = {Medium.GPU: set(), Medium.CPU_PINNED: set()}
        self.hash_page: dict[int, Page] = {}
        self.stale_receipt: Any = None
        self.steps_since_reset = 0

    # ------------------------------------------------------------ helpers
    def _pos(self, ns: str | None, toks: tuple[int, ...], i: int) -> Pos:
        ps = self.ps
        return (ns, toks[: (i // ps + 1) * ps], i % ps)

    def _dev(self, n: int) -> np.ndarray:
        out = np.arange(self.next_dev, self.next_dev + n, dtype=np.int64)
        self.next_dev += n
        self.dev_given.update(out.tolist())
        return out

    def _host(self, n: int) -> np.ndarray:
        out = np.arange(self.next_host, self.next_host + n, dtype=np.int64)
        self.next_host += n
        self.host_given.update(out.tolist())
        return out

    def _give_back_dev(self, slots: list[int]) -> None:
        for s in slots:
            assert s in self.dev_given, f"device slot {s} was never given to the tree"
            assert s not in self.dev_back, f"device slot {s} given back twice"
            self.dev_back.add(s)

    def _give_back_host(self, slots: list[int]) -> None:
        for s in slots:
            assert s in self.host_given, f"host slot {s} was never given to the tree"
            assert s not in self.host_back, f"host slot {s} given back twice"
            self.host_back.add(s)

    def _set_dev(self, pos: Pos, slot: int) -> None:
        assert pos not in self.model_dev
        self.model_dev[pos] = slot
        self.dev_owner[slot] = pos

    def _drop_dev(self, slot: int) -> Pos:
        pos = self.dev_owner.pop(slot)
        assert self.model_dev.pop(pos) == slot
        return pos

    def _set_host(self, pos: Pos, slot: int) -> None:
        assert pos not in self.model_host, f"{pos} backed up twice"
        self.model_host[pos] = slot
        self.host_owner[slot] = pos

    def _drop_host(self, slot: int) -> Pos:
        pos = self.host_owner.pop(slot)
        assert self.model_host.pop(pos) == slot
        return pos

    def _commit(self, op: int) -> None:
        req, anchor = self.backups.pop(op)
        host = self._host(req.num_tokens)
        ids = self.tree.commit_backup(op, host)
        event(f"commit_backup fragments {len(ids)}")
        assert ids[-1] == req.node_id
        self._check_node(req.node_id, anchor[0], anchor[1])
        for s, h in zip(req.device_slots.tolist(), host.tolist(), strict=True):
            self._set_host(self.dev_owner[int(s)], h)

    def _host_only_pages(self) -> list[Page]:
        pages = {(ns, page) for ns, page, _ in self.model_host} - {
            (ns, page) for ns, page, _ in self.model_dev
        }
        return sorted(pages, key=lambda p: (p[0] or "", p[1]))

    def _draw_key(self, data: st.DataObject) -> tuple[str | None, tuple[int, ...]]:
        """A key: often a cut of an earlier key plus a short random tail (few, cheap draws)."""
        ps = self.ps
        source = data.draw(_SMALL, label="source")
        if self.history and source > 0:
            ns, base = self.history[data.draw(_ANY, label="base") % len(self.history)]
            base = base[: data.draw(_ANY, label="cut") % (len(base) + 1)]
        else:
            ns, base = NAMESPACES[source % 2], ()
        length = data.draw(_LENGTH, label="tail length") % (2 * ps + 2)
        bits = data.draw(_BITS, label="tail bits")
        tail = tuple((bits >> k) & 1 for k in range(length))
        return ns, (base + tail)[: 4 * ps + 1]

    def _device_locked(self) -> set[Pos]:
        anchors = [a for _, a in self.receipts if a is not None]
        anchors += [a for _, a in self.backups.values()]
        anchors += [positions[-1][:2] for _, positions in self.loads.values()]
        out: set[Pos] = set()
        for a in anchors:
            out |= _positions(a, self.ps)
        return out

    def _pin_protected(self) -> set[Pos]:
        """Host-pinned device pages without a host copy (eviction could only delete them)
        that no device lock protects."""
        out: set[Pos] = set()
        for _, a in self.host_receipts:
            if a is not None:
                out |= {p for p in _positions(a, self.ps)
                        if p in self.model_dev and p not in self.model_host}
        return out - self._device_locked()

    def _protected(self) -> set[Pos]:
        return self._device_locked() | self._pin_protected()

    def _host_pinned(self) -> set[Pos]:
        out: set[Pos] = set()
        for _, a in self.host_receipts:
            if a is not None:
                out |= _positions(a, self.ps)
        return out

    def _page_in(self, model: Any, ns: str | None, toks: tuple[int, ...], i: int) -> bool:
        page = toks[: i + self.ps]
        return all((ns, page, o) in model for o in range(self.ps))

    def _expect_match(self, ns: str | None, toks: tuple[int, ...]) -> tuple[list[int], int]:
        """(device slots of the device prefix, host hit length) the model predicts."""
        ps = self.ps
        end = len(toks) - len(toks) % ps
        loading = self._loading()
        dev: list[int] = []
        i = 0
        # Pages still being loaded are host hits until their load commits.
        while (
            i < end
            and self._page_in(self.model_dev, ns, toks, i)
            and (ns, toks[: i + ps], 0) not in loading
        ):
            dev.extend(self.model_dev[(ns, toks[: i + ps], o)] for o in range(ps))
            i += ps
        j = i
        while j < end and self._page_in(self.model_host, ns, toks, j):
            j += ps
        return dev, j - i

    def _loading(self) -> set[Pos]:
        return {p for _, poss in self.loads.values() for p in poss}

    def _check_node(self, node_id: int, ns: str | None, toks: tuple[int, ...]) -> None:
        key = self.tree.node_key(node_id)
        assert tuple(key.tokens) == toks
        if toks:
            assert key.namespace.extra_key == ns

    def _match(self, ns: str | None, toks: tuple[int, ...]) -> Any:
        m = self.tree.match_prefix(RadixKey(list(toks), ns))
        dev, host_len = self._expect_match(ns, toks)
        dpl = len(dev)
        assert m.device_prefix_len == dpl
        assert m.device_indices.tolist() == dev
        assert m.host_hit_length == host_len
        self._check_node(m.last_device_node, ns, toks[:dpl])
        self._check_node(m.best_node, ns, toks[: dpl + host_len])
        matched = {self._pos(ns, toks, i) for i in range(dpl, dpl + host_len)}
        want_loads = {op for op, (_, poss) in self.loads.items() if matched & set(poss)}
        assert set(m.pending_loads) == want_loads
        assert len(m.pending_loads) == len(want_loads)
        if self.events_on and m.best_node != 0:
            assert self.tree.page_hashes(m.best_node) == [
                _digest(self.ps, (ns, toks[:i])).hex()
                for i in range(self.ps, dpl + host_len + 1, self.ps)
            ]
        return m

    # ------------------------------------------------------------ rules
    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        ps = self.ps
        ns, toks = self._draw_key(data)
        n = len(toks)
        end = n - n % ps
        if data.draw(st.booleans(), label="reuse matched slots"):
            m = self._match(ns, toks)
            dpl = m.device_prefix_len
            fresh = self._dev(n - dpl)
            value = np.concatenate([m.device_indices, fresh])
            prev = data.draw(st.integers(0, dpl), label="prev_prefix_len")
        else:
            fresh = value = self._dev(n)
            prev = data.draw(st.integers(0, n), label="prev_prefix_len")
            if prev:
                # The caller claims to own [0, prev): honest only when those are the tree's own
                # slots, so use those; the fresh ones there go back unused.
                m = self._match(ns, toks)
                prev = min(prev, m.device_prefix_len)
                value = np.concatenate([m.device_indices[:prev], fresh[prev:]])
                self._give_back_dev(fresh[:prev].tolist())
        inserted_len = data.draw(st.integers(0, n), label="inserted_len")
        priority = data.draw(st.integers(0, 3), label="priority")
        # Predict the result from the model.
        cached = self.model_dev.keys() | self.model_host.keys()
        loading = self._loading()
        prefix_len = 0
        cached_len = end
        while prefix_len < end and self._page_in(cached, ns, toks, prefix_len):
            if (ns, toks[: prefix_len + ps], 0) in loading:
                cached_len = prefix_len  # the insert stops before a node being loaded
                break
            prefix_len += ps
        dups: list[int] = []
        adopt: list[tuple[Pos, int]] = []
        for i in range(cached_len):
            pos = self._pos(ns, toks, i)
            own = self.model_dev.get(pos)
            if own is None:
                adopt.append((pos, int(value[i])))
            elif i >= prev and int(value[i]) != own:
                dups.append(int(value[i]))
        res = self.tree.insert(
            RadixKey(list(toks), ns), value, prev_prefix_len=prev,
            inserted_len=inserted_len, priority=priority,
        )
        if cached_len < end:
            event("insert stopped before a loading node")
        assert (res.prefix_len, res.cached_len) == (prefix_len, cached_len)
        freed = [int(s) for f in res.device_frees for s in f.tolist()]
        assert freed == dups
        self._give_back_dev(freed)
        for pos, slot in adopt:
            self._set_dev(pos, slot)
        # The unaligned tail (and anything past a loading node) stays the caller's.
        self._give_back_dev(value[cached_len:].tolist())
        self._check_node(res.last_node, ns, toks[:cached_len])
        if not self.HOST or self.WRITE_POLICY == "write_back":
            assert res.backups == []
        for req in res.backups:
            assert req.op_id not in self.backups
            assert not req.write_back
            poss = [self.dev_owner[int(s)] for s in req.device_slots.tolist()]
            assert all(p not in self.model_host for p in poss)
            self.backups[req.op_id] = (req, poss[-1][:2])
        if self.HOST and self.WRITE_POLICY == "write_through":
            backed = set(self.model_host) | {
                self.dev_owner[int(s)]
                for req, _ in self.backups.values()
                for s in req.device_slots.tolist()
            }
            for i in range(min(inserted_len, cached_len), cached_len):
                assert self._pos(ns, toks, i) in backed, "write_through left a hit node un-backed"
        event(f"insert: dups {bool(dups)}, backups {len(res.backups)}")
        if any(p in self.model_host for p, _ in adopt):
            event("insert un-evicted a host-only node")
        if end and (ns, toks) not in self.history_set:
            self.history_set.add((ns, toks))
            self.history.append((ns, toks))
        # Inserted without eviction: it matches in full.
        assert self._match(ns, toks).device_prefix_len == cached_len
        if res.backups and data.draw(st.booleans(), label="ack the copies now"):
            for req in res.backups:
                self._commit(req.op_id)

    @rule(n=st.integers(0, 24), ack=st.booleans())
    def evict(self, n: int, ack: bool) -> None:
        backups = self._evict(n)
        if ack and backups:
            # Write-back: the copies land at once and the next call demotes the victims.
            for req in backups:
                self._commit(req.op_id)
            self._evict(n)

    def _evict(self, n: int) -> list[Any]:
        protected = self._protected()
        res = self.tree.evict(n)
        freed = [int(s) for f in res.device_frees for s in f.tolist()]
        assert res.num_evicted == len(freed)
        self._give_back_dev(freed)
        for s in freed:
            pos = self._drop_dev(s)
            assert pos not in protected, f"evicted protected {pos}"
        hfreed = [int(s) for f in res.host_frees for s in f.tolist()]
        assert res.dropped_host_tokens == len(hfreed)
        self._give_back_host(hfreed)
        for s in hfreed:
            assert self._drop_host(s) not in self.model_dev
        if self.HOST and self.WRITE_POLICY == "write_back":
            # (plus the parents with a host copy above them, demoted after them)
            assert res.pending_tokens >= sum(r.num_tokens for r in res.backups)
            for req in res.backups:
                assert req.write_back
                poss = [self.dev_owner[int(s)] for s in req.device_slots.tolist()]
                assert all(p not in self.model_host for p in poss)
                self.backups[req.op_id] = (req, poss[-1][:2])
        else:
            assert (res.backups, res.pending_tokens) == ([], 0)
        if not self.HOST:
            assert res.host_frees == []
        event(f"evict: freed {bool(freed)}, host freed {bool(hfreed)}, wb {bool(res.backups)}")
        # Short of the target: nothing evictable is left. (Not checked while host locks are
        # held: a host-locked un-backed node is unevictable yet counted as evictable, see
        # test_locks.py::test_evictable_size_is_what_evict_can_free_under_host_lock.)
        if res.num_evicted + res.pending_tokens < n and not self.host_receipts:
            assert self.tree.evictable_size == 0
        return res.backups

    @precondition(lambda self: self.HOST)
    @rule(n=st.integers(0, 20), dups=st.sampled_from([None, True, False]))
    def evict_host(self, n: int, dups: bool | None) -> None:
        res = self.tree.evict_host(n, reclaim_duplicates=dups)
        hfreed = [int(s) for f in res.host_frees for s in f.tolist()]
        assert res.num_evicted == len(hfreed)
        self._give_back_host(hfreed)
        # Duplicates (host copies of device pages) go only under write-back or when asked.
        reclaim = self.WRITE_POLICY == "write_back" if dups is None else dups
        freed: set[Page] = set()
        for s in hfreed:
            pos = self._drop_host(s)
            freed.add(pos[:2])
            if not reclaim:
                assert pos not in self.model_dev
        if self.WRITE_POLICY != "write_back":
            # The host copies stay prefix-closed: no page freed here has a host-copied page
            # below it (a device eviction would delete that page with its parent).
            below = {(ns, toks[:k]) for ns, toks, _ in self.model_host
                     for k in range(self.ps, len(toks), self.ps)}
            assert not freed & below
        event(f"evict_host freed {bool(hfreed)}")
        if res.num_evicted < n and reclaim and not self.host_receipts and not self.loads:
            assert self.tree.host_size == 0

    @precondition(lambda self: self.backups)
    @rule(data=st.data(), commit=st.booleans())
    def finish_backup(self, data: st.DataObject, commit: bool) -> None:
        op = data.draw(st.sampled_from(sorted(self.backups)), label="backup op")
        if commit:
            self._commit(op)
        else:
            self.backups.pop(op)
            self.tree.abort_backup(op)

    @precondition(lambda self: self.backups)
    @rule()
    def commit_all_backups(self) -> None:
        for op in sorted(self.backups):
            self._commit(op)

    @precondition(lambda self: self.HOST)
    @rule(data=st.data())
    def load_back(self, data: st.DataObject) -> None:
        host_only = self._host_only_pages()
        if not host_only:
            return
        ns, toks = host_only[data.draw(_ANY, label="host-only page") % len(host_only)]
        if data.draw(_SMALL, label="extend") == 0:
            toks = toks + tuple(data.draw(_BITS) >> k & 1 for k in range(self.ps))
        m = self._match(ns, toks)
        if not m.host_hit_length or m.pending_loads:
            return  # nothing to load, or wait for the loads in flight first
        dpl, hl = m.device_prefix_len, m.host_hit_length
        chain = self.tree.host_chain(m.best_node)
        ntok = {nd.id: nd.ntok for nd in self.tree.iter_nodes()}
        assert chain[-1] == m.best_node
        assert sum(ntok[c] for c in chain) == hl
        device = self._dev(hl)
        poss = [self._pos(ns, toks, i) for i in range(dpl, dpl + hl)]
        want_host = [self.model_host[p] for p in poss]
        event(f"load-back of {len(chain)} nodes")
        ticket = self.tree.start_load_back(m.best_node, device)
        assert ticket.host_slots.tolist() == want_host
        assert ticket.device_slots.tolist() == device.tolist()
        assert list(ticket.node_ids) == chain
        for p, s in zip(poss, device.tolist(), strict=True):
            self._set_dev(p, s)
        self.loads[ticket.op_id] = (ticket, poss)
        outcome = data.draw(_SMALL, label="copy outcome")
        if outcome:  # 1, 2, 3: it lands or fails at once; 0: it stays in flight
            self._finish_load(ticket.op_id, commit=outcome != 3)

    @precondition(lambda self: self.loads)
    @rule(data=st.data(), commit=st.booleans())
    def finish_load(self, data: st.DataObject, commit: bool) -> None:
        op = data.draw(st.sampled_from(sorted(self.loads)), label="load op")
        self._finish_load(op, commit)

    def _finish_load(self, op: int, commit: bool) -> None:
        ticket, _ = self.loads.pop(op)
        if commit:
            self.tree.commit_load_back(op)
            return
        frees = [int(s) for f in self.tree.abort_load_back(op) for s in f.tolist()]
        event(f"abort load freed {len(frees)} of {ticket.num_tokens}")
        # Nothing can build on or pin a loading node: every slot of the load comes back.
        assert sorted(frees) == ticket.device_slots.tolist()
        self._give_back_dev(frees)
        for s in frees:
            self._drop_dev(s)

    @rule(data=st.data())
    def lock(self, data: st.DataObject) -> None:
        ns, toks = self._draw_key(data)
        m = self._match(ns, toks)
        before = self.tree.protected_size
        r = self.tree.lock(m.last_device_node)
        assert r.delta == self.tree.protected_size - before
        dpl = m.device_prefix_len
        self.receipts.append((r, (ns, toks[:dpl]) if dpl else None))
        assert r.delta == len(self._protected()) - before

    @precondition(lambda self: self.receipts)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.receipts) - 1), label="receipt")
        r, _ = self.receipts.pop(i)
        before = self.tree.protected_size
        assert self.tree.unlock(r) == before - self.tree.protected_size
        try:
            self.tree.unlock(r)
        except LockError:
            pass
        else:
            raise AssertionError("a receipt was accepted twice")

    @precondition(lambda self: self.HOST)
    @rule(data=st.data())
    def lock_host(self, data: st.DataObject) -> None:
        ns, toks = self._draw_key(data)
        m = self._match(ns, toks)
        before = len(self._host_pinned())
        r = self.tree.lock_host(m.best_node)
        depth = m.device_prefix_len + m.host_hit_length
        self.host_receipts.append((r, (ns, toks[:depth]) if depth else None))
        assert r.delta == len(self._host_pinned()) - before

    @precondition(lambda self: self.host_receipts)
    @rule(data=st.data())
    def unlock_host(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.host_receipts) - 1), label="host receipt")
        before = len(self._host_pinned())
        r, _ = self.host_receipts.pop(i)
        assert self.tree.unlock_host(r) == before - len(self._host_pinned())

    @precondition(lambda self: self.steps_since_reset >= 25)
    @rule()
    def reset(self) -> None:
        self.steps_since_reset = 0
        if self.backups or self.loads:
            try:
                self.tree.reset()
            except InvalidInputError:
                return
            raise AssertionError("reset accepted with copies in flight")
        device, host = self.tree.reset()
        dev = sorted(int(s) for f in device for s in f.tolist())
        hst = sorted(int(s) for f in host for s in f.tolist())
        assert dev == sorted(self.model_dev.values())
        assert hst == sorted(self.model_host.values())
        self._give_back_dev(dev)
        self._give_back_host(hst)
        self.model_dev.clear()
        self.model_host.clear()
        self.dev_owner.clear()
        self.host_owner.clear()
        if self.receipts:
            self.stale_receipt = self.receipts[0][0]
        self.receipts.clear()
        self.host_receipts.clear()

    @precondition(lambda self: self.stale_receipt is not None)
    @rule()
    def unlock_stale_receipt(self) -> None:
        try:
            self.tree.unlock(self.stale_receipt)
        except LockError:
            self.stale_receipt = None
        else:
            raise AssertionError("a receipt from before reset() was accepted")

    # ------------------------------------------------------------ invariants
    @invariant()
    def tree_is_sane(self) -> None:
        self.steps_since_reset += 1
        self.tree.sanity_check()

    @invariant()
    def tree_matches_model(self) -> None:
        tree_dev: dict[Pos, int] = {}
        tree_host: dict[Pos, int] = {}
        for node in self.tree.iter_nodes():
            key = self.tree.node_key(node.id)
            toks = tuple(key.tokens)
            ns = key.namespace.extra_key
            start = len(toks) - node.ntok
            for k in range(node.ntok):
                pos = self._pos(ns, toks, start + k)
                if node.value is not None:
                    tree_dev[pos] = int(node.value[k])
                if node.host_value is not None:
                    tree_host[pos] = int(node.host_value[k])
        assert tree_dev == self.model_dev
        assert tree_host == self.model_host
        # Prefix-closed, and nothing on device below a host-only page.
        ps = self.ps
        for ns, page, _ in [*self.model_dev, *self.model_host]:
            if len(page) > ps:
                parent = (ns, page[:-ps], 0)
                assert parent in self.model_dev or parent in self.model_host
        for ns, page, _ in self.model_dev:
            if len(page) > ps:
                assert (ns, page[:-ps], 0) in self.model_dev

    @invariant()
    def sizes_match_model(self) -> None:
        t = self.tree
        assert t.device_size == t.evictable_size + t.protected_size == len(self.model_dev)
        assert t.protected_size == len(self._protected())
        assert t.host_pinned_size == len(self._pin_protected())
        assert t.host_size == len(self.model_host)
        assert t.held_locks == len(self.receipts) + len(self.host_receipts)
        assert t.pending_ops == len(self.backups) + len(self.loads)

    @invariant()
    def slots_balance(self) -> None:
        dev = self.tree.device_slots().tolist()
        assert len(dev) == len(set(dev)), "a device slot is held twice"
        assert set(dev).isdisjoint(self.dev_back), "a device slot is both held and given back"
        assert set(dev) | self.dev_back == self.dev_given, "a device slot leaked"
        host = self.tree.host_slots().tolist()
        assert len(host) == len(set(host)), "a host slot is held twice"
        assert set(host).isdisjoint(self.host_back), "a host slot is both held and given back"
        assert set(host) | self.host_back == self.host_given, "a host slot leaked"

    @invariant()
    def events_match_model(self) -> None:
        if not self.events_on:
            assert self.tree.take_events() == []
            return
        ps = self.ps
        for ns, page, _ in [*self.model_dev, *self.model_host]:
            self.hash_page.setdefault(_event_hash(ps, (ns, page)), (ns, page))
        for ev in self.tree.take_events():
            if isinstance(ev, AllBlocksCleared):
                for live in self.router.values():
                    live.clear()
                continue
            live = self.router[ev.medium]
            if isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    assert h in live, f"removed {h} that was not stored on {ev.medium}"
                    live.remove(h)
                continue
            assert isinstance(ev, BlockStored)
            assert ev.block_size == ps
            pages = [self.hash_page[h] for h in ev.block_hashes]
            first_ns, first = pages[0]
            if len(first) == ps:
                assert ev.parent_block_hash is None
            else:
                assert ev.parent_block_hash == _event_hash(ps, (first_ns, first[:-ps]))
            for a, b in itertools.pairwise(pages):
                assert b[0] == a[0] and b[1][:-ps] == a[1]
            assert ev.token_ids == list(pages[-1][1][len(first) - ps :])
            assert ev.lora_name == first_ns
            for h in ev.block_hashes:
                assert h not in live, f"stored {h} twice on {ev.medium}"
                live.add(h)
        loading = self._loading()
        want_gpu = {
            _event_hash(ps, (ns, page))
            for (ns, page, _) in self.model_dev
            if (ns, page, 0) not in loading
        }
        want_cpu = {_event_hash(ps, (ns, page)) for (ns, page, _) in self.model_host}
        assert self.router[Medium.GPU] == want_gpu
        assert self.router[Medium.CPU_PINNED] == want_cpu


SETTINGS = stateful_settings(200)


def _machine(host: bool, write_policy: str) -> Any:
    return machine_case(TreeMachine, f"TreeMachine_{'host' if host else 'device'}_{write_policy}",
                        SETTINGS, HOST=host, WRITE_POLICY=write_policy)


TestDeviceOnly = _machine(False, "write_through_selective")
TestHostWriteThrough = _machine(True, "write_through")
TestHostWriteThroughSelective = _machine(True, "write_through_selective")
TestHostWriteBack = _machine(True, "write_back")
