"""``asynccache replay --sweep``: every capacity is checked before anything replays, and without
an explicit L2 each point's L2 is four times that point's L1, as its note says (tests first)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.replay.cli_run import cli_rc


def _trace(tmp_path: Path) -> str:
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps({"timestamp": i, "input_length": 600, "output_length": 1,
                                     "hash_ids": [0, i]}) + "\n" for i in range(4)))
    return str(p)


def test_a_sweep_capacity_under_one_page_is_refused_before_replaying(tmp_path, capsys) -> None:
    rc = cli_rc(["replay", _trace(tmp_path), "--progress", "off", "--sweep", "128Ki,8"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert "--sweep capacities must hold at least one page (--page-size 16), got 8" in err


def test_sweep_sizes_l2_per_point_and_says_so(tmp_path, capsys) -> None:
    assert cli_rc(["replay", _trace(tmp_path), "--progress", "off", "--sweep", "1Ki,2Ki",
                "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for points in (out["sweep"], out["write_through"]):
        assert [(p["config"]["device_tokens"], p["config"]["host_tokens"]) for p in points] \
            == [(1024, 4096), (2048, 8192)]
    notes = [p["notes"] for p in out["sweep"]]
    assert ("sweep point: L1 holds 1,024 tokens and L2 four times the L1 asked for "
            "(4,096 tokens); --host-tokens / --host-bytes fix L2") in notes[0]
    assert ("sweep point: L1 holds 2,048 tokens and L2 four times the L1 asked for "
            "(8,192 tokens); --host-tokens / --host-bytes fix L2") in notes[1]
    assert not any("sized from the trace" in n for ns in notes for n in ns)


def test_sweep_table_gives_each_points_l2(tmp_path, capsys) -> None:
    assert cli_rc(["replay", _trace(tmp_path), "--progress", "off", "--sweep", "1Ki,2Ki"]) == 0
    out = capsys.readouterr().out
    rows = out.splitlines()
    assert rows[1].startswith("L1 / L2 capacity")
    assert rows[2].startswith("1Ki / 4Ki tokens") and rows[3].startswith("2Ki / 8Ki tokens")
    assert "note: L2 is four times each point's L1 (--host-tokens / --host-bytes fix L2)" in out
    assert "sweep point:" not in out


def test_sweep_keeps_an_explicit_l2(tmp_path, capsys) -> None:
    assert cli_rc(["replay", _trace(tmp_path), "--progress", "off", "--sweep", "1Ki,2Ki",
                "--host-tokens", "3Ki", "--json"]) == 0
    points = json.loads(capsys.readouterr().out)["sweep"]
    assert [p["config"]["host_tokens"] for p in points] == [3072, 3072]
    assert not any(n.startswith("sweep point") for p in points for n in p["notes"])
