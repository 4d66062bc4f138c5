"""A hybrid cache (FULL + SWA + Mamba) with a host tier on several real rank processes
(spawn, gloo on 127.0.0.1): every rank runs the same random workload under device pressure
(backups, demotions, load-backs of component values) while its copies complete at other
times; the ranks must end with the same tree (components included), KV events, served bytes
and pool usage. A copy that fails on one rank commits on none, and a rank that dies with
hybrid copies in flight is reported, not hung on."""

from __future__ import annotations

from pathlib import Path

import pytest

from asynccache.testing.ranks import check_ranks, run_ranks

SCENARIOS = Path(__file__).with_name("hybrid_rank_scenarios.py")


def _assert_identical(results: list[dict]) -> None:
    first = results[0]
    for r in results[1:]:
        for what in ("digest", "kv", "events", "log", "ticks", "skipped", "failed_items",
                     "load_backs", "backups", "dropped", "host_parts"):
            assert r[what] == first[what], f"rank {r['rank']} {what} differs from rank 0"
    for r in results:
        assert r["in_flight"] == (0, 0, {"swa": 0, "mamba": 0}, 0)
        assert r["closed_clean"]
    # exercised: agreed ticks, completions held back for a slower peer, component backups
    # and load-backs
    assert first["ticks"] > 0 and sum(r["held_back"] for r in results) > 0
    assert first["load_backs"] > 0 and first["backups"] > 0
    assert first["host_parts"] != (0, 0) or first["skipped"]["backup"] > 0


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_two_ranks_hybrid_host_tier_agree(policy: str) -> None:
    results = check_ranks(run_ranks(SCENARIOS, "hybrid_workload", 2,
                                    args=(1, policy, 160), timeout_s=120))
    _assert_identical(results)
    assert results[0]["failed_items"] == 0


def test_a_copy_failing_on_one_rank_commits_on_none() -> None:
    """Three of rank 1's Mamba state copies and one of rank 0's FULL D->H copies fail (after
    the copy ran; whichever operations they belong to: backups, load-backs, retractions or
    restores): every rank retires those operations as failed (a load-back or restore raises
    on both), so their trees, bytes and counters still match."""
    results = check_ranks(run_ranks(SCENARIOS, "hybrid_workload", 2,
                                    args=(2, "write_through", 160, (3, 10, 17)),
                                    timeout_s=120))
    _assert_identical(results)
    assert [r["injected_failures"] for r in results] == [1, 3]
    # one item per failed operation (two injected failures may hit the same operation)
    assert results[0]["failed_items"] in (3, 4)


@pytest.mark.slow
def test_four_ranks_tp2_pp2_hybrid_agree() -> None:
    results = check_ranks(run_ranks(SCENARIOS, "hybrid_workload", 4,
                                    args=(2, "write_back", 100), timeout_s=150))
    _assert_identical(results)


def test_a_rank_dying_mid_hybrid_copy_is_reported() -> None:
    alive, dead = run_ranks(SCENARIOS, "hybrid_workload", 2,
                            args=(2, "write_through", 60, (), 40), timeout_s=90)
    assert alive.ok, alive.error
    assert not dead.ok and dead.exitcode == 3
    assert "rank 0/2" in alive.result["failure"] and "failed" in alive.result["failure"]
    assert alive.result["closed_clean"]
