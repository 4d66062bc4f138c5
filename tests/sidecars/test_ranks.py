"""Sidecars on two tensor-parallel ranks (spawned processes, gloo): copies commit at agreed
ticks, every rank takes the same decisions, and the storage round trip (each rank's own
objects) serves KV, draft KV and indexer data bit for bit."""

from __future__ import annotations

from pathlib import Path

from asynccache.testing.ranks import check_ranks, run_ranks

SCENARIOS = Path(__file__).with_name("rank_scenarios.py")


def test_two_ranks_agree_and_round_trip_through_storage(tmp_path: Path) -> None:
    results = check_ranks(run_ranks(SCENARIOS, "serve", 2, args=(str(tmp_path / "l3"),),
                                    timeout_s=120))
    assert results[0]["log"] == results[1]["log"]
    log = results[0]["log"]
    second = [row for row in log if row[0] == 1]
    # Phase 2 starts from empty device and host tiers: the first request of each document
    # fetches all of it from storage (the others, their own tails).
    assert all(row[2] == row[4] > 0 for row in second[:4]), second
    assert all(r["checked"] > 0 for r in results)
