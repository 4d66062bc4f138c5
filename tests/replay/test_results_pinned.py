"""The replay's counted results are those of the replay before its KV became per-prefix and
written in place (recorded with commit 59a86cb): how KV is generated and checked changes no
hit, block, byte or eviction count, and the verify mode changes only ``verified_tokens``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from asynccache.cli import main

SYNTHETIC = {
    "requests": 417, "completed": 417, "prompt_tokens": 1083854, "prompt_blocks": 67933,
    "reused_tokens": 551600, "computed_tokens": 532254, "evicted_device_tokens": 592352,
    "hits": {"device_tokens": 458720, "host_tokens": 92880, "storage_tokens": 0,
             "device_blocks": 28670, "host_blocks": 5805, "storage_blocks": 0},
    "bound_blocks": 0.8095, "optimum_blocks": 0.6272,
}


def _counts(rep: dict[str, Any]) -> dict[str, Any]:
    out = {k: rep[k] for k in SYNTHETIC if k in rep}
    out["bound_blocks"] = rep["hit_rate"]["infinite_cache_bound_blocks"]
    out["optimum_blocks"] = rep["hit_rate"]["optimum_l1_blocks"]
    return out


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["replay", "--json", "--progress", "off", *argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("argv, verified, moved", [
    ([], 92880, (13090816, 23777280)),  # the default: 256 B of KV per token
    (["--verify", "all", "--layers", "4", "--heads", "4", "--head-dim", "16"], 551600,
     (52363264, 95109120)),  # 1 KiB per token, device hits checked too
    (["--verify", "none"], 0, (13090816, 23777280)),
])
def test_the_synthetic_replay_counts_what_it_counted_before(argv, verified, moved, capsys):
    rep = _run(argv, capsys)
    assert _counts(rep) == SYNTHETIC
    assert rep["verified_tokens"] == verified
    assert (rep["moved"]["device_to_host_bytes"], rep["moved"]["host_to_device_bytes"]) == moved


def test_without_copies_the_bounds_are_counted_too(capsys):
    """With no host tier no copy is ever in flight, so the bounds' side work runs in batches
    and at the end: the same figures."""
    rep = _run(["--host-tokens", "0"], capsys)
    assert rep["hit_rate"]["infinite_cache_bound_blocks"] == SYNTHETIC["bound_blocks"]
    assert rep["hit_rate"]["optimum_l1_blocks"] == SYNTHETIC["optimum_blocks"]


def test_buffer_only_storage_counts_what_it_counted_before(tmp_path, capsys):
    rep = _run(["--storage", f"file://{tmp_path / 'l3'}", "--clear-storage", "--host-mode",
                "buffer_only", "--host-tokens", "64k"], capsys)
    assert rep["hits"] == {"device_tokens": 458720, "host_tokens": 0, "storage_tokens": 92304,
                           "device_blocks": 28670, "host_blocks": 0, "storage_blocks": 5769}
    assert (rep["reused_tokens"], rep["computed_tokens"], rep["verified_tokens"]) == (
        551024, 532830, 92304)
    assert rep["moved"] == {"device_to_host_bytes": 13090816, "host_to_device_bytes": 23629824,
                            "host_to_storage_bytes": 13090816,
                            "storage_to_host_bytes": 23629824}
