"""``asynccache replay``: the synthetic default, JSON and table output, plots, storage URLs and
clear errors (exit code 2) for bad flags and values."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from asynccache.cli import main
from asynccache.replay.synthetic import SyntheticSpec, synthetic_trace
from tests.replay.cli_run import cli_rc

SUBPROCESS_TIMEOUT = 120  # a hang guard, not a performance assertion

REPORT_KEYS = {
    "trace", "status", "config", "model", "requests", "completed", "rejected", "rejected_tokens",
    "largest_rejected_tokens", "skipped_records", "prompt_tokens", "prompt_blocks",
    "reused_tokens", "computed_tokens", "hits", "hit_rate", "overlap", "moved", "evicted_device_tokens",
    "dropped_tokens", "verified_tokens", "verified_draft_bytes", "wall_s", "requests_per_s", "tokens_per_s", "timing",
    "notes",
}
TIMING_KEYS = {"setup_s", "kv_ids_s", "kv_write_s", "kv_verify_s", "optimum_s", "copy_s",
               "copy_fraction"}
HIT_RATE_KEYS = {
    "device_tokens", "host_tokens", "storage_tokens", "total_tokens", "device_blocks",
    "host_blocks", "storage_blocks", "total_blocks", "infinite_cache_bound_tokens",
    "infinite_cache_bound_blocks", "fraction_of_bound", "optimum_l1_tokens", "optimum_l1_blocks",
}
MOVED_KEYS = {"device_to_host_bytes", "host_to_device_bytes", "host_to_storage_bytes",
              "storage_to_host_bytes"}
TABLE_ROWS = ["trace", "status", "requests served / rejected", "prompt tokens / blocks",
              "reused / computed tokens", "capacity L1 / L2 (tokens)",
              "hit rate L1 device (tokens / blocks)", "hit rate L2 host (tokens / blocks)",
              "hit rate L3 storage (tokens / blocks)", "hit rate total (tokens / blocks)",
              "infinite-cache bound (tokens / blocks)", "fraction of the bound reached",
              "L1 optimum, Belady (tokens / blocks)",
              "requests in flight (max / overlapped)", "bytes D->H / H->D",
              "bytes H->L3 / L3->H", "evicted device tokens", "verified KV tokens", "wall time",
              "time: setup, KV write, verify, copy", "throughput"]




def _synthetic_totals(seed: int = 0, limit: int | None = None) -> tuple[int, int]:
    reqs = list(synthetic_trace(SyntheticSpec(seed=seed)))[:limit]
    return len(reqs), sum(len(r) for r in reqs)


def _check_report(rep: dict, *, requests: int, prompt_tokens: int, cold: bool = True,
                  page_size: int = 16) -> None:
    assert set(rep) - {"storage_state"} == REPORT_KEYS
    assert set(rep["hit_rate"]) == HIT_RATE_KEYS
    assert set(rep["moved"]) == MOVED_KEYS
    assert rep["status"] == "complete"
    assert rep["requests"] == rep["completed"] == requests
    assert rep["rejected"] == 0
    assert rep["prompt_tokens"] == prompt_tokens
    assert rep["reused_tokens"] + rep["computed_tokens"] == prompt_tokens
    hr = rep["hit_rate"]
    assert hr["total_tokens"] == round(rep["reused_tokens"] / prompt_tokens, 4)
    for k in HIT_RATE_KEYS - {"fraction_of_bound"}:
        assert hr[k] is None or 0.0 <= hr[k] <= 1.0, (k, hr[k])
    if cold:  # the bound is the trace's own, from empty tiers
        assert hr["device_blocks"] <= hr["optimum_l1_blocks"] <= hr["infinite_cache_bound_blocks"]
        assert hr["total_tokens"] <= hr["infinite_cache_bound_tokens"]
        assert hr["total_blocks"] <= hr["infinite_cache_bound_blocks"]
    else:  # a warm store can beat the trace's own bound: it is not applicable
        assert rep["storage_state"]["warm"]
        assert hr["infinite_cache_bound_tokens"] is hr["fraction_of_bound"] is None
        assert hr["optimum_l1_blocks"] is None
    assert rep["verified_tokens"] >= 0 and rep["wall_s"] >= 0
    tm = rep["timing"]
    assert set(tm) == TIMING_KEYS and min(tm.values()) >= 0 and tm["copy_fraction"] <= 1


def test_default_is_the_synthetic_workload(capsys) -> None:
    assert main(["replay"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.strip()]
    assert [line.split("  ")[0] for line in lines if not line.startswith("note:")] == TABLE_ROWS
    requests, _ = _synthetic_totals()
    assert f"{requests} / 0 (of {requests} read)" in out


def test_json_report_has_the_documented_keys(capsys) -> None:
    assert main(["replay", "--json", "--host-tokens", "0", "--device-tokens", "64k"]) == 0
    rep = json.loads(capsys.readouterr().out)
    requests, prompt = _synthetic_totals()
    _check_report(rep, requests=requests, prompt_tokens=prompt)
    assert rep["trace"] == "synthetic"
    assert rep["config"] == {"page_size": 16, "device_tokens": 64000, "host_tokens": 0,
                             "host_mode": "cache",
                             "storage": None, "write_policy": "write_through_selective",
                             "eviction_policy": "lru", "optimum_capacity_blocks": 4000,
                             "kv_shape": [2, 2, 16, "float16"], "eagle": False,
                             "draft_kv_shape": None, "device": "cpu"}
    # L1 only: nothing from host or storage, nothing moved between tiers.
    assert rep["hit_rate"]["host_tokens"] == rep["hit_rate"]["storage_tokens"] == 0.0
    assert set(rep["moved"].values()) == {0}
    assert rep["timing"]["copy_s"] == rep["timing"]["copy_fraction"] == 0  # no copy engine


def test_console_script_runs_the_default(tmp_path) -> None:
    exe = shutil.which("asynccache")
    cmd = [exe, "replay"] if exe else [sys.executable, "-m", "asynccache.cli", "replay"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
                          cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert "hit rate total (tokens / blocks)" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_plot_writes_a_png(tmp_path, capsys) -> None:
    png = tmp_path / "hit.png"
    assert main(["replay", "--limit", "40", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sweep_png = tmp_path / "sweep.png"
    capsys.readouterr()
    assert main(["replay", "--limit", "40", "--sweep", "4k,16k", "--json",
                 "--plot", str(sweep_png)]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [p["config"]["device_tokens"] for p in rep["sweep"]] == [4000, 16000]
    requests, prompt = _synthetic_totals(limit=40)
    for p in rep["sweep"]:
        _check_report(p, requests=requests, prompt_tokens=prompt)
    assert sweep_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_names_the_extra_before_replaying(tmp_path, capsys,
                                                                  monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    png = tmp_path / "hit.png"
    assert cli_rc(["replay", "--limit", "40", "--plot", str(png)]) == 2
    out, err = capsys.readouterr()
    assert "--plot needs matplotlib" in err
    assert "pip install 'asynccache[plot]'" in err
    assert out == "" and not png.exists()  # refused at option parsing: nothing was replayed


def test_log_level_and_json_log_format(tmp_path) -> None:
    cmd = [sys.executable, "-m", "asynccache.cli", "replay", "--limit", "20", "--json",
           "--log-level", "debug", "--log-format", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
                          cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    json.loads(proc.stdout)  # the report alone on stdout: events go to stderr
    # (other lines, such as a Python warning from a dependency, are not log events)
    events = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    started = [e for e in events if e["event"] == "engine_started"]
    assert started and started[0]["logger"] == "asynccache.transfers.engine"
    assert started[0]["level"] == "debug" and "timestamp" in started[0]

    cmd[cmd.index("json", cmd.index("--log-format"))] = "console"
    cmd[cmd.index("debug")] = "warning"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
                          cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert "engine_started" not in proc.stderr


def test_file_storage_url(tmp_path, capsys) -> None:
    url = f"file://{tmp_path / 'l3'}"
    argv = ["replay", "--limit", "60", "--json", "--storage", url, "--write-policy",
            "write_through", "--prefetch-policy", "wait_complete", "--prefetch-threshold", "16"]
    requests, prompt = _synthetic_totals(limit=60)
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    _check_report(first, requests=requests, prompt_tokens=prompt)
    assert first["config"]["storage"] == url
    assert first["moved"]["host_to_storage_bytes"] > 0
    assert any((tmp_path / "l3").rglob("*.kv"))

    assert main(argv) == 0  # a new process-level cache, same store
    second = json.loads(capsys.readouterr().out)
    _check_report(second, requests=requests, prompt_tokens=prompt, cold=False)
    assert second["hit_rate"]["storage_tokens"] > 0
    assert second["moved"]["storage_to_host_bytes"] > 0
    assert second["verified_tokens"] > 0  # what came from storage was checked


def test_buffer_only_host_mode(tmp_path, capsys) -> None:
    url = f"file://{tmp_path / 'l3'}"
    argv = ["replay", "--limit", "60", "--json", "--storage", url, "--host-mode", "buffer_only",
            "--write-policy", "write_through", "--prefetch-policy", "wait_complete",
            "--prefetch-threshold", "16"]
    requests, prompt = _synthetic_totals(limit=60)
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    _check_report(first, requests=requests, prompt_tokens=prompt)
    assert first["config"]["host_mode"] == "buffer_only"
    assert first["moved"]["host_to_storage_bytes"] > 0
    assert main(argv) == 0  # a new cache on the same store: reads through host staging
    second = json.loads(capsys.readouterr().out)
    _check_report(second, requests=requests, prompt_tokens=prompt, cold=False)
    assert second["hit_rate"]["storage_tokens"] > 0
    assert second["verified_tokens"] > 0


def _bad_trace(tmp: Path) -> Path:
    p = tmp / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n'
                 '{"timestamp": 0, "input_length": 1, "output_length": 1}\n')
    return p


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "required"),
        (["replay", "--bogus"], "unrecognized arguments: --bogus"),
        (["replay", "--device-tokens", "abc"], "argument --device-tokens: bad size 'abc'"),
        (["replay", "--host-tokens", "-5"], "argument --host-tokens: bad size '-5'"),
        (["replay", "--max-in-flight", "0"], "--max-in-flight must be >= 1, got 0"),
        (["replay", "--prefetch-policy", "soon"], "argument --prefetch-policy: invalid choice"),
        (["replay", "--format", "csv"], "argument --format: invalid choice"),
        (["replay", "--host-mode", "l2"], "argument --host-mode: invalid choice"),
        (["replay", "--host-mode", "buffer_only", "--host-tokens", "0"],
         "set host_tokens or host_bytes"),
        (["replay", "--verify", "some"], "argument --verify: invalid choice"),
        (["replay", "--page-size", "x"], "argument --page-size: invalid int value"),
        (["replay", "--page-size", "0"], "page_size must be > 0, got 0"),
        (["replay", "--layers", "0"], "num_layers must be > 0, got 0"),
        (["replay", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (["replay", "--write-policy", "nope"], "argument --write-policy: invalid choice: 'nope'"),
        (["replay", "--eviction-policy", "random"],
         "argument --eviction-policy: invalid choice: 'random'"),
        (["replay", "--prefetch-threshold", "-1"], "--prefetch-threshold must be >= 0"),
        (["replay", "--storage", "ftp://x/y"], "unsupported storage URL scheme"),
        (["replay", "--storage", "file://relative/dir"], "must be file:///absolute/path"),
        (["replay", "--storage", "file:///tmp/l3?speed=9"], "unknown parameter 'speed'"),
        (["replay", "MISSING"], "cannot read trace"),
        (["replay", "BAD"], "bad.jsonl:2: missing field 'hash_ids'"),
        (["replay", "BAD", "--format", "kvtester"], "bad.jsonl: invalid JSON"),
        (["replay", "--log-level", "loud"], "argument --log-level: invalid choice: 'LOUD'"),
        (["replay", "--log-format", "xml"], "argument --log-format: invalid choice"),
    ],
)
def test_bad_flags_and_values_exit_2_with_a_clear_message(tmp_path, capsys, argv,
                                                          message) -> None:
    argv = [str(tmp_path / "absent.jsonl") if a == "MISSING" else
            str(_bad_trace(tmp_path)) if a == "BAD" else a for a in argv]
    assert cli_rc(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", [
    ["replay", "--device-tokens", "1e400"],
    ["replay", "--seed", "-1", "--limit", "5"],
    ["replay", "--limit", "-1"],
    ["replay", "--time-scale", "-1", "--limit", "5"],
])
def test_nonsense_numbers_exit_2(argv) -> None:
    assert cli_rc(argv) == 2


def test_non_utf8_trace_exits_2(tmp_path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_bytes(b'{"tokens": [1, 2]}\n\xff\xfe\n')
    assert cli_rc(["replay", str(p)]) == 2
