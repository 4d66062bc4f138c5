"""Multi-rank agreement: 2 and 4 real rank processes (spawn, gloo on 127.0.0.1) run the same
request stream through their own caches while their storage and scheduling timing differ;
every rank must end with the same tree, the same KV events and the same decisions, and a
rank that dies is reported instead of hung on."""

from __future__ import annotations

from pathlib import Path

import pytest

from asynccache.testing.ranks import check_ranks, run_ranks

SCENARIOS = Path(__file__).with_name("rank_scenarios.py")


def _assert_identical(results: list[dict]) -> None:
    first = results[0]
    for r in results[1:]:
        assert r["digest"] == first["digest"], f"rank {r['rank']} tree differs from rank 0"
        assert r["events"] == first["events"], f"rank {r['rank']} KV events differ from rank 0"
        assert r["log"] == first["log"], f"rank {r['rank']} took other decisions than rank 0"
        assert r["ticks"] == first["ticks"]
        assert r["digest_after_cancel"] == first["digest_after_cancel"]
    for r in results:
        assert r["peers_equal"], f"rank {r['rank']} saw a peer in another state"
        assert (r["held_locks"], r["host_inflight"], r["in_flight"]) == (0, 0, 0)
        assert r["closed_clean"]
        assert r["ticks_after_cancel"] == 2  # the cancelled tick applied, then one more


def test_four_ranks_tp2_pp2_agree(tmp_path: Path) -> None:
    outcomes = run_ranks(SCENARIOS, "agreement", 4, args=(str(tmp_path), 32, 2), timeout_s=150)
    results = check_ranks(outcomes)
    _assert_identical(results)
    # Exercised: ticks, held-back completions, L3 prefetches, device and host hits, evictions.
    log = results[0]["log"]
    assert results[0]["ticks"] > 0
    assert sum(r["held_back"] for r in results) > 0
    assert any(fetched for _, _, _, fetched, _, _ in log)
    assert any(dev for _, dev, _, _, _, _ in log)
    assert any(host for _, _, host, _, _, _ in log)
    assert results[0]["evicted"] > 0
    assert all(r["prefetched"] == results[0]["prefetched"] > 0 for r in results)
    # rank r = tp_rank + 2 * pp_rank; TP groups {0,1} {2,3}, PP groups {0,2} {1,3}
    assert [r["tp_min"] for r in results] == [0, 0, 2, 2]
    assert [r["pp_min"] for r in results] == [0, 1, 0, 1]
    assert all(r["min_max"] == (10, 3) for r in results)
    # storage names carry the TP and PP rank: four ranks, four objects per page
    names = [r["object_name"] for r in results]
    assert len(set(names)) == 4 and results[0]["all_names"] == names
    assert "tp0of2_pp0of2" in names[0] and "tp1of2_pp1of2" in names[3]


def test_two_ranks_write_back_replicated_kv_then_a_rank_dies(tmp_path: Path) -> None:
    """Write-back (eviction awaits its D->H copies through ticks), tp=2 with replicated KV."""
    outcomes = run_ranks(SCENARIOS, "agreement", 2,
                         args=(str(tmp_path), 24, 2, 1, True, "gloo", "write_back"),
                         timeout_s=90)
    alive, dead = outcomes
    assert alive.ok, alive.error
    assert not dead.ok and dead.exitcode == 3
    assert "died with exit code 3" in (dead.error or "")
    r = alive.result
    assert r["peers_equal"]  # checked in-world before rank 1 died
    assert r["evicted"] > 0 and r["ticks"] > 0
    assert any(loaded for *_, loaded, _ in r["log"])  # write-back copies were loaded back
    assert r["closed_clean"]
    assert "rank 0/2" in r["failure"] and "failed" in r["failure"]
    # replicated KV (MLA): both TP ranks name a page's object alike (rank 1 checked it too)
    assert "tp" not in r["object_name"].split(".")[1]
    assert len(r["all_names"]) == 2 and len(set(r["all_names"])) == 1


def test_a_rank_that_raises_is_reported(tmp_path: Path) -> None:
    outcomes = run_ranks(SCENARIOS, "raise_on_odd_rank", 2, timeout_s=60)
    assert outcomes[0].ok and outcomes[0].result == "rank 0 ok"
    assert not outcomes[1].ok
    assert "ValueError: rank 1 was told to fail" in (outcomes[1].error or "")
    with pytest.raises(Exception, match="rank 1: Traceback"):
        check_ranks(outcomes)


@pytest.mark.cuda
def test_nccl_group_drives_the_deferred_commits_on_a_gpu(tmp_path: Path) -> None:
    """One rank per GPU over NCCL (here as many GPUs as there are, at most 2): the tick's
    collective runs on CUDA tensors and the caches' L1 lives on the GPU."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    world = min(2, torch.cuda.device_count())
    outcomes = run_ranks(SCENARIOS, "agreement", world,
                         args=(str(tmp_path), 16, 1, None, False, "nccl"), timeout_s=150)
    results = check_ranks(outcomes)
    _assert_identical(results)
    assert results[0]["ticks"] > 0


def test_divergence_is_detected_a_hung_peer_times_out_a_missing_peer_fails() -> None:
    (div0, hung0), (div1, slept) = check_ranks(
        run_ranks(SCENARIOS, "diverge_then_hang", 2, timeout_s=60))
    # rank 1 served a fourth request: its tree has more nodes and tokens than rank 0's
    for r, msg in ((0, div0), (1, div1)):
        assert msg.startswith(f"rank {r}: ranks diverged at a tick (")
        assert "tree nodes" in msg and "device tokens" in msg
        assert "every rank must make the same cache calls in the same order" in msg
    assert slept == "slept"
    assert "failed" in hung0 and "all_reduce_min[2]@world" in hung0 and "Timed out" in hung0
    alone = check_ranks(run_ranks(SCENARIOS, "join_alone", 1, timeout_s=60))
    assert alone[0].startswith("rank 0/2 could not join 'tcp://127.0.0.1:")
    assert "1/2 clients joined" in alone[0]
