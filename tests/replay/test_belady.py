"""The offline optimum (Belady over prefix pages) of a replay: hand-computed small traces and a
property check against the real tree's online policies."""

from __future__ import annotations

import asyncio

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from asynccache import CacheConfig
from asynccache.replay.bound import BeladyBound, belady_hits
from asynccache.replay.driver import Replayer, ReplayOptions
from asynccache.replay.formats import TraceRequest
from asynccache.replay.report import build_report, format_table


def pages(*blocks: int, ps: int = 2) -> np.ndarray:
    """A prompt of whole pages: block ``b`` is tokens ``[b*ps, b*ps+ps)``."""
    return np.concatenate([np.arange(b * ps, b * ps + ps) for b in blocks]).astype(np.uint32)


def test_sequence_optimum_hand_computed() -> None:
    # Flattened page ids, capacity 2: a b c a b c. Belady (with bypass): a, b in; c bypassed
    # (its next use is after a's and b's); a hit, b hit; c miss. 2 hits. LRU would score 0.
    seq = np.array([0, 1, 2, 0, 1, 2])
    assert belady_hits(seq, np.array([0, 0, 0, 0, 0, 0]), 2) == 2
    assert belady_hits(seq, np.zeros(6, dtype=np.int64), 3) == 3
    assert belady_hits(seq, np.zeros(6, dtype=np.int64), 0) == 0


def test_prefix_pages_hand_computed() -> None:
    # Requests as page chains (block ids, 2-token pages), capacity 3 pages:
    #   r1: A B   r2: A C   r3: A B   r4: A C
    # Optimum keeps A, B, C after r2 (3 pages): r2 hits A (1), r3 hits A B (2), r4 hits A C (2).
    b = BeladyBound(page_size=2, capacity_pages=3)
    for blocks in ((1, 2), (1, 3), (1, 2), (1, 3)):
        b.access(pages(*blocks))
    assert b.hit_pages() == 5
    # Capacity 2: after r1 (A B), r2 needs C: keep A, evict B or C (both next used at r3 / r4;
    # B is used first, so C is bypassed): r2 hits A, r3 hits A B, r4 hits A -> 4.
    b2 = BeladyBound(page_size=2, capacity_pages=2)
    for blocks in ((1, 2), (1, 3), (1, 2), (1, 3)):
        b2.access(pages(*blocks))
    assert b2.hit_pages() == 4


def test_partial_tail_and_namespaces() -> None:
    b = BeladyBound(page_size=2, capacity_pages=10)
    b.access(np.array([1, 2, 3], dtype=np.uint32))  # one whole page, a partial one
    b.access(np.array([1, 2, 3], dtype=np.uint32))  # hits the whole page only
    b.access(np.array([1, 2, 3], dtype=np.uint32), namespace="other")  # another namespace
    assert b.hit_pages() == 1
    assert b.hit_tokens() == 2


def test_child_never_outlives_parent() -> None:
    # Capacity 2. r1: A B C; r2: X (evicts, keeps the pages used soonest); r3: A B C.
    # The optimum keeps A and B (a hit of C needs A and B too): r3 hits 2.
    b = BeladyBound(page_size=2, capacity_pages=2)
    for blocks in ((1, 2, 3), (9,), (1, 2, 3)):
        b.access(pages(*blocks))
    assert b.hit_pages() == 2


def _tree_hits(reqs: list[tuple[int, ...]], capacity: int, policy: str) -> int:
    """Whole-page hits of the real radix tree under ``policy`` with ``capacity`` pages (ps 2):
    match, evict what the new pages need, insert — the replay's order for one request."""
    from asynccache.tree import RadixTree

    tree = RadixTree(page_size=2, eviction_policy=policy, device_tokens=capacity * 2)
    free = list(range(capacity * 2))
    hits = 0
    for blocks in reqs:
        toks = pages(*blocks)
        m = tree.match_prefix(toks.tolist())
        h = m.device_prefix_len
        hits += h // 2
        need = len(toks) - h
        if need > capacity * 2:
            continue
        receipt = tree.lock(m.last_device_node)
        if len(free) < need:
            res = tree.evict(need - len(free))
            for arr in res.device_frees:
                free.extend(int(x) for x in arr)
        tree.unlock(receipt)
        if len(free) < need:
            continue
        got = m.device_indices.tolist()
        new = [free.pop() for _ in range(need)]
        r = tree.insert(toks.tolist(), np.array(got + new, dtype=np.int64))
        for arr in r.device_frees:
            free.extend(int(x) for x in arr)
    return hits


def test_tree_harness_counts_hits() -> None:
    # The harness the property test compares with: LRU, 2 pages. r1 A B; r2 A B hits 2;
    # r3 X needs one page: the LRU leaf is the node A B, freed whole; r4 misses.
    reqs = [(1, 2), (1, 2), (9,), (1, 2)]
    assert _tree_hits(reqs, 2, "lru") == 2
    b = BeladyBound(page_size=2, capacity_pages=2)
    for blocks in reqs:
        b.access(pages(*blocks))
    assert b.hit_pages() == 4  # X bypasses the cache


chains = st.lists(
    st.lists(st.integers(0, 5), min_size=1, max_size=5).map(tuple), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(reqs=chains, capacity=st.integers(1, 8))
def test_optimum_at_least_every_online_policy(reqs: list[tuple[int, ...]], capacity: int) -> None:
    # Block ids are prefix-closed per position here: (1, 2) and (3, 2) share no page.
    b = BeladyBound(page_size=2, capacity_pages=capacity)
    for blocks in reqs:
        b.access(pages(*blocks))
    opt = b.hit_pages()
    for policy in ("lru", "lfu", "fifo", "mru", "filo", "priority", "arc"):
        assert opt >= _tree_hits(reqs, capacity, policy), policy


def _trace(reqs: list[tuple[int, ...]], ps: int) -> list[TraceRequest]:
    return [TraceRequest(f"r{i}", float(i), pages(*b, ps=ps)) for i, b in enumerate(reqs)]


def test_replay_reports_the_optimum_at_l1_capacity() -> None:
    # 4-token pages, L1 of 3 pages, L1 only. r1 A B, r2 C D (evicts the node A B whole under
    # LRU), r3 A B (misses, the engine needs its 2 pages free), r4 C D.
    # Optimum (3 pages): after r2 keep A B C (D is next used last): r3 hits 2, r4 hits 1.
    reqs = [(1, 2), (3, 4), (1, 2), (3, 4)]
    config = CacheConfig(page_size=4, num_layers=1, num_heads=1, head_dim=2,
                         device_tokens=12, host_tokens=0, device="cpu")
    rp = Replayer(config, ReplayOptions(verify="none"))
    stats = asyncio.run(rp.run(_trace(reqs, 4)))
    assert stats.optimum_hit_pages == 3
    assert stats.optimum_hit_tokens == 12
    report = build_report(stats, config, "test")
    hr = report["hit_rate"]
    assert hr["optimum_l1_blocks"] == 0.375  # 3 of 8 blocks
    assert hr["optimum_l1_tokens"] == 0.375
    assert hr["device_blocks"] <= hr["optimum_l1_blocks"]
    assert report["config"]["optimum_capacity_blocks"] == 3
    assert "L1 optimum, Belady (tokens / blocks)" in format_table(report)
    assert "37.50%" in format_table(report)


def test_sweep_table_has_the_optimum_column() -> None:
    from asynccache.replay.report import format_sweep

    reqs = [(1, 2), (3, 4), (1, 2), (3, 4)]
    config = CacheConfig(page_size=4, num_layers=1, num_heads=1, head_dim=2,
                         device_tokens=12, host_tokens=0, device="cpu")
    stats = asyncio.run(Replayer(config, ReplayOptions(verify="none")).run(_trace(reqs, 4)))
    table = format_sweep([build_report(stats, config, "test")])
    head, row = table.splitlines()[1:3]
    assert head.split()[-2:] == ["L1", "optimum"]
    assert row.endswith("37.50% / 37.50%")


def test_lru_credit_through_every_tier(tmp_path, capsys) -> None:
    """The new policy drives a replay with L2 and L3 (KV of loaded pages verified); its L1 hits
    stay under the optimum the same run reports."""
    import json

    from asynccache.cli import main

    argv = ["replay", "--json", "--progress", "off", "--limit", "100", "--eviction-policy",
            "lru_credit", "--storage", f"file://{tmp_path}/l3", "--clear-storage"]
    assert main(argv) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["status"] == "complete" and rep["config"]["eviction_policy"] == "lru_credit"
    hr = rep["hit_rate"]
    assert hr["device_blocks"] <= hr["optimum_l1_blocks"] <= hr["infinite_cache_bound_blocks"]
    assert rep["verified_tokens"] > 0
