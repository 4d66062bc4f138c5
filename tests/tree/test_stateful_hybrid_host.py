"""Hypothesis stateful test of hybrid trees with a host tier (FULL+SWA, FULL+Mamba,
FULL+SWA+Mamba under every write policy).

Every slot of the pools (device and host: FULL, SWA, Mamba) carries what it holds: the prefix
whose last token's KV it stores (FULL, SWA) or the prefix a state describes (Mamba). The tree
names SWA data by FULL slots: the device FULL and SWA pools are a real ``SWASlotMap`` (page
allocators of one-slot pages), which pairs each FULL slot with its SWA slot and applies the
tree's results (``device_frees``, the SWA frees and ``swa_adopted``, all FULL slots) the way the
cache does. Backups and load-backs copy contents from the slots named in the requests and
tickets (an SWA backup part through the map's translation).

Each insert's result is predicted exactly from the tree before it: the insert stops before a
node still loading, host-only nodes take the caller's FULL slots, duplicates come back in
``device_frees``; the SWA frees (a partly freed page above the SWA floor, the out-of-window part
of a cached SWA tombstone) and the adoptions (an in-window tombstone recovered from the caller's
slots; a host-only node the insert un-evicts is SWA-live again above the floor's page) are exact
FULL slot lists; the caller's state is taken or given back. An eviction frees
exactly what the tree stopped holding; a load-back pairs exactly the FULL slots of the nodes
whose SWA it loads.

After every step: ``sanity_check()``; every node's device and host slots of every component
hold exactly its own prefix (copies are bit-exact and go to the right nodes across splits,
demotion, eviction and load-back); the device pools hold exactly what the tree holds: the FULL
slots of its nodes, an SWA side for exactly the FULL slots of its SWA-live nodes and no other
SWA slot; every host and Mamba slot the test handed out is held by the tree or was given back
exactly once. A load-back committed at once turns the host hit into a device hit.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from asynccache.errors import InvalidInputError
from asynccache.transfers.allocator import PageAllocator
from asynccache.transfers.hybrid_pools import SWASlotMap
from asynccache.tree import RadixTree
from tests.tree.stateful_cases import machine_case, stateful_settings

POOLS = ("mamba", "hfull", "hswa", "hmamba")  # counted by hand; device FULL/SWA: allocators
HOST = {"full": "hfull", "swa": "hswa", "mamba": "hmamba"}
DEVICE_SLOTS = 1 << 14
Pos = tuple[tuple[int, ...], int]  # (tokens to the end of the page, offset in the page)


def flat(arrays: Any) -> list[int]:
    return [int(s) for a in arrays for s in np.asarray(a).tolist()]


class HostHybridMachine(RuleBasedStateMachine):
    SWA = False
    MAMBA = False

    @initialize(ps=st.sampled_from([1, 2]), window=st.integers(1, 5),
                policy=st.sampled_from(["write_through", "write_through_selective",
                                        "write_back"]),
                eviction=st.sampled_from(["lru", "arc"]))
    def setup(self, ps: int, window: int, policy: str, eviction: str) -> None:
        self.ps = ps
        self.window = window if self.SWA else 0
        self.tree = RadixTree(page_size=ps, sliding_window=self.window,
                              mamba=self.MAMBA, host_enabled=True, write_policy=policy,
                              eviction_policy=eviction, device_tokens=16 * ps)
        self.full = PageAllocator(DEVICE_SLOTS, 1)
        self.smap = SWASlotMap(self.full, PageAllocator(DEVICE_SLOTS, 1)) if self.SWA else None
        # Never handed to the tree: FULL slots are numbered apart from SWA slots, so a slip
        # between the two shows.
        self.full.alloc(DEVICE_SLOTS // 2)
        self.next = {p: 1000 * (i + 1) for i, p in enumerate(POOLS)}
        self.given: dict[str, set[int]] = {p: set() for p in POOLS}
        self.back: dict[str, set[int]] = {p: set() for p in POOLS}
        self.content: dict[str, dict[int, tuple[int, ...]]] = {
            p: {} for p in ("full", "swa", *POOLS)}
        self.backups: list[Any] = []
        self.tickets: list[Any] = []
        self.receipts: list[Any] = []
        self.history: list[tuple[int, ...]] = []

    # ------------------------------------------------------------ helpers
    def _take(self, pool: str, n: int) -> np.ndarray:
        out = np.arange(self.next[pool], self.next[pool] + n, dtype=np.int64)
        self.next[pool] += n
        self.given[pool].update(out.tolist())
        return out

    def _give_back(self, pool: str, arrays: Any) -> None:
        for a in arrays:
            for s in np.asarray(a).tolist():
                assert s in self.given[pool], f"{pool} slot {s} was never handed out"
                assert s not in self.back[pool], f"{pool} slot {s} given back twice"
                self.back[pool].add(s)
                self.content[pool].pop(s, None)

    def _alloc_full(self, n: int, paired: bool) -> np.ndarray:
        """``n`` FULL device slots; ``paired``: each with a fresh SWA side (a request's slots),
        else none (a load-back's, paired by its ticket)."""
        got = self.smap.alloc(n) if paired and self.smap is not None else self.full.alloc(n)
        assert got is not None
        return got

    def _free_full(self, arrays: Any) -> None:
        for a in arrays:
            if self.smap is not None:
                self.smap.free_full(a)
            else:
                self.full.free(a)

    def _swa_of(self, full: Any) -> list[int]:
        assert self.smap is not None
        return [int(s) for s in self.smap.translate(full).tolist()]

    def _pos(self, toks: tuple[int, ...], i: int) -> Pos:
        return (toks[: (i // self.ps + 1) * self.ps], i % self.ps)

    def _device(self) -> tuple[list[int], list[int], list[int]]:
        """The tree's device FULL slots, the FULL slots of its SWA-live nodes, its states."""
        t = self.tree
        live = t.component_slots("swa").tolist() if self.SWA else []
        states = t.component_slots("mamba").tolist() if self.MAMBA else []
        return t.device_slots().tolist(), live, states

    def _snapshot(self) -> tuple[dict[Pos, tuple[int | None, bool, bool]],
                                 dict[tuple[int, ...], int]]:
        """Per cached position: (device FULL slot or None, SWA-live, loading); per node end:
        its device Mamba state."""
        t = self.tree
        loads = {tk.op_id for tk in self.tickets}
        out: dict[Pos, tuple[int | None, bool, bool]] = {}
        states: dict[tuple[int, ...], int] = {}
        for n in t.iter_nodes():
            key = tuple(t.node_key(n.id).tokens)
            start = len(key) - n.ntok
            live = self.SWA and t.component_slots_of(n.id, "swa") is not None
            loading = bool(n.pending) and n.pending in loads
            for k in range(n.ntok):
                own = None if n.value is None else int(n.value[k])
                out[self._pos(key, start + k)] = (own, live, loading)
            if self.MAMBA:
                state = t.component_slots_of(n.id, "mamba")
                if state is not None:
                    states[key] = int(state[0])
        return out, states

    def _apply_evict(self, e: Any) -> None:
        self._give_back("hfull", e.host_frees)
        for name, arrays in e.component_host_frees.items():
            self._give_back(HOST[name], arrays)
        self._give_back("mamba", e.component_frees.get("mamba", []))
        if self.smap is not None:
            self.smap.apply_tree_frees(e.device_frees, e.component_frees.get("swa", []))
        else:
            assert "swa" not in e.component_frees
            self._free_full(e.device_frees)
        self.backups.extend(e.backups)

    def _key(self, data: st.DataObject) -> tuple[int, ...]:
        if self.history and data.draw(st.booleans(), label="reuse"):
            base = self.history[data.draw(st.integers(0, len(self.history) - 1), label="which")]
            base = base[: data.draw(st.integers(0, len(base)), label="cut")]
        else:
            base = ()
        tail = data.draw(st.lists(st.integers(0, 2), max_size=3 * self.ps), label="tail")
        return tuple(base) + tuple(tail)

    # ------------------------------------------------------------ rules
    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        self._insert(self._key(data), data)

    @precondition(lambda self: self.tickets)
    @rule(data=st.data())
    def insert_over_a_load(self, data: st.DataObject) -> None:
        """An insert along a path still loading: it stops before the loading nodes."""
        tk = self.tickets[data.draw(st.integers(0, len(self.tickets) - 1), label="ticket")]
        toks = tuple(self.tree.node_key(tk.node_ids[-1]).tokens)
        toks = toks[: data.draw(st.integers(0, len(toks)), label="cut")]
        tail = data.draw(st.lists(st.integers(0, 2), max_size=2 * self.ps), label="tail")
        self._insert(toks + tuple(tail), data)

    def _insert(self, toks: tuple[int, ...], data: st.DataObject) -> None:
        ps = self.ps
        n = len(toks)
        end = n - n % ps
        full = self._alloc_full(n, True)
        for i, s in enumerate(full.tolist()):
            self.content["full"][s] = toks[: i + 1]
        floor = 0
        kw: dict[str, Any] = {}
        if self.SWA:
            for i, s in enumerate(self._swa_of(full)):
                self.content["swa"][s] = toks[: i + 1]
            if data.draw(st.booleans(), label="swa floor given"):
                # The caller already freed the SWA side of its first ``floor`` tokens.
                floor = data.draw(st.integers(0, n), label="swa floor")
                assert self.smap is not None
                self.smap.free_swa(self.smap.translate(full[:floor]))
            kw["component_evicted_seqlens"] = {"swa": floor}
        state = None
        if self.MAMBA and end:
            (state,) = self._take("mamba", 1).tolist()
            self.content["mamba"][state] = toks[:end]
            kw["mamba_value"] = state
        # ---- predict
        snap, states = self._snapshot()
        cached = 0
        while cached < end and self._pos(toks, cached) in snap:
            cached += ps
        limit = next((i for i in range(0, cached, ps) if snap[self._pos(toks, i)][2]), None)
        cut = limit is not None
        stop = limit if limit is not None else end  # the page-aligned tokens the insert covers
        if cut:
            floor = min(floor, stop)
        floor_a = -(-floor // ps) * ps
        span = -(-self.window // ps) * ps
        recover = max(floor_a, stop - span)  # a cached tombstone is SWA-live from here on
        dups: list[int] = []
        swa_frees: list[int] = []
        adopt_node: list[int] = []
        adopt_caller: list[int] = []
        full0, live0, _ = self._device()
        taken: list[int] = []  # FULL slots the tree takes
        lives: list[int] = []  # FULL slots that become SWA-live
        host_only = False  # a tombstone recovered with the caller's own slots (un-evicted)
        for i in range(stop):
            v = int(full[i])
            if i < cached:
                own, live, _ = snap[self._pos(toks, i)]
                unevicted = own is None
                if unevicted:
                    own = v  # a host-only node takes the caller's FULL slot
                    taken.append(v)
                elif own != v:
                    dups.append(v)
                if not self.SWA or live or i < floor:
                    continue
                # A node the insert un-evicts is SWA-live again from the floor's page on
                # (as the reference rebuilds it), a cached tombstone only in the last window.
                if i < (floor_a if unevicted else recover):
                    swa_frees.append(v)  # the tombstone stays: the caller's SWA side goes
                    continue
                lives.append(own)  # recovered
                if own != v:
                    adopt_node.append(own)
                    adopt_caller.append(v)
                else:  # the caller's own pairs: nothing to adopt
                    host_only = True
            else:
                taken.append(v)
                if self.SWA and floor <= i < floor_a:
                    swa_frees.append(v)  # a partly freed page above the floor is not kept
                elif self.SWA and i >= floor_a:
                    lives.append(v)
        exist = self.MAMBA and stop > 0 and toks[:stop] in states
        mamba_frees = [state] if state is not None and (cut or exist) else []
        # ---- run
        r = self.tree.insert(list(toks), full, **kw)
        assert (r.prefix_len, r.cached_len) == (min(cached, stop), stop)
        assert tuple(self.tree.node_key(r.last_node).tokens) == toks[:stop]
        assert flat(r.device_frees) == dups
        assert flat(r.component_frees.get("swa", [])) == swa_frees
        assert all(len(a) == len(b) for a, b in r.swa_adopted)
        assert flat(a for a, _ in r.swa_adopted) == adopt_node
        assert flat(b for _, b in r.swa_adopted) == adopt_caller
        assert flat(r.component_frees.get("mamba", [])) == mamba_frees
        assert r.mamba_exist == exist
        full1, live1, _ = self._device()
        assert sorted(full1) == sorted(full0 + taken)
        assert sorted(live1) == sorted(live0 + lives)
        # ---- apply
        if self.smap is not None:
            sides = self._swa_of(adopt_caller)
            self.smap.apply_tree_frees(r.device_frees, r.component_frees["swa"], r.swa_adopted)
            # The recovered nodes' FULL slots now have the SWA side the caller's slots had.
            assert self._swa_of(adopt_node) == sides
        else:
            self._free_full(r.device_frees)
        self._free_full([full[stop:]])  # beyond the cut and the unaligned tail: the caller's
        self._give_back("mamba", [mamba_frees])
        self.backups.extend(r.backups)
        event(f"insert: cut {cut}, swa frees {bool(swa_frees)}, adopted {bool(adopt_node)}")
        event(f"insert: recovered on a host-only node {host_only}")
        if end:
            self.history.append(toks[:end])

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def insert_host(self, data: st.DataObject) -> None:
        """Pages fetched from storage: FULL pages, the last window's SWA pages, the state."""
        toks = self.history[data.draw(st.integers(0, len(self.history) - 1), label="key")]
        toks = toks + tuple(data.draw(st.lists(st.integers(0, 2), max_size=2 * self.ps),
                                      label="more"))
        toks = toks[: len(toks) - len(toks) % self.ps]
        hit = self.tree.match_prefix(list(toks)).full_kv_hit_length
        start = data.draw(st.integers(0, hit // self.ps), label="start") * self.ps
        n = len(toks) - start
        if n <= 0:
            return
        host = self._take("hfull", n)
        for i, h in enumerate(host.tolist()):
            self.content["hfull"][h] = toks[: start + i + 1]
        kw: dict[str, Any] = {}
        if self.SWA:
            w = min(n, data.draw(st.integers(0, n // self.ps), label="swa") * self.ps)
            swa = np.full(n, -1, dtype=np.int64)
            swa[n - w :] = self._take("hswa", w)
            for i in range(n - w, n):
                self.content["hswa"][int(swa[i])] = toks[: start + i + 1]
            kw["swa_host_slots"] = swa
        if self.MAMBA and data.draw(st.booleans(), label="state"):
            (state,) = self._take("hmamba", 1).tolist()
            self.content["hmamba"][state] = toks
            kw["mamba_host_slot"] = state
        before = self._device()
        r = self.tree.insert_host(list(toks), start, host, **kw)
        assert self._device() == before  # host pages only: nothing changes on device
        assert r.swa_adopted == []
        event("insert_host")
        self._give_back("hfull", r.device_frees)
        for name, arrays in r.component_frees.items():
            self._give_back(HOST[name], arrays)
        self.history.append(toks)

    @precondition(lambda self: self.backups)
    @rule(i=st.integers(0, 50), ok=st.booleans())
    def finish_backup(self, i: int, ok: bool) -> None:
        b = self.backups.pop(i % len(self.backups))
        if not ok:
            self.tree.abort_backup(b.op_id)
            return
        host = self._take("hfull", len(b.device_slots))
        for d, h in zip(b.device_slots.tolist(), host.tolist(), strict=True):
            self.content["hfull"][h] = self.content["full"][d]
        parts = {}
        for name, dev in b.component_slots.items():
            hs = self._take(HOST[name], len(dev))
            if name == "swa":  # the nodes' FULL slots: the cache copies their SWA side
                assert set(dev.tolist()) <= set(b.device_slots.tolist())
                src = self._swa_of(dev)
            else:
                src = dev.tolist()
            for d, h in zip(src, hs.tolist(), strict=True):
                self.content[HOST[name]][h] = self.content[name][d]
            parts[name] = hs
        self.tree.commit_backup(b.op_id, host, parts)
        event(f"backup with {sorted(parts)}")

    @rule(n=st.integers(0, 8), swa=st.integers(0, 6), mamba=st.integers(0, 2))
    def evict(self, n: int, swa: int, mamba: int) -> None:
        full0, live0, states0 = self._device()
        e = self.tree.evict(n, swa_num_tokens=swa if self.SWA else 0,
                            mamba_num=mamba if self.MAMBA else 0)
        full1, live1, states1 = self._device()
        # Exactly what the tree no longer holds: FULL slots (demoted or deleted nodes), FULL
        # slots whose SWA side it gave up (tombstoned, demoted or deleted), states.
        freed = flat(e.device_frees)
        fswa = flat(e.component_frees.get("swa", []))
        fmamba = flat(e.component_frees.get("mamba", []))
        assert sorted(freed) == sorted(set(full0) - set(full1)) and set(full1) <= set(full0)
        assert sorted(fswa) == sorted(set(live0) - set(live1)) and set(live1) <= set(live0)
        assert sorted(fmamba) == sorted(set(states0) - set(states1))
        assert (e.num_evicted, e.swa_num_evicted, e.mamba_num_evicted) == (
            len(freed), len(fswa), len(fmamba))
        self._apply_evict(e)

    @rule(n=st.integers(1, 8))
    def evict_host(self, n: int) -> None:
        before = self._device()
        h = self.tree.evict_host(n)
        assert self._device() == before
        self._give_back("hfull", h.host_frees)
        for name, arrays in h.component_host_frees.items():
            self._give_back(HOST[name], arrays)

    @precondition(lambda self: self.history)
    @rule(data=st.data(), commit_now=st.booleans())
    def load_back(self, data: st.DataObject, commit_now: bool) -> None:
        toks = self.history[data.draw(st.integers(0, len(self.history) - 1), label="key")]
        m = self.tree.match_prefix(list(toks))
        if not m.host_hit_length:
            return
        try:
            sizes = self.tree.load_back_sizes(m.best_node)
        except InvalidInputError:
            return  # in flight (a load or a backup) on the path
        dev = self._alloc_full(sizes["full"], False)
        comps = {}
        if sizes.get("swa") is not None:
            assert self.smap is not None  # SWA slots come unpaired: the ticket pairs them
            got = self.smap.swa.alloc(sizes["swa"])
            assert got is not None
            comps["swa"] = got
        if sizes.get("mamba") is not None:
            comps["mamba"] = self._take("mamba", sizes["mamba"])
        live0 = set(self._device()[1])
        tk = self.tree.start_load_back(m.best_node, dev, comps)
        event(f"load-back of {sorted(k for k, v in sizes.items() if v)}")
        live1 = set(self._device()[1])
        for d, h in zip(tk.device_slots.tolist(), tk.host_slots.tolist(), strict=True):
            self.content["full"][d] = self.content["hfull"][h]
        for name, devs in tk.component_device_slots.items():
            hosts = tk.component_host_slots[name].tolist()
            for d, h in zip(devs.tolist(), hosts, strict=True):
                self.content[name][d] = self.content[HOST[name]][h]
        if sizes.get("swa"):
            # The FULL slots of exactly the nodes whose SWA is loaded, with the given slots.
            assert tk.swa_pairs is not None and self.smap is not None
            fulls, swas = tk.swa_pairs
            assert swas.tolist() == comps["swa"].tolist() == tk.component_device_slots[
                "swa"].tolist()
            assert sorted(fulls.tolist()) == sorted(live1 - live0) and live0 <= live1
            self.smap.adopt(fulls, swas)
            for f, s in zip(fulls.tolist(), swas.tolist(), strict=True):
                assert self.content["full"][f] == self.content["swa"][s]
        else:
            assert tk.swa_pairs is None and live1 == live0
        if commit_now:
            self.tree.commit_load_back(tk.op_id)
            after = self.tree.match_prefix(list(toks))
            assert (after.device_prefix_len, after.host_hit_length) == (
                m.device_prefix_len + m.host_hit_length, 0)
            assert after.last_device_node == m.best_node
        else:
            self.tickets.append(tk)

    @precondition(lambda self: self.history)
    @rule(data=st.data(), n=st.integers(1, 16), swa=st.integers(0, 6))
    def back_up_evict_and_load(self, data: st.DataObject, n: int, swa: int) -> None:
        """The round trip the L2 tier exists for: every backup lands, eviction demotes, a
        host hit is loaded back."""
        while self.backups:
            self.finish_backup(0, True)
        self.evict(n, swa, 1)
        while self.backups:
            self.finish_backup(0, True)
        self.load_back(data, True)

    @precondition(lambda self: self.tickets)
    @rule(i=st.integers(0, 50), ok=st.booleans())
    def finish_load(self, i: int, ok: bool) -> None:
        tk = self.tickets.pop(i % len(self.tickets))
        if ok:
            self.tree.commit_load_back(tk.op_id)
            return
        frees = self.tree.abort_load_back(tk.op_id)
        # The FULL slots it loaded come back; the nodes whose SWA it loaded are tombstones again.
        assert sorted(flat(frees)) == sorted(tk.device_slots.tolist())
        if tk.swa_pairs is not None:
            assert set(tk.swa_pairs[0].tolist()).isdisjoint(self._device()[1])
        swa = tk.component_device_slots.get("swa")
        if swa is not None:
            assert self.smap is not None
            self.smap.free_swa(swa)
        self._free_full(frees)
        mamba = tk.component_device_slots.get("mamba")
        if mamba is not None:
            self._give_back("mamba", [mamba])

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def lock(self, data: st.DataObject) -> None:
        toks = self.history[data.draw(st.integers(0, len(self.history) - 1), label="key")]
        m = self.tree.match_prefix(list(toks))
        self.receipts.append(self.tree.lock(m.last_device_node))

    @precondition(lambda self: self.receipts)
    @rule(i=st.integers(0, 50))
    def unlock(self, i: int) -> None:
        self.tree.unlock(self.receipts.pop(i % len(self.receipts)))

    # ------------------------------------------------------------ invariants
    @invariant()
    def consistent(self) -> None:
        t = self.tree
        t.sanity_check()
        full, live, states = self._device()
        held = {"mamba": states, "hfull": t.host_slots().tolist(), "hswa": [], "hmamba": []}
        for name in t.components[1:]:
            held[HOST[name]] = t.component_host_slots(name).tolist()
        for pool in POOLS:
            h = held[pool]
            assert len(h) == len(set(h)), f"a {pool} slot is held twice"
            assert set(h).isdisjoint(self.back[pool]), f"a {pool} slot is held and given back"
            assert set(h) | self.back[pool] == self.given[pool], f"a {pool} slot leaked"
        # The device pools hold exactly the tree's slots (none leaked, none freed while held).
        assert len(full) == len(set(full)), "a FULL slot is held twice"
        assert self.full.is_allocated(full).all(), "the tree holds a freed FULL slot"
        assert self.full.used_size == DEVICE_SLOTS // 2 + len(full), "a FULL slot leaked"
        if self.smap is not None:
            self.smap.check()
            paired = np.flatnonzero(self.smap.full_to_swa >= 0).tolist()
            assert paired == sorted(live), "SWA sides are not exactly the SWA-live FULL slots"
            assert set(live) <= set(full)
            assert self.smap.swa.used_size == len(live), "an SWA slot leaked"
        names = t.components[1:]
        for n in t.iter_nodes():
            key = tuple(t.node_key(n.id).tokens)
            start = len(key) - n.ntok
            want = [key[: start + j + 1] for j in range(n.ntok)]
            parts: list[tuple[str, Any]] = [("full", n.value), ("hfull", n.host_value)]
            for name in names:
                dev = t.component_slots_of(n.id, name)
                if name == "swa" and dev is not None:
                    assert dev is n.value  # the SWA entry is the node's FULL array
                    dev = self._swa_of(dev)
                parts += [(name, dev), (HOST[name], t.component_host_slots_of(n.id, name))]
            for pool, slots in parts:
                if slots is None:
                    continue
                got = [self.content[pool][s] for s in np.asarray(slots).tolist()]
                assert got == ([key] if pool.endswith("mamba") else want), (
                    f"node {n.id} {pool} slots hold {got}")

    def teardown(self) -> None:
        t = getattr(self, "tree", None)
        if t is None:
            return
        for r in self.receipts:
            t.unlock(r)
        for tk in self.tickets:
            t.commit_load_back(tk.op_id)
        for b in self.backups:
            t.abort_backup(b.op_id)
        t.sanity_check()


SETTINGS = stateful_settings(60)


def _machine(swa: bool, mamba: bool) -> Any:
    return machine_case(HostHybridMachine, f"HostHybridMachine_swa{int(swa)}_mamba{int(mamba)}",
                        SETTINGS, SWA=swa, MAMBA=mamba)


TestHostFullSWA = _machine(True, False)
TestHostFullMamba = _machine(False, True)
TestHostFullSWAMamba = _machine(True, True)
