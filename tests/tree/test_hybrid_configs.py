"""One suite over every tree configuration: FULL, FULL+SWA, FULL+Mamba, FULL+SWA+Mamba, at
several page sizes and windows. Each test runs the same requests and checks exact slots, sizes
and per-pool accounting (every slot handed out is held by the tree or given back, once)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

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
    """Fresh slots per pool, and which ones came back."""

    def __init__(self) -> None:
        self.next = {"full": 0, "swa": 10_000, "mamba": 20_000}
        self.given: dict[str, set[int]] = {p: set() for p in self.next}
        self.back: dict[str, list[int]] = {p: [] for p in self.next}

    def take(self, pool: str, n: int) -> np.ndarray:
        out = np.arange(self.next[pool], self.next[pool] + n, dtype=np.int64)
        self.next[pool] += n
        self.given[pool].update(out.tolist())
        return out

    def give_back(self, pool: str, arrays: list[np.ndarray]) -> None:
        for a in arrays:
            self.back[pool].extend(int(s) for s in a.tolist())

    def check(self, tree: RadixTree) -> None:
        tree.sanity_check()
        held = {"full": tree.device_slots().tolist()}
        for name in tree.components[1:]:
            held[name] = tree.component_slots(name).tolist()
        for pool, given in self.given.items():
            h = held.get(pool, [])
            back = self.back[pool]
            assert len(back) == len(set(back)), f"a {pool} slot came back twice"
            assert sorted(h + back) == sorted(given), f"{pool} slots do not balance"


def make(ps: int, window: int, mamba: bool) -> RadixTree:
    return RadixTree(page_size=ps, sliding_window=window, mamba=mamba)


def insert(tree: RadixTree, pools: Pools, tokens: list[int], *, prefix: Any = None) -> Any:
    """Insert like a finished request: reuse the matched prefix's slots, fresh ones after."""
    n = len(tokens)
    dpl = 0 if prefix is None else prefix.device_prefix_len
    value = pools.take("full", n - dpl)
    if prefix is not None:
        value = np.concatenate([prefix.device_indices, value])
    kwargs: dict[str, Any] = {"prev_prefix_len": dpl}
    if "swa" in tree.components:
        kwargs["swa_value"] = pools.take("swa", n)
    if "mamba" in tree.components:
        kwargs["mamba_value"] = int(pools.take("mamba", 1)[0])
    res = tree.insert(tokens, value, **kwargs)
    pools.give_back("full", [*res.device_frees, value[res.cached_len :]])
    for name in tree.components[1:]:
        pools.give_back(name, res.component_frees[name])
    if "swa" in tree.components:
        # Below prev_prefix_len and past the cached length the caller keeps its SWA slots.
        pools.give_back("swa", [kwargs["swa_value"][:dpl], kwargs["swa_value"][res.cached_len :]])
    if "mamba" in tree.components and res.cached_len == 0:
        pools.give_back("mamba", [np.array([kwargs["mamba_value"]])])
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
    pools.give_back("full", e.device_frees)
    for name in tree.components[1:]:
        pools.give_back(name, e.component_frees[name])
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
    pools.give_back("full", e.device_frees)
    for name in tree.components[1:]:
        pools.give_back(name, e.component_frees[name])
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
    pools.give_back("full", device)
    for name, arrays in comp.items():
        pools.give_back(name, arrays)
    pools.check(tree)
    assert tree.node_count == 0
