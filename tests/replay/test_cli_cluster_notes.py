"""``asynccache replay --instances N`` gives the notes the single-instance report gives: skipped
malformed records, L1 sized from the trace, EAGLE keys (tests first)."""

from __future__ import annotations

import json
from pathlib import Path

from asynccache.cli import main


def _trace(tmp_path: Path) -> str:
    p = tmp_path / "t.jsonl"
    rows = [json.dumps({"timestamp": i, "input_length": 600, "output_length": 1,
                        "hash_ids": [0, i]}) for i in range(4)]
    rows.insert(2, "{oops")
    p.write_text("\n".join(rows) + "\n")
    return str(p)


def _reports(tmp_path: Path, capsys, extra: list[str]) -> tuple[dict, dict]:
    out = []
    for n in ("1", "2"):
        assert main(["replay", _trace(tmp_path), "--progress", "off", "--skip-bad-lines",
                     "--json", "--instances", n, *extra]) == 0
        out.append(json.loads(capsys.readouterr().out))
    return out[0], out[1]


def test_instances_report_skipped_records_and_auto_sizing(tmp_path, capsys) -> None:
    single, cluster = _reports(tmp_path, capsys, [])
    assert cluster["skipped_records"] == single["skipped_records"] == 1
    skipped = "1 malformed trace records were skipped (--skip-bad-lines)"
    assert skipped in single["notes"] and skipped in cluster["notes"]
    auto = next(n for n in single["notes"] if n.startswith("L1 sized from the trace"))
    assert auto.startswith("L1 sized from the trace: its longest prompt has 600 tokens, so L1 "
                           "holds 32,768 tokens")
    assert auto in cluster["notes"]


def test_instances_report_the_eagle_note(tmp_path, capsys) -> None:
    single, cluster = _reports(tmp_path, capsys, ["--eagle"])
    eagle = next(n for n in single["notes"] if n.startswith("EAGLE keys"))
    assert eagle in cluster["notes"]
    assert cluster["config"]["eagle"] is True
