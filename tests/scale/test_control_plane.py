"""The cache's control plane on its own gloo group (issue 27 item 4): real spawned gloo ranks.

Serving engines run the model's collectives (NCCL on GPUs) on the default process group or
their own communicators. The cache's ticks must not pair up with them, must not depend on the
calling thread's CUDA device, and a peer that stops answering must raise RankGroupError
instead of tearing the process down (NCCL's watchdog does that): so the cache's collectives run
on a dedicated gloo group (CPU tensors, gloo timeouts raise), whatever the model uses.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from asynccache.testing.ranks import check_ranks, run_ranks

SCENARIOS = Path(__file__).with_name("control_plane_scenarios.py")


def test_cache_collectives_do_not_pair_with_the_models() -> None:
    results = check_ranks(run_ranks(SCENARIOS, "interleaved", 2, timeout_s=90))
    for r in results:
        assert r["control_backend"] == "gloo" and r["device"] == "cpu"
        assert r["model"] == 1000 + 2000, r  # the model's SUM saw only model values
        assert r["cache"] == ([10], [11]), r  # the cache's MIN / MAX saw only cache values


def test_a_timeout_raises_and_the_process_lives_on() -> None:
    alive, slept = check_ranks(run_ranks(SCENARIOS, "timeout_is_an_error", 2, timeout_s=60))
    assert slept == "slept"
    assert alive.startswith("raised (default group alive: True): rank 0/2: collective #1")
    assert "Timed out" in alive or "timed out" in alive


def test_control_backend_is_checked() -> None:
    from asynccache.errors import ConfigError
    from asynccache.ranks import TorchRankGroup

    with pytest.raises(ConfigError, match="control_backend must be 'gloo' or 'default'"):
        TorchRankGroup.create(0, 1, "tcp://127.0.0.1:1", control_backend="nccl")
