"""``replay --instances N``: N real caches, routed requests, one shared L3 (a directory)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from asynccache.cli import main
from asynccache.config import CacheConfig
from asynccache.errors import ConfigError
from asynccache.l3 import StoragePolicy
from asynccache.replay.cluster import ClusterReplayer, cluster_report, route_of
from asynccache.replay.driver import ReplayOptions
from asynccache.replay.formats import TraceRequest

PS = 16


def _trace() -> list[TraceRequest]:
    """A (64 tokens), B = A + 32 tokens, C = A + 32 other tokens."""
    rng = np.random.default_rng(5)
    doc = rng.integers(0, 50_000, size=64).astype(np.uint32)
    tails = [rng.integers(0, 50_000, size=32).astype(np.uint32) for _ in range(2)]
    return [TraceRequest("a", 0.0, doc),
            TraceRequest("b", 0.0, np.concatenate([doc, tails[0]])),
            TraceRequest("c", 0.0, np.concatenate([doc, tails[1]]))]


def _config() -> CacheConfig:
    return CacheConfig(page_size=PS, num_layers=1, num_heads=1, head_dim=8, device_tokens=1024,
                       host_tokens=1024, write_policy="write_through", load_back_threshold=1)


def _replayer(storage: str | None, route: str = "round_robin") -> ClusterReplayer:
    opts = ReplayOptions(storage_url=storage, verify="all",
                         storage_policy=StoragePolicy(prefetch_threshold=PS,
                                                      prefetch_policy="wait_complete"))
    return ClusterReplayer(_config(), opts, instances=2, route=route, route_tokens=64)


async def test_pooled_instances_fetch_each_others_pages(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'l3'}"
    pooled = await _replayer(url).run(_trace())
    isolated = await _replayer(None).run(_trace())
    a, b = pooled.instances  # round robin: a -> 0, b -> 1, c -> 0
    assert (a.completed, b.completed) == (2, 1)
    assert (a.prompt_tokens, b.prompt_tokens) == (160, 96)
    assert (a.device_hit_tokens, a.storage_hit_tokens) == (64, 0)  # c hits a's pages locally
    assert (b.device_hit_tokens, b.host_hit_tokens, b.storage_hit_tokens) == (0, 0, 64)
    assert b.verified_tokens == 64  # the pages fetched from the shared tier, bit for bit
    assert [s.storage_hit_tokens for s in isolated.instances] == [0, 0]
    report = cluster_report(pooled, isolated, _config(), "test", url)
    assert report["local_hit_rate"] == 0.25 and report["storage_hit_rate"] == 0.25
    assert report["global_hit_rate"] == 0.5
    assert report["isolated_hit_rate"] == 0.25
    assert report["pooled_vs_isolated"] == 2.0
    assert [p["local_hit_rate"] for p in report["per_instance"]] == [0.4, 0.0]
    assert [p["global_hit_rate"] for p in report["per_instance"]] == [0.4, round(64 / 96, 4)]
    assert report["pooled_infinite_bound"] == 0.5 and report["per_node_infinite_bound"] == 0.25


async def test_prefix_hash_routing_keeps_a_prefix_on_one_instance(tmp_path: Path) -> None:
    trace = _trace()
    homes = {route_of(r, i, 2, "prefix_hash", 64) for i, r in enumerate(trace)}
    assert len(homes) == 1
    stats = await _replayer(f"file://{tmp_path / 'l3'}", "prefix_hash").run(trace)
    home = homes.pop()
    s = stats.instances[home]
    assert s.completed == 3 and stats.instances[1 - home].completed == 0
    assert (s.device_hit_tokens, s.storage_hit_tokens) == (128, 0)
    assert [route_of(r, i, 3, "round_robin", 64) for i, r in enumerate(trace)] == [0, 1, 2]


def test_cluster_rejects_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="instances must be an int >= 1, got 0"):
        ClusterReplayer(_config(), instances=0)
    with pytest.raises(ConfigError, match="unknown route 'random'"):
        ClusterReplayer(_config(), route="random")


def test_cli_instances_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"file://{tmp_path / 'l3'}"
    rc = main(["replay", "--instances", "3", "--route", "prefix_hash", "--limit", "40",
               "--storage", url, "--write-policy", "write_through", "--device-tokens", "16384",
               "--host-tokens", "16384", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert r["instances"] == 3 and r["route"] == "prefix_hash" and r["requests"] == 40
    assert sum(p["requests"] for p in r["per_instance"]) == 40
    assert sum(p["prompt_tokens"] for p in r["per_instance"]) == r["prompt_tokens"]
    assert abs(r["global_hit_rate"] - r["local_hit_rate"] - r["storage_hit_rate"]) < 2e-4
    assert "isolated_hit_rate" in r and "pooled_vs_isolated" in r


def test_cli_instances_report_the_kv_and_draft_bytes_they_verified(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"file://{tmp_path / 'l3'}"
    argv = ["replay", "--instances", "2", "--limit", "40", "--storage", url,
            "--write-policy", "write_through", "--device-tokens", "16384", "--json"]
    assert main([*argv, "--draft-layers", "1"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["verified_tokens"] == sum(p["verified_tokens"] for p in r["per_instance"]) > 0
    # the draft (1 layer, K and V, 2 heads of 16, fp16) is checked wherever the KV is
    assert r["verified_draft_bytes"] == r["verified_tokens"] * (1 * 2 * 2 * 16 * 2)
    assert main([*argv[:-1], "--draft-layers", "1", "--clear-storage"]) == 0
    table = capsys.readouterr().out
    assert "verified KV tokens" in table and "verified draft KV bytes" in table


def test_cli_instances_without_storage_say_they_share_nothing(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--instances", "2", "--limit", "20"]) == 0
    out = capsys.readouterr().out
    assert "shared L3 hit rate" in out and "no --storage: the instances share nothing" in out
    assert "pooled / isolated" not in out


def test_cli_rejects_bad_instances(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["replay", "--instances", "0"])
    assert "--instances must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["replay", "--instances", "2", "--sweep", "100,200"])
    assert "--instances and --sweep cannot be combined" in capsys.readouterr().err
