"""A request that does not fit while others hold the device is aborted and admitted again later;
the KV its aborted attempt loaded from L2 (or fetched from L3) is still on the device then. It is
the request's L2 / L3 hit, not an L1 hit, and it is verified: the L1 hits never exceed the offline
optimum the report gives as their upper bound."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from asynccache.cli import main

A = list(range(100, 116))  # 4 pages of 4 tokens
ARGS = ["--page-size", "4", "--device-tokens", "64", "--write-policy", "write_through",
        "--prefill-rate", "100", "--json", "--progress", "off"]


def _trace(path: Path, records: list[tuple[float, list[int]]]) -> Path:
    path.write_text("".join(json.dumps({"t": t, "tokens": toks}) + "\n" for t, toks in records))
    return path


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _check(rep: dict[str, Any], *, host: int, storage: int) -> None:
    assert rep["completed"] == 4 and rep["rejected"] == 0
    assert rep["overlap"]["queued_requests"] == 1  # the last request waited (aborted once)
    assert rep["hits"] == {"device_tokens": 0, "host_tokens": host, "storage_tokens": storage,
                           "device_blocks": 0, "host_blocks": host // 4,
                           "storage_blocks": storage // 4}
    assert rep["verified_tokens"] == host + storage
    assert rep["hit_rate"]["device_tokens"] <= rep["hit_rate"]["optimum_l1_tokens"]


def test_kv_loaded_from_host_by_an_aborted_attempt_is_an_l2_hit_and_verified(
        tmp_path, capsys) -> None:
    # A is cached and backed up; B, then C (running until 2.4), push it off the device. D = A
    # + 28 tokens arrives at 2.1: it loads A back from the host, cannot extend while C holds
    # the device, and is admitted again when C finishes, A still on the device.
    p = _trace(tmp_path / "t.jsonl", [
        (0, A), (1, list(range(200, 248))), (2, list(range(300, 340))),
        (2.1, A + list(range(400, 428)))])
    rep = _run(["replay", str(p), *ARGS, "--host-tokens", "256"], capsys)
    _check(rep, host=16, storage=0)
    assert rep["moved"]["host_to_device_bytes"] == 16 * 256  # A, loaded once


def test_kv_fetched_from_storage_by_an_aborted_attempt_is_an_l3_hit_and_verified(
        tmp_path, capsys) -> None:
    # A is written to storage; B (the whole device) pushes it off the device, B's backup off
    # the host. D = A + 28 tokens arrives while C holds the device: it fetches A from storage,
    # loads it, cannot extend, and is admitted again when C finishes.
    p = _trace(tmp_path / "t.jsonl", [
        (0, A), (1, list(range(200, 264))), (2, list(range(300, 348))),
        (2.1, A + list(range(400, 428)))])
    rep = _run(["replay", str(p), *ARGS, "--host-tokens", "64", "--storage",
                f"file://{tmp_path / 'l3'}", "--clear-storage", "--prefetch-threshold", "4"],
               capsys)
    _check(rep, host=0, storage=16)
    assert rep["moved"]["storage_to_host_bytes"] == 16 * 256  # A, fetched once
