"""The report's L1 / L2 capacities are what the pools hold (whole pages), whether the sizes
come in tokens or in bytes, for one instance and for several (tests first)."""

from __future__ import annotations

import json
from pathlib import Path

from asynccache.cli import main

# Default KV shape: 2 layers x (K, V) x 2 heads x 16 dims x 2 bytes = 256 B per token;
# a page of 16 tokens is 4 KiB.


def _trace(tmp_path: Path) -> str:
    """Three Mooncake requests; the second (600 tokens) does not fit in a 256-token L1."""
    p = tmp_path / "t.jsonl"
    rows = [(0, 100, [0]), (1, 600, [0, 1]), (2, 100, [0])]
    p.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 1,
                                     "hash_ids": h}) + "\n" for t, n, h in rows))
    return str(p)


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:
    rc = main(["replay", *argv, "--progress", "off"])
    out, err = capsys.readouterr()
    return rc, out, err


def test_device_bytes_reports_the_pools_tokens_and_the_rejected_note(tmp_path, capsys) -> None:
    rc, out, err = _run(capsys, [_trace(tmp_path), "--device-bytes", "64KiB", "--json"])
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["config"]["device_tokens"] == 256  # 64 KiB / 4 KiB pages = 16 pages
    assert rep["config"]["host_tokens"] == 1024  # four times L1
    assert rep["rejected"] == 1
    assert ("1 requests (600 tokens) did not fit in the device pool (256 tokens) and are left "
            "out of the hit rates") in "\n".join(rep["notes"])
    assert any(n.startswith("L2 admission is write_through_selective") for n in rep["notes"])


def test_device_bytes_table_shows_the_capacities(tmp_path, capsys) -> None:
    rc, out, err = _run(capsys, [_trace(tmp_path), "--device-bytes", "64KiB"])
    assert rc == 0, err
    row = next(line for line in out.splitlines() if line.startswith("capacity L1 / L2"))
    assert row.split("  ")[-1].strip() == "256 / 1Ki"


def test_host_bytes_reports_the_host_pools_tokens(tmp_path, capsys) -> None:
    rc, out, err = _run(capsys, [_trace(tmp_path), "--device-tokens", "1k", "--host-bytes",
                                 "130KiB", "--json"])
    assert rc == 0, err
    cfg = json.loads(out)["config"]
    # 1,000 tokens -> 62 pages; 130 KiB -> 32 whole pages of 4 KiB
    assert (cfg["device_tokens"], cfg["host_tokens"]) == (992, 512)


def test_device_tokens_are_reported_as_the_whole_pages_the_pool_holds(tmp_path, capsys) -> None:
    rc, out, err = _run(capsys, [_trace(tmp_path), "--device-tokens", "1000", "--page-size",
                                 "64", "--json"])
    assert rc == 0, err
    cfg = json.loads(out)["config"]
    assert cfg["device_tokens"] == 960  # 15 pages of 64
    assert cfg["host_tokens"] == 3968  # 4,000 requested: 62 pages of 64
    assert cfg["optimum_capacity_blocks"] == 15


def test_instances_with_device_bytes_report_the_pools_and_the_rejected(tmp_path, capsys) -> None:
    rc, out, err = _run(capsys, [_trace(tmp_path), "--instances", "2", "--device-bytes",
                                 "64KiB", "--json"])
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["config"]["device_tokens_per_instance"] == 256
    assert rep["config"]["host_tokens_per_instance"] == 1024
    assert rep["rejected"] == 1
    assert ("1 requests did not fit in an instance's device pool (256 tokens) and are left out "
            "of the hit rates") in rep["notes"]


def test_instances_table_shows_each_instances_capacities(tmp_path, capsys) -> None:
    rc, out, err = _run(capsys, [_trace(tmp_path), "--instances", "2", "--device-tokens",
                                 "1000", "--host-tokens", "2000"])
    assert rc == 0, err
    # whole pages of 16 tokens: 992 of the 1,000 asked, 2,000 exactly
    assert "capacity L1 / L2 per instance (tokens)  992 / 2k" in out
