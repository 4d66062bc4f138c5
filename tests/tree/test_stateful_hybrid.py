"""Hypothesis stateful test of hybrid trees (FULL, FULL+SWA, FULL+Mamba, FULL+SWA+Mamba).

The model knows, per cached token position, the FULL slot and whether its SWA side is live
(absent: an SWA tombstone; the tree names SWA data by FULL slots), and per page boundary the
Mamba state slot the tree must hold. Every match and insert result is predicted exactly from it
(the window validator, Mamba checkpoints, branching seqlens, duplicates, the SWA floor, the FULL
slots whose SWA side the tree gives up, tombstone recovery and the SWA sides it adopts);
eviction results are checked against the locks and applied to the model. The model also keeps
the cache's full->SWA pairing (as ``transfers.hybrid_pools.SWASlotMap`` does: every FULL slot
handed out comes with an SWA slot of its own, and tree results are applied in
``apply_tree_frees``' order). After every step ``sanity_check()`` runs, the tree's content
equals the model, per-component sizes match, exactly the SWA-live FULL slots are paired, and
every slot of every pool the test handed out is held exactly once or was given back exactly once.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from asynccache.errors import LockError
from asynccache.tree import POLICIES, RadixKey, RadixTree
from tests.tree.stateful_cases import machine_case, stateful_settings

NAMESPACES = (None, "lora")
Pos = tuple[str | None, tuple[int, ...], int]  # (namespace, tokens to the end of the page, offset)
Page = tuple[str | None, tuple[int, ...]]  # a page boundary: (namespace, tokens up to it)
_SMALL = st.integers(0, 3)
_ANY = st.integers(0, 2**16)
_BITS = st.integers(0, 2**10 - 1)
POOLS = ("full", "swa", "mamba")
STARTS = {"full": 0, "swa": 500_000, "mamba": 900_000}


class HybridMachine(RuleBasedStateMachine):
    SWA = False
    MAMBA = False

    @initialize(ps=st.sampled_from([1, 2, 4]), window=st.integers(1, 6),
                grid=st.integers(1, 2), policy=st.sampled_from(sorted(POLICIES)))
    def setup(self, ps: int, window: int, grid: int, policy: str) -> None:
        self.ps = ps
        self.window = window if self.SWA else 0
        self.grid = grid * ps
        self.tree = RadixTree(page_size=ps, eviction_policy=policy,
                              sliding_window=self.window, mamba=self.MAMBA,
                              mamba_track_interval=self.grid,
                              device_tokens=16 * ps)  # (the arc policy's capacity)
        self.next = dict(STARTS)
        self.given: dict[str, set[int]] = {p: set() for p in POOLS}
        self.back: dict[str, set[int]] = {p: set() for p in POOLS}
        self.full: dict[Pos, int] = {}
        self.swa: set[Pos] = set()  # the SWA-live positions
        self.pair: dict[int, int] = {}  # the cache's full->SWA map: FULL slot -> its SWA slot
        self.state: dict[Page, int] = {}
        # receipt -> [anchor page or None, swa span, mamba locked, swa released]
        self.receipts: list[tuple[Any, list[Any]]] = []
        self.history: list[Page] = []
        self.steps = 0

    # ------------------------------------------------------------ helpers
    def _take(self, pool: str, n: int) -> np.ndarray:
        out = np.arange(self.next[pool], self.next[pool] + n, dtype=np.int64)
        self.next[pool] += n
        self.given[pool].update(out.tolist())
        return out

    def _give_back(self, pool: str, slots: list[int]) -> None:
        for s in slots:
            assert s in self.given[pool], f"{pool} slot {s} was never given to the tree"
            assert s not in self.back[pool], f"{pool} slot {s} given back twice"
            self.back[pool].add(s)

    def _alloc(self, n: int) -> np.ndarray:
        """``n`` fresh FULL slots, each paired with a fresh SWA slot in SWA trees."""
        out = self._take("full", n)
        if self.SWA:
            self.pair.update(zip(out.tolist(), self._take("swa", n).tolist(), strict=True))
        return out

    def _free_full(self, slots: list[int]) -> None:
        """``SWASlotMap.free_full``: FULL slots with whatever SWA side they still have."""
        self._give_back("full", slots)
        self._give_back("swa", [self.pair.pop(s) for s in slots if s in self.pair])

    def _free_swa(self, slots: list[int]) -> None:
        """``SWASlotMap.free_swa(translate(slots))``: the SWA sides of FULL slots."""
        for s in slots:
            assert s in self.pair, f"FULL slot {s} has no SWA side to give up"
            self._give_back("swa", [self.pair.pop(s)])

    def _pos(self, ns: str | None, toks: tuple[int, ...], i: int) -> Pos:
        return (ns, toks[: (i // self.ps + 1) * self.ps], i % self.ps)

    def _draw_key(self, data: st.DataObject) -> Page:
        ps = self.ps
        source = data.draw(_SMALL, label="source")
        if self.history and source > 0:
            ns, base = self.history[data.draw(_ANY, label="base") % len(self.history)]
            base = base[: data.draw(_ANY, label="cut") % (len(base) + 1)]
        else:
            ns, base = NAMESPACES[source % 2], ()
        length = data.draw(st.integers(0, 3 * ps + 2), label="tail length")
        bits = data.draw(_BITS, label="tail bits")
        tail = tuple((bits >> k) & 1 for k in range(length))
        return ns, (base + tail)[: 6 * ps + 1]

    def _cached_len(self, ns: str | None, toks: tuple[int, ...]) -> int:
        end = len(toks) - len(toks) % self.ps
        i = 0
        while i < end and (ns, toks[: i + self.ps], 0) in self.full:
            i += self.ps
        return i

    def _swa_valid(self, ns: str | None, toks: tuple[int, ...], c: int) -> bool:
        if not self.SWA or c == 0:
            return True
        live = [self._pos(ns, toks, i) in self.swa for i in range(c)]
        return all(live) or (c >= self.window and all(live[c - self.window :]))

    def _expect_match(self, ns: str | None, toks: tuple[int, ...]) -> dict[str, Any]:
        ps = self.ps
        L = self._cached_len(ns, toks)
        tomb_starts = [
            i for i in range(0, L, ps)
            if self._pos(ns, toks, i) not in self.swa
            and (i == 0 or self._pos(ns, toks, i - 1) in self.swa)
        ] if self.SWA else []
        swa_bound = max(c for c in {0, L, *tomb_starts} if self._swa_valid(ns, toks, c))
        if self.MAMBA:
            states = [c for c in range(ps, L + 1, ps) if (ns, toks[:c]) in self.state]
            mamba_bound = max([0, *states])
            best = max([0, *(c for c in states if self._swa_valid(ns, toks, c))])
        else:
            mamba_bound = L
            best = swa_bound
        grid_hit = L // self.grid * self.grid
        return {
            "best": best,
            "full_hit": L,
            "swa_branch": L if self.SWA and swa_bound < L else None,
            "mamba_branch": grid_hit if self.MAMBA and grid_hit > mamba_bound else None,
        }

    def _match(self, ns: str | None, toks: tuple[int, ...]) -> Any:
        want = self._expect_match(ns, toks)
        m = self.tree.match_prefix(RadixKey(list(toks), ns), cow_mamba=self.MAMBA)
        best = want["best"]
        assert m.device_prefix_len == best
        assert m.device_indices.tolist() == [self.full[self._pos(ns, toks, i)] for i in range(best)]
        assert m.full_kv_hit_length == want["full_hit"]
        assert m.swa_branching_seqlen == want["swa_branch"]
        assert m.mamba_branching_seqlen == want["mamba_branch"]
        assert m.host_hit_length == 0
        assert tuple(self.tree.node_key(m.last_device_node).tokens) == toks[:best]
        if self.MAMBA:
            assert m.mamba_cow_slot == (self.state[(ns, toks[:best])] if best else None)
        event(f"match: usable {best == want['full_hit']}")
        return m

    def _protected(self) -> tuple[set[Pos], set[Pos], set[Page]]:
        full: set[Pos] = set()
        swa: set[Pos] = set()
        mamba: set[Page] = set()
        for _, (anchor, span, locked, released) in self.receipts:
            if anchor is None:
                continue
            ns, toks = anchor
            full |= {self._pos(ns, toks, i) for i in range(len(toks))}
            if not released:
                swa |= {self._pos(ns, toks, i) for i in range(len(toks) - span, len(toks))}
                if locked:
                    mamba.add(anchor)
        return full, swa & self.swa, mamba

    # ------------------------------------------------------------ rules
    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        ps = self.ps
        ns, toks = self._draw_key(data)
        n = len(toks)
        end = n - n % ps
        reuse = data.draw(st.booleans(), label="reuse matched slots")
        if reuse:
            m = self._match(ns, toks)
            dpl = m.device_prefix_len
            value = np.concatenate([m.device_indices, self._alloc(n - dpl)])
            prev = data.draw(st.integers(0, dpl), label="prev_prefix_len")
        else:
            dpl = 0
            value = self._alloc(n)
            prev = 0
        floor = data.draw(st.integers(0, n), label="swa floor") if self.SWA else 0
        if data.draw(_SMALL, label="floor kind") < 2:
            floor = 0
        if self.SWA:
            # The SWA KV of token i is the pair of value[i], and the cache requires one from
            # max(floor, prev) on. The matched prefix's SWA tombstones (all below its last
            # window) never had one for this request: its floor covers them.
            for i in range(prev, dpl):
                if self._pos(ns, toks, i) not in self.swa:
                    floor = max(floor, i + 1)
            # The request already freed the SWA side of its own slots below its floor.
            self._free_swa([int(v) for v in value[dpl:floor]])
        state = None
        if self.MAMBA and data.draw(_SMALL, label="state") > 0:
            state = int(self._take("mamba", 1)[0])
        # ---- predict
        L0 = self._cached_len(ns, toks)
        floor_a = -(-floor // ps) * ps
        span = -(-self.window // ps) * ps
        recover = -(-max(prev, floor_a, end - span) // ps) * ps
        full_frees: list[int] = []  # duplicates (with their SWA side, if still paired)
        swa_frees: list[int] = []  # FULL slots whose SWA side the tree gives up
        adopted: list[tuple[int, int]] = []  # (node FULL slot, caller FULL slot)
        new_full: list[tuple[Pos, int]] = []
        new_swa: list[Pos] = []
        for i in range(end):
            pos = self._pos(ns, toks, i)
            v = int(value[i])
            if i < L0:
                if i >= prev and v != self.full[pos]:
                    full_frees.append(v)
            else:
                new_full.append((pos, v))
            if not self.SWA or i < floor:  # below the floor the caller has no SWA side
                continue
            if i < L0:
                if i < prev or pos in self.swa:
                    continue  # no SWA duplicates: a duplicate FULL slot takes its SWA along
                if i >= recover:  # an in-window SWA tombstone: recovered from the caller
                    new_swa.append(pos)
                    assert v != self.full[pos], "the caller's slot is a tree tombstone's own"
                    adopted.append((self.full[pos], v))
                else:
                    swa_frees.append(v)
            elif i < floor_a:
                swa_frees.append(v)  # a partly freed page is not kept
            else:
                new_swa.append(pos)
        mamba_frees: list[int] = []
        exist = end > 0 and (ns, toks[:end]) in self.state
        if state is not None:
            if end == 0:
                self._give_back("mamba", [state])  # nothing cached: the caller keeps it
            elif exist and self.state[(ns, toks[:end])] != state:
                mamba_frees.append(state)
        # ---- run
        kwargs: dict[str, Any] = {}
        if self.SWA:
            kwargs = {"component_evicted_seqlens": {"swa": floor}}
        res = self.tree.insert(RadixKey(list(toks), ns), value, prev_prefix_len=prev,
                               mamba_value=state, **kwargs)
        assert (res.prefix_len, res.cached_len) == (L0, end)
        assert [int(s) for f in res.device_frees for s in f.tolist()] == full_frees
        got_swa = [int(s) for f in res.component_frees.get("swa", []) for s in f.tolist()]
        assert got_swa == swa_frees
        values = {id(node.value) for node in self.tree.iter_nodes()} if res.swa_adopted else set()
        for node_full, caller_full in res.swa_adopted:
            assert id(node_full) in values, "an adopted pair's first part is not a node's FULL"
            assert len(node_full) == len(caller_full) > 0
            assert not np.array_equal(node_full, caller_full)
        got_adopted = [(int(a), int(b)) for node_full, caller_full in res.swa_adopted
                       for a, b in zip(node_full.tolist(), caller_full.tolist(), strict=True)]
        assert got_adopted == adopted
        got_mamba = [int(s) for f in res.component_frees.get("mamba", []) for s in f.tolist()]
        assert got_mamba == mamba_frees
        assert res.mamba_exist == (self.MAMBA and exist)
        assert tuple(self.tree.node_key(res.last_node).tokens) == toks[:end]
        # ---- apply (in SWASlotMap.apply_tree_frees' order: adopt, SWA frees, FULL frees)
        for node_slot, caller_slot in adopted:
            assert node_slot not in self.pair, f"tombstone FULL slot {node_slot} is paired"
            self.pair[node_slot] = self.pair.pop(caller_slot)
        self._free_swa(swa_frees)
        self._free_full(full_frees + [int(s) for s in value[end:]])  # the tail: the caller's
        for pos, v in new_full:
            self.full[pos] = v
        self.swa.update(new_swa)
        self._give_back("mamba", mamba_frees)
        if state is not None and end and not exist:
            self.state[(ns, toks[:end])] = state
        event(f"insert: swa tombstone recovered {bool(adopted)}")
        if end and (ns, toks) not in self.history:
            self.history.append((ns, toks))

    @rule(data=st.data(), skip_mamba=st.booleans())
    def lock(self, data: st.DataObject, skip_mamba: bool) -> None:
        ns, toks = self._draw_key(data)
        m = self._match(ns, toks)
        dpl = m.device_prefix_len
        skip = ("mamba",) if skip_mamba and self.MAMBA else ()
        before = self.tree.protected_size
        r = self.tree.lock(m.last_device_node, skip=skip)
        assert r.delta == self.tree.protected_size - before
        anchor = (ns, toks[:dpl]) if dpl else None
        if self.SWA:
            assert min(self.window, dpl) <= r.swa_span <= dpl
            assert r.swa_span == dpl or r.swa_span >= self.window
        else:
            assert r.swa_span == 0
        assert r.mamba_locked == (self.MAMBA and not skip and anchor in self.state)
        self.receipts.append((r, [anchor, r.swa_span, r.mamba_locked, False]))

    @precondition(lambda self: self.receipts)
    @rule(data=st.data())
    def release_swa(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.receipts) - 1), label="receipt")
        r, info = self.receipts[i]
        if not self.SWA or info[3]:
            try:
                self.tree.release_swa(r)
            except LockError:
                return
            raise AssertionError("release_swa accepted twice or without an SWA component")
        self.tree.release_swa(r)
        info[3] = True

    @precondition(lambda self: self.receipts)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.receipts) - 1), label="receipt")
        r, _ = self.receipts.pop(i)
        before = self.tree.protected_size
        assert self.tree.unlock(r) == before - self.tree.protected_size

    @rule(n=st.integers(0, 12), n_swa=st.integers(0, 12), n_mamba=st.integers(0, 3))
    def evict(self, n: int, n_swa: int, n_mamba: int) -> None:
        n_swa = n_swa if self.SWA else 0
        n_mamba = n_mamba if self.MAMBA else 0
        p_full, p_swa, p_mamba = self._protected()
        res = self.tree.evict(n, swa_num_tokens=n_swa, mamba_num=n_mamba)
        freed = [int(s) for f in res.device_frees for s in f.tolist()]
        fswa = [int(s) for f in res.component_frees.get("swa", []) for s in f.tolist()]
        fmamba = [int(s) for f in res.component_frees.get("mamba", []) for s in f.tolist()]
        assert (res.num_evicted, res.swa_num_evicted, res.mamba_num_evicted) == (
            len(freed), len(fswa), len(fmamba))
        owner = {v: p for p, v in self.full.items()}
        state_owner = {v: p for p, v in self.state.items()}
        for s in fswa:  # FULL slots whose SWA side goes (a tombstoned or a deleted node's)
            pos = owner[s]
            assert pos in self.swa, f"SWA given up twice or at a tombstone: {pos}"
            assert pos not in p_swa, f"evicted SWA-protected {pos}"
            self.swa.remove(pos)
        for s in freed:
            pos = owner[s]
            assert pos not in p_full, f"evicted FULL-protected {pos}"
            assert pos not in self.swa, f"deleted {pos} without giving up its SWA side"
            del self.full[pos]
        for s in fmamba:
            page = state_owner[s]
            assert page not in p_mamba, f"evicted a pinned state at {page}"
            del self.state[page]
        for pos in self.swa:
            assert pos in self.full, f"SWA kept at {pos} whose FULL KV was evicted"
        for ns, toks in self.state:
            assert (ns, toks, self.ps - 1) in self.full
        self._free_swa(fswa)
        self._free_full(freed)
        self._give_back("mamba", fmamba)
        if res.num_evicted < n:
            assert self.tree.evictable_size == 0
        if self.SWA and res.swa_num_evicted < n_swa:
            assert self.tree.component_sizes("swa")[0] == 0
        if self.MAMBA and res.mamba_num_evicted < n_mamba:
            assert self.tree.component_sizes("mamba")[0] == 0
        event(f"evict: full {bool(freed)} swa {bool(fswa)} mamba {bool(fmamba)}")

    @precondition(lambda self: self.steps >= 20)
    @rule()
    def reset(self) -> None:
        self.steps = 0
        comp = {c: sorted(self.tree.component_slots(c).tolist()) for c in self.tree.components[1:]}
        device, host = self.tree.reset()
        assert host == []
        dev = sorted(int(s) for f in device for s in f.tolist())
        assert dev == sorted(self.full.values())
        assert comp.get("swa", []) == sorted(self.full[pos] for pos in self.swa)
        assert comp.get("mamba", []) == sorted(self.state.values())
        self._free_full(dev)  # the SWA-live slots take their SWA side along
        assert not self.pair
        self._give_back("mamba", comp.get("mamba", []))
        self.full.clear()
        self.swa.clear()
        self.state.clear()
        self.receipts.clear()

    # ------------------------------------------------------------ invariants
    @invariant()
    def tree_is_sane(self) -> None:
        self.steps += 1
        self.tree.sanity_check()

    @invariant()
    def tree_matches_model(self) -> None:
        full: dict[Pos, int] = {}
        swa: set[Pos] = set()
        state: dict[Page, int] = {}
        names = self.tree.components[1:]
        for node in self.tree.iter_nodes():
            key = self.tree.node_key(node.id)
            toks = tuple(key.tokens)
            ns = key.namespace.extra_key
            aux = {name: self.tree.component_slots_of(node.id, name) for name in names}
            value = node.value
            assert value is not None
            if aux.get("swa") is not None:
                assert aux["swa"] is value, "an SWA entry is not the node's FULL array"
            start = len(toks) - node.ntok
            for k in range(node.ntok):
                pos = self._pos(ns, toks, start + k)
                full[pos] = int(value[k])
                if aux.get("swa") is not None:
                    swa.add(pos)
            mamba = aux.get("mamba")
            if mamba is not None:
                state[(ns, toks)] = int(mamba[0])
        assert full == self.full
        assert swa == self.swa
        assert state == self.state

    @invariant()
    def sizes_match_model(self) -> None:
        t = self.tree
        p_full, p_swa, p_mamba = self._protected()
        assert (t.evictable_size, t.protected_size) == (len(self.full) - len(p_full), len(p_full))
        if self.SWA:
            assert t.component_sizes("swa") == (len(self.swa) - len(p_swa), len(p_swa))
        if self.MAMBA:
            assert t.component_sizes("mamba") == (len(self.state) - len(p_mamba), len(p_mamba))
        assert t.held_locks == len(self.receipts)

    @invariant()
    def slots_balance(self) -> None:
        live = self.tree.component_slots("swa").tolist() if self.SWA else []
        assert len(live) == len(set(live)), "an SWA-live FULL slot is held twice"
        # Exactly the SWA-live FULL slots have an SWA side: the tree gave up every other one.
        assert set(live) == self.pair.keys(), "the SWA-live FULL slots are not the paired ones"
        held = {
            "full": self.tree.device_slots().tolist(),
            "swa": [self.pair[s] for s in live],
            "mamba": self.tree.component_slots("mamba").tolist() if self.MAMBA else [],
        }
        for pool in POOLS:
            h = held[pool]
            assert len(h) == len(set(h)), f"a {pool} slot is held twice"
            assert set(h).isdisjoint(self.back[pool]), f"a {pool} slot is held and given back"
            assert set(h) | self.back[pool] == self.given[pool], f"a {pool} slot leaked"


SETTINGS = stateful_settings(60)


def _machine(swa: bool, mamba: bool) -> Any:
    return machine_case(HybridMachine, f"HybridMachine_swa{int(swa)}_mamba{int(mamba)}",
                        SETTINGS, SWA=swa, MAMBA=mamba)


TestFull = _machine(False, False)
TestFullSWA = _machine(True, False)
TestFullMamba = _machine(False, True)
TestFullSWAMamba = _machine(True, True)
