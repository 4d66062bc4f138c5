"""Hypothesis stateful test of hybrid trees with a host tier (FULL+SWA, FULL+Mamba,
FULL+SWA+Mamba under every write policy).

Every slot of the six pools (device and host: FULL, SWA, Mamba) carries what it holds: the
prefix whose last token's KV it stores (FULL, SWA) or the prefix a state describes (Mamba).
Backups and load-backs copy those contents from the slots named in the requests and tickets.
After every step: ``sanity_check()``; every node's device and host slots of every component
hold exactly its own prefix (copies are bit-exact and go to the right nodes across splits,
demotion, eviction and load-back); every slot the test handed out is held by the tree or was
given back exactly once. A load-back committed at once turns the host hit into a device hit.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from asynccache.errors import InvalidInputError
from asynccache.tree import RadixTree
from tests.tree.stateful_cases import machine_case, stateful_settings

POOLS = ("full", "swa", "mamba", "hfull", "hswa", "hmamba")
HOST = {"full": "hfull", "swa": "hswa", "mamba": "hmamba"}


class HostHybridMachine(RuleBasedStateMachine):
    SWA = False
    MAMBA = False

    @initialize(ps=st.sampled_from([1, 2]), window=st.integers(1, 5),
                policy=st.sampled_from(["write_through", "write_through_selective",
                                        "write_back"]))
    def setup(self, ps: int, window: int, policy: str) -> None:
        self.ps = ps
        self.tree = RadixTree(page_size=ps, sliding_window=window if self.SWA else 0,
                              mamba=self.MAMBA, host_enabled=True, write_policy=policy)
        self.next = {p: 1000 * (i + 1) for i, p in enumerate(POOLS)}
        self.given: dict[str, set[int]] = {p: set() for p in POOLS}
        self.back: dict[str, set[int]] = {p: set() for p in POOLS}
        self.content: dict[str, dict[int, tuple[int, ...]]] = {p: {} for p in POOLS}
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

    def _held(self) -> dict[str, list[int]]:
        t = self.tree
        out = {"full": t.device_slots().tolist(), "hfull": t.host_slots().tolist(),
               "swa": [], "hswa": [], "mamba": [], "hmamba": []}
        for name in t.components[1:]:
            out[name] = t.component_slots(name).tolist()
            out[HOST[name]] = t.component_host_slots(name).tolist()
        return out

    def _settle_caller(self) -> None:
        """Slots handed out that the tree neither holds nor returned stay the caller's: it
        frees them (the unaligned tail, a state the tree did not take)."""
        held = self._held()
        for pool in POOLS:
            if pool.startswith("h"):
                continue
            inflight = set()
            for tk in self.tickets:
                inflight |= set((tk.device_slots if pool == "full"
                                 else tk.component_device_slots.get(pool, np.empty(0))).tolist())
            left = self.given[pool] - self.back[pool] - set(held[pool]) - inflight
            self._give_back(pool, [sorted(left)])

    def _apply_evict(self, e: Any) -> None:
        self._give_back("full", e.device_frees)
        self._give_back("hfull", e.host_frees)
        for name, arrays in e.component_frees.items():
            self._give_back(name, arrays)
        for name, arrays in e.component_host_frees.items():
            self._give_back(HOST[name], arrays)
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
        toks = self._key(data)
        n = len(toks)
        end = n - n % self.ps
        full = self._take("full", n)
        for i, s in enumerate(full.tolist()):
            self.content["full"][s] = toks[: i + 1]
        kw: dict[str, Any] = {}
        if self.SWA:
            swa = self._take("swa", n)
            for i, s in enumerate(swa.tolist()):
                self.content["swa"][s] = toks[: i + 1]
            kw["swa_value"] = swa
        if self.MAMBA and end:
            (state,) = self._take("mamba", 1).tolist()
            self.content["mamba"][state] = toks[:end]
            kw["mamba_value"] = state
        r = self.tree.insert(list(toks), full, **kw)
        self._give_back("full", r.device_frees)
        for name, arrays in r.component_frees.items():
            self._give_back(name, arrays)
        self.backups.extend(r.backups)
        self._settle_caller()
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
        r = self.tree.insert_host(list(toks), start, host, **kw)
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
            for d, h in zip(dev.tolist(), hs.tolist(), strict=True):
                self.content[HOST[name]][h] = self.content[name][d]
            parts[name] = hs
        self.tree.commit_backup(b.op_id, host, parts)
        event(f"backup with {sorted(parts)}")

    @rule(n=st.integers(0, 8), swa=st.integers(0, 6), mamba=st.integers(0, 2))
    def evict(self, n: int, swa: int, mamba: int) -> None:
        e = self.tree.evict(n, swa_num_tokens=swa if self.SWA else 0,
                            mamba_num=mamba if self.MAMBA else 0)
        self._apply_evict(e)

    @rule(n=st.integers(1, 8))
    def evict_host(self, n: int) -> None:
        h = self.tree.evict_host(n)
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
        dev = self._take("full", sizes["full"])
        comps = {name: self._take(name, k) for name, k in sizes.items() if name != "full"}
        tk = self.tree.start_load_back(m.best_node, dev, comps)
        event(f"load-back of {sorted(k for k, v in sizes.items() if v)}")
        for d, h in zip(tk.device_slots.tolist(), tk.host_slots.tolist(), strict=True):
            self.content["full"][d] = self.content["hfull"][h]
        for name, devs in tk.component_device_slots.items():
            hosts = tk.component_host_slots[name].tolist()
            for d, h in zip(devs.tolist(), hosts, strict=True):
                self.content[name][d] = self.content[HOST[name]][h]
        if tk.swa_pairs is not None:
            fulls, swas = tk.swa_pairs
            for f, s in zip(fulls.tolist(), swas.tolist(), strict=True):
                assert self.content["full"][f] == self.content["swa"][s]
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
        self._give_back("full", self.tree.abort_load_back(tk.op_id))
        for name, devs in tk.component_device_slots.items():
            self._give_back(name, [devs])

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
        held = self._held()
        inflight: dict[str, set[int]] = {p: set() for p in POOLS}
        for pool in POOLS:
            h = held[pool]
            assert len(h) == len(set(h)), f"a {pool} slot is held twice"
            assert set(h).isdisjoint(self.back[pool]), f"a {pool} slot is held and given back"
            assert set(h) | self.back[pool] | inflight[pool] == self.given[pool], (
                f"a {pool} slot leaked")
        names = t.components[1:]
        for n in t.iter_nodes():
            key = tuple(t.node_key(n.id).tokens)
            start = len(key) - n.ntok
            want = [key[: start + j + 1] for j in range(n.ntok)]
            parts = [("full", n.value), ("hfull", n.host_value)]
            for name in names:
                parts += [(name, self.tree.component_slots_of(n.id, name)),
                          (HOST[name], self.tree.component_host_slots_of(n.id, name))]
            for pool, slots in parts:
                if slots is None:
                    continue
                got = [self.content[pool][s] for s in slots.tolist()]
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
