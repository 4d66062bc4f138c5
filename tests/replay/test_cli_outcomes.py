"""``asynccache replay`` throws no finished work away and refuses bad requests up front:
partial results after a malformed record or Ctrl-C, plot paths checked before replaying,
absurd sizes refused with a clear message, rejected requests reported apart, defaults sized
from the trace, progress bars, sweep and cluster output."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asynccache.cli import main
from tests.replay.cli_run import cli_rc

SUBPROCESS_TIMEOUT = 120  # a hang guard, not a performance assertion




def _mooncake_lines(n: int, bad_at: int | None = None) -> str:
    lines = []
    for i in range(n):
        obj = {"timestamp": i, "input_length": 1024, "output_length": 1, "hash_ids": [0, i + 1]}
        lines.append("{oops" if i == bad_at else json.dumps(obj))
    return "\n".join(lines) + "\n"


# -- partial results --------------------------------------------------------------------------


def test_a_malformed_line_late_in_a_trace_reports_the_result_up_to_it(tmp_path, capsys) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(_mooncake_lines(40, bad_at=30))
    assert cli_rc(["replay", str(p), "--json"]) == 2
    out, err = capsys.readouterr()
    rep = json.loads(out)
    assert rep["completed"] == 30 and rep["status"].startswith("partial")
    assert "t.jsonl:31: invalid JSON" in rep["status"]
    assert rep["hit_rate"]["device_tokens"] > 0  # every request shares block 0
    assert "t.jsonl:31: invalid JSON" in err and "--skip-bad-lines" in err
    assert "Traceback" not in err
    # The table says it too.
    assert cli_rc(["replay", str(p)]) == 2
    assert "PARTIAL RESULT" in capsys.readouterr().out


def test_skip_bad_lines_counts_them_and_goes_on(tmp_path, capsys) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(_mooncake_lines(40, bad_at=30))
    assert cli_rc(["replay", str(p), "--json", "--skip-bad-lines"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["status"] == "complete"
    assert rep["completed"] == 39 and rep["skipped_records"] == 1
    assert any("1 malformed trace records were skipped" in n for n in rep["notes"])


def test_a_malformed_first_line_is_an_error_without_a_report(tmp_path, capsys) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(_mooncake_lines(5, bad_at=0).replace("{oops", '{"timestamp": 0}'))
    assert cli_rc(["replay", str(p), "--format", "mooncake"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "t.jsonl:1: missing field 'input_length'" in err


def _paced_replay(extra: list[str]) -> subprocess.Popen[bytes]:
    # --time-scale paces the synthetic workload on the wall clock (about 20 s); the results do
    # not depend on it, it only keeps the replay running long enough to be interrupted.
    cmd = [sys.executable, "-m", "asynccache", "replay", "--time-scale", "1", "--progress", "on",
           *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, cwd="/")


def _wait_for_progress(proc: subprocess.Popen[bytes]) -> str:
    """Read stderr until the replay bar shows requests done."""
    seen = b""
    assert proc.stderr is not None
    fd = proc.stderr.fileno()
    os.set_blocking(fd, False)
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT
    while time.monotonic() < deadline:
        with contextlib.suppress(BlockingIOError):
            seen += os.read(fd, 1 << 16)
        text = seen.decode(errors="replace")
        if "replay:" in text and "req" in text and "hit " in text:
            os.set_blocking(fd, True)
            return text
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"no progress seen: {seen!r}")


def test_ctrl_c_prints_the_partial_report_without_a_traceback() -> None:
    proc = _paced_replay(["--json"])
    try:
        _wait_for_progress(proc)
        proc.send_signal(signal.SIGINT)
        out, err = (x.decode() for x in proc.communicate(timeout=SUBPROCESS_TIMEOUT))
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    rep = json.loads(out)
    assert rep["status"] == "partial: interrupted"
    assert 0 < rep["completed"] < 417
    assert "Traceback" not in err and "interrupted" in err


def test_a_second_ctrl_c_stops_at_once_without_a_traceback() -> None:
    proc = _paced_replay([])
    try:
        _wait_for_progress(proc)
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGINT)
        _, err = (x.decode() for x in proc.communicate(timeout=SUBPROCESS_TIMEOUT))
    finally:
        proc.kill()
    # 130 when the second one lands before the report is out, killed by SIGINT (-2) when it
    # lands while the interpreter exits: never a traceback
    assert proc.returncode in (130, -signal.SIGINT), err
    assert "Traceback" not in err


# -- refused up front ---------------------------------------------------------------------------


@pytest.mark.parametrize(("plot", "message"), [
    ("hit.xyz", "unknown image extension '.xyz'"),
    ("hit", "unknown image extension '(none)'"),
    ("missing/hit.png", "does not exist"),
    (".", "is a folder"),
])
def test_a_bad_plot_path_is_refused_before_replaying(tmp_path, capsys, plot, message) -> None:
    target = str(tmp_path / plot) if plot != "." else str(tmp_path)
    assert cli_rc(["replay", "--plot", target]) == 2
    out, err = capsys.readouterr()
    assert message in err and out == ""


@pytest.mark.parametrize(("argv", "message"), [
    (["--device-tokens", "1e12"], "more than this machine's"),
    (["--host-tokens", "1e11"], "more than this machine's"),
    (["--device-bytes", "1TiB"], "--device-bytes"),
    (["--device-tokens", "64k", "--device-bytes", "1MiB"],
     "argument --device-bytes: not allowed with argument --device-tokens"),
    (["--host-tokens", "64k", "--host-bytes", "1MiB"],
     "argument --host-bytes: not allowed with argument --host-tokens"),
    (["--device-tokens", "0"], "the device (L1) capacity must be > 0"),
    (["--storage", "file:///tmp/asynccache-tiny-l3?capacity=100"], "holds no page"),
    # room for the KV object (4,160 bytes) but not for the draft's beside it
    (["--draft-layers", "1", "--storage", "file:///tmp/asynccache-tiny-l3?capacity=4260"],
     "one page takes 6,272 bytes (16 tokens x 256 B of KV + a 64-byte header; sidecar "
     "'draft': 16 tokens x 128 B + a 64-byte header)"),
    (["--device", "cuda"], "CUDA is not available"),
    (["--sweep", "0,16k"], "--sweep capacities must be > 0"),
    (["--prefill-rate", "-1"], "--prefill-rate must be >= 0"),
    (["--storage-write-bandwidth", "0"], "--storage-write-bandwidth must be > 0"),
])
def test_absurd_values_are_refused_with_a_clear_message(capsys, argv, message) -> None:
    if argv[0] == "--device":
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    assert cli_rc(["replay", "--limit", "5", *argv]) == 2
    out, err = capsys.readouterr()
    assert message in err, err
    assert "Traceback" not in err and "numpy" not in err and out == ""


# -- sizing and rejected requests ---------------------------------------------------------------


def test_rejected_requests_are_reported_apart_with_the_fix(kvtester_samples, capsys) -> None:
    glob = str(kvtester_samples[0].parent / "trace_00*.json")
    assert main(["replay", glob, "--page-size", "64", "--device-tokens", "32k", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["rejected"] > 0 and rep["completed"] + rep["rejected"] == rep["requests"]
    assert rep["largest_rejected_tokens"] > 32_000
    note = next(n for n in rep["notes"] if "did not fit in the device pool" in n)
    assert "--device-tokens" in note and "left out of the hit rates" in note
    # Rejected prompts are not in the denominators.
    served = rep["prompt_tokens"]
    assert rep["reused_tokens"] + rep["computed_tokens"] == served
    assert rep["hit_rate"]["total_tokens"] == round(rep["reused_tokens"] / served, 4)


def test_defaults_are_sized_from_the_trace(kvtester_samples, capsys) -> None:
    """The README's kv-cache-tester example: nothing is rejected with default capacities."""
    glob = str(kvtester_samples[0].parent / "trace_00*.json")
    assert main(["replay", glob, "--page-size", "64", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["rejected"] == 0 and rep["completed"] == rep["requests"] == 24
    assert rep["hit_rate"]["total_tokens"] > 0.5
    assert rep["config"]["host_tokens"] == 4 * rep["config"]["device_tokens"]
    note = next(n for n in rep["notes"] if n.startswith("L1 sized from the trace"))
    assert f"L1 holds {rep['config']['device_tokens']:,} tokens" in note  # what it used
    # A trace whose prompts are all short keeps the 32Ki default, and the note says so.
    assert main(["replay", str(kvtester_samples[0].parent / "trace_0026.json"), "--page-size",
                 "64", "--limit", "1", "--json"]) == 0
    small = json.loads(capsys.readouterr().out)
    assert small["config"]["device_tokens"] == 32768
    assert any("L1 holds 32,768 tokens" in n for n in small["notes"])


# -- progress -----------------------------------------------------------------------------------


def test_progress_bar_on_request_and_quiet_otherwise() -> None:
    base = [sys.executable, "-m", "asynccache", "replay", "--limit", "60"]
    on = subprocess.run([*base, "--progress", "on"], capture_output=True, text=True,
                        timeout=SUBPROCESS_TIMEOUT, stdin=subprocess.DEVNULL, cwd="/")
    assert on.returncode == 0, on.stderr
    assert "60/60" in on.stderr and "req/s" in on.stderr and "hit " in on.stderr
    quiet = subprocess.run(base, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
                           stdin=subprocess.DEVNULL, cwd="/")
    assert quiet.returncode == 0 and quiet.stderr == ""  # stderr is not a terminal here


def test_loading_bar_for_conversations(tmp_path) -> None:
    for k in range(3):
        (tmp_path / f"c{k}.json").write_text(json.dumps({"id": f"c{k}", "requests": [
            {"t": 0, "in": 128, "hash_ids": [1, 2]}]}))
    proc = subprocess.run([sys.executable, "-m", "asynccache", "replay",
                           str(tmp_path / "c*.json"), "--page-size", "64", "--progress", "on"],
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
                          stdin=subprocess.DEVNULL, cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert "loading" in proc.stderr and "3 conversations" in proc.stderr
    assert "3/3" in proc.stderr


# -- sweep, plots, instances ---------------------------------------------------------------------


def test_sweep_shows_the_write_through_figure(capsys) -> None:
    assert main(["replay", "--limit", "80", "--sweep", "4k,16k", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [p["config"]["write_policy"] for p in rep["sweep"]] == ["write_through_selective"] * 2
    assert [p["config"]["write_policy"] for p in rep["write_through"]] == ["write_through"] * 2
    assert [p["config"]["device_tokens"] for p in rep["write_through"]] == [4000, 16000]
    for sel, wt in zip(rep["sweep"], rep["write_through"], strict=True):
        assert wt["hit_rate"]["host_tokens"] >= sel["hit_rate"]["host_tokens"]
    assert main(["replay", "--limit", "80", "--sweep", "4k,16k"]) == 0
    table = capsys.readouterr().out
    assert "all tiers, write_through" in table and "4k tokens" in table
    assert "second request has used it" in table


def test_sweep_plot_is_titled_by_trace_name_with_human_capacities(
        mooncake_conversation, tmp_path, monkeypatch) -> None:
    from asynccache.replay import plots

    seen = {}
    real = plots._pyplot

    def spy():
        plt = real()

        class Spy:
            def __getattr__(self, name):
                return getattr(plt, name)

            def close(self, fig):
                if not fig.axes:  # the figure that lists the image formats
                    plt.close(fig)
                    return
                ax = fig.axes[0]
                seen["title"] = ax.get_title()
                seen["ticks"] = [t.get_text() for t in ax.get_xticklabels()]
                seen["lines"] = [ln.get_label() for ln in ax.get_lines()]
                plt.close(fig)

        return Spy()

    monkeypatch.setattr(plots, "_pyplot", spy)
    png = tmp_path / "sweep.png"
    assert main(["replay", str(mooncake_conversation), "--limit", "30", "--page-size", "512",
                 "--layers", "1", "--heads", "1", "--head-dim", "2", "--sweep", "64Ki,256Ki",
                 "--host-tokens", "1Mi", "--verify", "none", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert seen["title"].startswith("conversation_trace.jsonl: ")
    assert str(mooncake_conversation.parent) not in seen["title"]
    assert seen["ticks"] == ["64Ki", "256Ki"]
    assert seen["lines"] == ["L1 device", "L1 + L2 = all tiers", "all tiers, write_through",
                             "infinite cache"]


def test_plot_without_sweep_draws_tier_bars(tmp_path) -> None:
    from asynccache.replay.plots import plot_tiers  # noqa: F401  (the function drawn)

    png = tmp_path / "bars.svg"
    assert main(["replay", "--limit", "30", "--plot", str(png)]) == 0
    assert b"<svg" in png.read_bytes()[:400]


def test_instances_table_reports_the_shared_storage_and_plots(tmp_path: Path,
                                                              capsys) -> None:
    url = f"file://{tmp_path / 'l3'}"
    png = tmp_path / "cluster.png"
    assert main(["replay", "--instances", "2", "--limit", "40", "--storage", url,
                 "--write-policy", "write_through", "--device-tokens", "16k",
                 "--host-tokens", "16k", "--prefetch-threshold", "16", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "no --storage" not in out
    assert "shared L3 hit rate" in out and "pooled / isolated" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
