"""``asynccache replay --eviction-policy arc`` (asynccache/tree/arc.py): the built-in synthetic
workload runs and reports under it (L1 only, and through every tier with the KV of loaded pages
verified), its L1 hits stay under the optimum the same run reports, and a bad policy name is
refused with a message naming it."""

from __future__ import annotations

import json

import pytest

from asynccache import CacheConfig
from asynccache.cli import main
from asynccache.errors import ConfigError


def _replay(capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    argv = ["replay", "--json", "--progress", "off", "--limit", "150", "--eviction-policy",
            "arc", *extra]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_replay_runs_and_reports_under_arc(capsys) -> None:
    rep = _replay(capsys, "--device-tokens", "2k")
    assert rep["status"] == "complete" and rep["config"]["eviction_policy"] == "arc"
    hr = rep["hit_rate"]
    assert 0 < hr["device_blocks"] <= hr["optimum_l1_blocks"] <= hr["infinite_cache_bound_blocks"]


def test_arc_through_every_tier(tmp_path, capsys) -> None:
    rep = _replay(capsys, "--device-tokens", "2k", "--host-tokens", "8k", "--storage",
                  f"file://{tmp_path}/l3", "--clear-storage")
    assert rep["status"] == "complete" and rep["config"]["eviction_policy"] == "arc"
    assert rep["verified_tokens"] > 0
    hr = rep["hit_rate"]
    assert hr["device_blocks"] <= hr["optimum_l1_blocks"]


def test_bad_policy_name_is_refused_naming_it(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["replay", "--eviction-policy", "arc2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --eviction-policy: invalid choice: 'arc2'" in err and "'arc'" in err
    with pytest.raises(ConfigError, match="unknown eviction_policy 'ARC'"):
        CacheConfig(device_tokens=64, eviction_policy="ARC")
