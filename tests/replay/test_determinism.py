"""Replay results are a function of the trace and the options: the same command gives the same
hit figures every time, whatever the machine's speed, the storage's speed or how many requests
the engine could keep in flight; requests overlap in trace time only when compute is modelled;
storage writes complete at a defined trace time; a warm store is reported."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest

import asynccache.storage.factory as factory
from asynccache.cli import main

SYN = ["replay", "--limit", "150", "--json"]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _figures(rep: dict[str, Any]) -> dict[str, Any]:
    """Everything in a report but the wall-clock figures."""
    return {k: v for k, v in rep.items()
            if k not in ("wall_s", "requests_per_s", "tokens_per_s", "isolated_wall_s", "timing")}


class _SlowWrites:
    """A backend whose writes and reads take random, different times on every run."""

    def __init__(self, inner: Any, seed: int) -> None:
        self._inner = inner
        self._rng = random.Random(seed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def set_batch(self, keys: Any, buffers: Any) -> list[bool]:
        await asyncio.sleep(self._rng.uniform(0, 0.004))
        return list(await self._inner.set_batch(keys, buffers))

    async def exists_prefix(self, keys: Any) -> int:
        await asyncio.sleep(self._rng.uniform(0, 0.002))
        return int(await self._inner.exists_prefix(keys))


@pytest.fixture
def slow_storage(monkeypatch: pytest.MonkeyPatch) -> None:
    real = factory.open_backend
    seeds = iter(range(1000))

    async def slow_open(url: str, layout: Any, **kw: Any) -> Any:
        return _SlowWrites(await real(url, layout, **kw), next(seeds))

    monkeypatch.setattr(factory, "open_backend", slow_open)


def test_the_default_replay_gives_identical_figures_twice(capsys) -> None:
    first = _run(["replay", "--json"], capsys)
    second = _run(["replay", "--json"], capsys)
    assert _figures(first) == _figures(second)
    assert first["hit_rate"]["host_tokens"] > 0  # L2 in play: copy timing must not matter


def test_storage_replays_are_identical_and_do_not_depend_on_storage_speed(
        tmp_path, capsys, monkeypatch) -> None:
    argv = [*SYN, "--storage", f"file://{tmp_path / 'l3'}", "--clear-storage",
            "--host-tokens", "8k", "--write-policy", "write_through",
            "--prefetch-threshold", "16"]
    fast = _run(argv, capsys)
    assert fast["hit_rate"]["storage_tokens"] > 0
    again = _run(argv, capsys)
    real = factory.open_backend

    async def slow_open(url: str, layout: Any, **kw: Any) -> Any:
        return _SlowWrites(await real(url, layout, **kw), 7)

    monkeypatch.setattr(factory, "open_backend", slow_open)
    slow = _run(argv, capsys)
    assert _figures(fast) == _figures(again) == _figures(slow)


def test_cluster_result_is_identical_at_one_and_many_in_flight(tmp_path, capsys,
                                                              slow_storage) -> None:
    argv = [*SYN, "--instances", "3", "--storage", f"file://{tmp_path / 'l3'}",
            "--clear-storage", "--write-policy", "write_through", "--device-tokens", "8k",
            "--host-tokens", "8k", "--prefetch-threshold", "16"]
    one = _run([*argv, "--max-in-flight", "1"], capsys)
    many = _run([*argv, "--max-in-flight", "16"], capsys)
    assert one["storage_hit_rate"] > 0  # the instances do read each other's pages
    assert _figures(one) | {"model": None} == _figures(many) | {"model": None}
    assert one["overlapped_requests"] == many["overlapped_requests"] == 0
    # With modelled compute, requests overlap; the storage still answers at random speeds.
    overlap = [*argv, "--prefill-rate", "5000", "--max-in-flight", "4", "--skip-isolated"]
    a, b = _run(overlap, capsys), _run(overlap, capsys)
    assert a["overlapped_requests"] > 0 and a["storage_hit_rate"] > 0
    assert _figures(a) == _figures(b)


def test_modelled_compute_makes_requests_overlap_deterministically(capsys) -> None:
    argv = [*SYN, "--prefill-rate", "2000", "--host-tokens", "0"]
    a = _run([*argv, "--max-in-flight", "4"], capsys)
    b = _run([*argv, "--max-in-flight", "4"], capsys)
    assert _figures(a) == _figures(b)
    assert a["overlap"]["max_in_flight"] == 4 and a["overlap"]["overlapped_requests"] > 0
    one = _run([*argv, "--max-in-flight", "1"], capsys)
    assert one["overlap"]["max_in_flight"] == 1 and one["overlap"]["overlapped_requests"] == 0
    assert one["overlap"]["queued_requests"] > 0  # arrivals waited for the one slot
    # Requests running at once cannot reuse each other's unfinished prompts.
    assert a["hit_rate"]["device_tokens"] < one["hit_rate"]["device_tokens"]
    sequential = _run([*SYN, "--host-tokens", "0"], capsys)
    assert sequential["overlap"] == {"max_in_flight": 1, "overlapped_requests": 0,
                                     "queued_requests": 0}
    assert any("--max-in-flight has no effect" in n for n in sequential["notes"])


def test_a_write_bandwidth_delays_what_other_instances_read(tmp_path, capsys) -> None:
    argv = [*SYN, "--instances", "3", "--storage", f"file://{tmp_path / 'l3'}",
            "--clear-storage", "--write-policy", "write_through", "--device-tokens", "8k",
            "--host-tokens", "8k", "--prefetch-threshold", "16", "--skip-isolated"]
    instant = _run(argv, capsys)
    slow = _run([*argv, "--storage-write-bandwidth", "200KB/s"], capsys)
    again = _run([*argv, "--storage-write-bandwidth", "200KB/s"], capsys)
    assert _figures(slow) == _figures(again)
    assert slow["storage_hit_rate"] < instant["storage_hit_rate"]
    assert slow["model"]["storage_writes"].startswith("visible 195.3 KiB/s after")
    assert instant["model"]["storage_writes"] == "complete before the next request"


def test_a_warm_store_is_reported_and_the_bound_is_not_applicable(tmp_path, capsys) -> None:
    argv = [*SYN, "--storage", f"file://{tmp_path / 'l3'}", "--write-policy",
            "write_through", "--host-tokens", "8k", "--prefetch-threshold", "16"]
    cold = _run(argv, capsys)
    assert cold["storage_state"] == {"pages_at_start": 0, "pages_from_before": 0, "warm": False}
    assert cold["hit_rate"]["infinite_cache_bound_tokens"] is not None
    warm = _run(argv, capsys)
    state = warm["storage_state"]
    assert state["warm"] and state["pages_at_start"] > 0 and state["pages_from_before"] > 0
    assert warm["hit_rate"]["infinite_cache_bound_tokens"] is None
    assert warm["hit_rate"]["infinite_cache_bound_blocks"] is None
    assert warm["hit_rate"]["fraction_of_bound"] is None
    assert warm["hit_rate"]["total_tokens"] > cold["hit_rate"]["total_tokens"]
    assert any(n.startswith("WARNING: the storage was not empty") for n in warm["notes"])
    # The table says it too, and shows the bound as n/a.
    assert main([a for a in argv if a != "--json"]) == 0
    table = capsys.readouterr().out
    assert "WARNING: the storage was not empty" in table
    assert "infinite-cache bound (tokens / blocks)  n/a / n/a" in table
    # --clear-storage starts from an empty store: the cold figures again.
    cleared = _run([*argv, "--clear-storage"], capsys)
    assert cleared["hit_rate"] == cold["hit_rate"]
    assert not cleared["storage_state"]["warm"]


def test_a_warm_shared_store_is_reported_by_the_cluster(tmp_path, capsys) -> None:
    argv = [*SYN, "--instances", "2", "--storage", f"file://{tmp_path / 'l3'}",
            "--write-policy", "write_through", "--device-tokens", "8k", "--host-tokens", "8k",
            "--prefetch-threshold", "16", "--skip-isolated"]
    cold = _run(argv, capsys)
    assert cold["pooled_infinite_bound"] is not None
    warm = _run(argv, capsys)
    assert warm["storage_state"]["warm"] and warm["pooled_infinite_bound"] is None
    assert any("not empty" in n for n in warm["notes"])


def test_a_retried_admission_counts_its_verified_kv_once(capsys) -> None:
    """Requests overlap in a small L1: some admissions find the memory held by running requests,
    give up and retry after a finish; the KV they check is counted once, when they succeed."""
    rep = _run([*SYN, "--prefill-rate", "2000", "--max-in-flight", "4", "--device-tokens", "12k",
                "--host-tokens", "64k", "--write-policy", "write_through"], capsys)
    assert rep["overlap"]["queued_requests"] > 0 and rep["rejected"] == 0
    hits = rep["hits"]
    assert hits["host_tokens"] > 0
    assert rep["verified_tokens"] == hits["host_tokens"] + hits["storage_tokens"]


def test_a_full_store_evicts_the_same_pages_whatever_the_write_timing(tmp_path, capsys,
                                                                     monkeypatch) -> None:
    """A capacity-bound store evicts by recency, so the order in which concurrent writes land
    decides what survives: the replay hands them to the store one at a time, in the order
    the engine issued them."""
    real = factory.open_backend
    seeds = iter(range(1000))

    async def slow_open(url: str, layout: Any, **kw: Any) -> Any:
        return _SlowWrites(await real(url, layout, **kw), next(seeds))

    argv = ["replay", "--limit", "250", "--json", "--storage",
            f"file://{tmp_path / 'l3'}?capacity=600KiB", "--clear-storage",
            "--host-tokens", "4k", "--device-tokens", "8k", "--write-policy", "write_through",
            "--prefetch-threshold", "16", "--layers", "1", "--heads", "1", "--head-dim", "8"]
    fast = _run(argv, capsys)
    monkeypatch.setattr(factory, "open_backend", slow_open)
    runs = [_run(argv, capsys) for _ in range(3)]
    assert fast["hit_rate"]["storage_tokens"] > 0
    for r in runs:
        assert _figures(r) == _figures(fast)
