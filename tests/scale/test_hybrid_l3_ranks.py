"""Storage (L3) for a hybrid cache (FULL + SWA + Mamba) on two real rank processes (spawn, gloo
on 127.0.0.1) over one real store: a 2-rank cache backs conversations up (each TP rank its
own KV pages, SWA pages and states, under its own object names), then a fresh pair of caches
prefetches them while the ranks' storage differs — per-rank read delays, states and SWA
pages deleted on one rank only (the queries find them missing), a state listed but unreadable
on one rank (its component read fails). Every rank must restore the same prefix, the deepest one every rank can restore,
bit for bit (its own KV, SWA window and state), with equal trees and balanced pools; a rank
that dies mid-prefetch is reported, not hung on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from asynccache.testing.ranks import check_ranks, run_ranks

SCENARIOS = Path(__file__).with_name("hybrid_rank_scenarios.py")


def _check(results: list[dict[str, Any]], pressure: bool = False) -> None:
    r0, r1 = results
    # conversation 0 (turns 200 / 400 / 600): rank 0 lost the state at 400, rank 1 the one at
    # 600 -> 200 on both; conversation 1 (100 / 300 / 600): rank 0 cannot read the state at
    # 600, rank 1 lost an SWA page of 300 -> 100 on both (under host-state pressure: 100, or
    # 0 when no host state slot could be had); conversation 2 (300 / 600), best_effort:
    # whatever both ranks agreed on, a turn end or 0
    assert r0["got"][0] == 200, r0["got"]
    assert r0["got"][1] in ((0, 100) if pressure else (100,)), r0["got"]
    assert r0["got"][2] in (0, 300, 600)
    for what in ("got", "digest"):
        assert r1[what] == r0[what], what
    # each rank's bytes are its own (the objects of the two TP ranks differ)
    assert r0["kv"] != r1["kv"]
    for r in results:  # each rank's backup wrote every KV page, SWA page and turn state
        assert r["stored"] == [(300, 300, [1, 1, 1]), (300, 300, [1, 1, 1]), (300, 300, [1, 1])]
        assert r["in_flight"] == (0, 0, {"swa": 0, "mamba": 0}, 0), r["in_flight"]
        assert r["closed_clean"]
    assert r0["fallbacks"]["not_stored"] > 0 and r1["fallbacks"]["not_stored"] > 0
    assert r0["injected"] > 0
    if not pressure:
        assert r0["fallbacks"]["fault"] > 0  # rank 0's component read failed
    else:
        assert r0["fallbacks"]["fault"] + r0["fallbacks"]["host_memory"] > 0


@pytest.mark.parametrize("mamba_host", [4, 1])
def test_two_ranks_restore_the_prefix_every_rank_can(tmp_path: Path, mamba_host: int) -> None:
    """``mamba_host=1``: one host state slot, so each component target evicts the host state
    an earlier prefetch inserted, or gives up the held one — at a tick, alike on both ranks."""
    url = f"file://{tmp_path / 'l3'}"
    results = check_ranks(run_ranks(SCENARIOS, "hybrid_l3", 2, args=(url, {}, False, mamba_host),
                                    timeout_s=120))
    _check(results, pressure=mamba_host == 1)
    assert results[0]["host_states"] == results[1]["host_states"] <= mamba_host


@pytest.mark.seaweedfs
def test_two_ranks_restore_from_an_s3_bucket(asynccache_s3: Any) -> None:
    url = asynccache_s3.url("hybrid-l3-ranks")
    kwargs = asynccache_s3.backend_kwargs()
    _check(check_ranks(run_ranks(SCENARIOS, "hybrid_l3", 2, args=(url, kwargs),
                                 timeout_s=120)))


def test_a_rank_dying_mid_prefetch_is_reported(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'l3'}"
    alive, dead = run_ranks(SCENARIOS, "hybrid_l3", 2, args=(url, {}, True), timeout_s=90)
    assert alive.ok, alive.error
    assert not dead.ok and dead.exitcode == 3
    assert "failed" in alive.result["failure"] or "timed out" in alive.result["failure"]
    assert alive.result["in_flight"] == (0, {"swa": 0, "mamba": 0})
