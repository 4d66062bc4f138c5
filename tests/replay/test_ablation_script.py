"""scripts/ablation_eviction.py: skips absent traces cleanly; its table says the change vs LRU;
a tiny run through the real engine agrees with a direct replay."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ablation_eviction.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ablation_eviction", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ablation_eviction"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_absent_traces_are_skipped(tmp_path, capsys) -> None:
    assert _script().main(["--traces", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "skipped mooncake conversation" in err and "no traces found" in err


def test_table_shows_the_change_against_lru() -> None:
    rows = [{"trace": "t", "capacity": 10, "policy": p, "hit_rate": h, "optimum": 0.5,
             "infinite": 0.6} for p, h in (("lru", 0.2), ("lru_credit", 0.25))]
    assert _script().table(rows, ["lru", "lru_credit"]).splitlines() == [
        "### t", "",
        "| policy | 10 blocks |",
        "|---|---:|",
        "| lru | 0.2000 |",
        "| lru_credit | 0.2500 (+25.0%) |",
        "| **optimum (Belady)** | 0.5000 (+150.0%) |",
        "| infinite cache | 0.6000 (+200.0%) |",
    ]


def test_a_tiny_mooncake_trace_through_the_engine(tmp_path) -> None:
    # Two requests sharing their first block (512-token pages), L1 of 4 blocks.
    mc = tmp_path / "mooncake"
    mc.mkdir()
    lines = [{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
             {"timestamp": 1, "input_length": 1100, "output_length": 1, "hash_ids": [1, 3, 4]}]
    (mc / "conversation_trace.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    mod = _script()
    spec = mod.TraceSpec("t", "mooncake", str(mc / "conversation_trace.jsonl"), 512, (4,))
    r = mod.run_one(spec, 4, "lru_credit")
    assert (r["hit_blocks"], r["prompt_blocks"], r["rejected"]) == (1, 5, 0)
    assert r["hit_rate"] == r["optimum"] == r["infinite"] == 0.2


def test_arc_and_an_arc_variant_through_the_engine(tmp_path) -> None:
    """``arc:ghosts=G:start=S`` runs arc with other settings (in the worker) under its own name."""
    mc = tmp_path / "mooncake"
    mc.mkdir()
    lines = [{"timestamp": i, "input_length": 1024, "output_length": 1, "hash_ids": h}
             for i, h in enumerate(([1, 2], [1, 3], [4, 5], [1, 2], [6, 7], [1, 3]))]
    (mc / "conversation_trace.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    mod = _script()
    spec = mod.TraceSpec("t", "mooncake", str(mc / "conversation_trace.jsonl"), 512, (4,))
    from asynccache.tree import arc

    try:
        r = mod.run_one(spec, 4, "arc")
        v = mod.run_one(spec, 4, "arc:ghosts=0.5:start=0.25")
        assert (arc.GHOSTS, arc.START) == (0.5, 0.25)
    finally:
        arc.GHOSTS, arc.START = 2.0, 0.5
    assert (r["policy"], v["policy"]) == ("arc", "arc:ghosts=0.5:start=0.25")
    assert r["prompt_blocks"] == v["prompt_blocks"] == 12 and r["rejected"] == 0
    assert r["hit_blocks"] > 0 and r["hit_rate"] <= r["optimum"]
