"""One suite over every tree configuration: FULL, FULL+SWA, FULL+Mamba, FULL+SWA+Mamba, at
several page sizes and windows. Each test runs the same requests and checks exact slots, sizes
and per-pool accounting (every slot handed out is held by the tree or given back, once; FULL
and SWA slots through a real full->SWA slot map)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from asynccache.transfers.allocator import PageAllocator
from asynccache.transfers.hybrid_pools import SWASlotMap
from asynccache.tree import RadixTree

CONFIGS = [
    pytest.param(ps, window, mamba, id=f"ps{ps}-{'swa' + str(window) if window else 'full'}"
                 f"{'-mamba' if mamba else ''}")
    for ps in (1, 4, 16)
    for window in (0, 1, ps, 3 * ps + 1)
    for mamba in (False, True)
    if not (window == ps and ps == 1)
]


class Pools:
    """The slots a request hands the tree: FULL slots paired with SWA slots through a real
    slot map (the tree names SWA data by FULL slots), and numbered Mamba states. ``apply``
    gives back what a tree result returns; ``check`` balances every pool against the tree."""

    def __init__(self) -> None:
        self.map = SWASlotMap(PageAllocator(4096, 1), PageAllocator(4096, 1))
        self.next_state = 20_000
        self.states_given: set[int] = set()
        self.states_back: list[int] = []

    def take(self, n: int) -> np.ndarray:
        out = self.map.alloc(n)
        assert out is not None
        return out

    def take_state(self) -> int:
        self.next_state += 1
        self.states_given.add(self.next_state)
        return self.next_state

    def apply(self, device_frees: list[np.ndarray], component_frees: dict[str, Any],
              adopted: Any = ()) -> None:
        self.map.apply_tree_frees(device_frees, component_frees.get("swa", []), adopted)
        self.states_back.extend(int(s) for a in component_frees.get("mamba", []) for s in a)

    def check(self, tree: RadixTree) -> None:
        tree.sanity_check()
        self.map.check()
        assert self.map.full.used_size == tree.device_size, "FULL slots do not balance"
        if "swa" in tree.components:
            assert self.map.swa.used_size == len(tree.component_slots("swa"))
            for n in tree.iter_nodes():  # SWA-live iff the node's FULL slots are paired
                sides = self.map.full_to_swa[n.value]
                if tree.component_slots_of(n.id, "swa") is not None:
                    assert (sides >= 0).all(), f"node {n.id} is SWA-live without SWA slots"
                else:
                    assert (sides == -1).all(), f"SWA tombstone {n.id} keeps SWA slots"
        if "mamba" in tree.components:
            held = tree.component_slots("mamba").tolist()
            back = self.states_back
            assert len(back) == len(set(back)), "a Mamba state came back twice"
            assert sorted(held + back) == sorted(self.states_given), "states do not balance"


def make(ps: int, window: int, mamba: bool) -> RadixTree:
    return RadixTree(page_size=ps, sliding_window=window, mamba=mamba)


def insert(tree: RadixTree, pools: Pools, tokens: list[int], *, prefix: Any = None) -> Any:
    """Insert like a finished request: reuse the matched prefix's slots, fresh ones after."""
    n = len(tokens)
    dpl = 0 if prefix is None else prefix.device_prefix_len
    value = pools.take(n - dpl)
    if prefix is not None:
        value = np.concatenate([prefix.device_indices, value])
    kwargs: dict[str, Any] = {"prev_prefix_len": dpl}
    if "mamba" in tree.components:
        kwargs["mamba_value"] = pools.take_state()
    res = tree.insert(tokens, value, **kwargs)
    pools.apply(res.device_frees, res.component_frees, res.swa_adopted)
    pools.map.free_full(value[res.cached_len :])  # the unaligned tail stays the caller's
    if "mamba" in tree.components and res.cached_len == 0:
        pools.states_back.append(kwargs["mamba_value"])
    return res


def seqs(ps: int) -> list[list[int]]:
    base = list(range(1, 4 * ps + 1))
    return [
        base,
        base[: 2 * ps] + [900 + i for i in range(3 * ps)],
        base + [700 + i for i in range(ps + 1)],  # an unaligned tail
        base[:ps],
    ]


@pytest.mark.parametrize(("ps", "window", "mamba"), CONFIGS)
def test_insert_then_match_hits_every_cached_page(ps: int, window: int, mamba: bool) -> None:
    tree = make(ps, window, mamba)
    pools = Pools()
    cached: dict[tuple[int, ...], list[int]] = {}
    for s in seqs(ps):
        res = insert(tree, pools, s)
        pools.check(tree)
        n = len(s) - len(s) % ps
        assert res.cached_len == n
        m = tree.match_prefix(s)
        assert (m.device_prefix_len, m.full_kv_hit_length) == (n, n)
        cached[tuple(s)] = m.device_indices.tolist()
    # Nothing was evicted: every inserted key still matches in full, with the same slots.
    for s, slots in cached.items():
        m = tree.match_prefix(list(s))
        assert m.device_indices.tolist() == slots
        assert m.swa_branching_seqlen is None and m.mamba_branching_seqlen is None
    # The S02 ownership rule: the shared prefix is stored once.
    assert tree.device_size == len(set().union(*[
        {tuple(s[: i + 1]) for i in range(len(s) - len(s) % ps)} for s in seqs(ps)]))
    pools.check(tree)


@pytest.mark.parametrize(("ps", "window", "mamba"), CONFIGS)
def test_a_locked_request_survives_eviction_of_every_component(
    ps: int, window: int, mamba: bool
) -> None:
    tree = make(ps, window, mamba)
    pools = Pools()
    for s in seqs(ps):
        insert(tree, pools, s)
    first = seqs(ps)[0]
    m = tree.match_prefix(first)
    r = tree.lock(m.last_device_node)
    assert r.delta == len(first)
    e = tree.evict(10**6, swa_num_tokens=10**6 if window else 0, mamba_num=10**6 if mamba else 0)
    pools.apply(e.device_frees, e.component_frees)
    pools.check(tree)
    # Only the locked path is left, and it still matches with its slots.
    assert (tree.device_size, tree.protected_size, tree.evictable_size) == (len(first),) * 2 + (0,)
    assert tree.match_prefix(first).device_indices.tolist() == m.device_indices.tolist()
    if window:
        assert tree.component_sizes("swa")[1] == r.swa_span
        assert r.swa_span >= min(window, len(first))
    if mamba:
        assert tree.component_sizes("mamba") == (0, 1)
    tree.unlock(r)
    e = tree.evict(10**6)
    pools.apply(e.device_frees, e.component_frees)
    pools.check(tree)
    assert tree.node_count == 0
    for name in tree.components:
        assert tree.component_sizes(name) == (0, 0)


@pytest.mark.parametrize(("ps", "window", "mamba"), CONFIGS)
def test_reuse_of_a_match_and_reset_balance_every_pool(ps: int, window: int, mamba: bool) -> None:
    tree = make(ps, window, mamba)
    pools = Pools()
    for s in seqs(ps):
        insert(tree, pools, s)
    longer = [*seqs(ps)[0], *range(500, 500 + 2 * ps)]
    m = tree.match_prefix(longer)
    assert m.device_prefix_len == 4 * ps
    res = insert(tree, pools, longer, prefix=m)
    assert (res.prefix_len, res.device_frees, res.cached_len) == (4 * ps, [], 6 * ps)
    assert tree.match_prefix(longer).device_prefix_len == 6 * ps
    pools.check(tree)
    comp = {name: [tree.component_slots(name)] for name in tree.components[1:]}
    device, host = tree.reset()
    assert host == []
    pools.apply(device, comp)
    pools.check(tree)
    assert pools.map.full.used_size == pools.map.swa.used_size == 0
    assert tree.node_count == 0
