"""``asynccache replay --plot``: a chart that cannot be written here is refused before replaying
(a format whose backend cannot render, a path that cannot be created), and a chart that fails
after the replay never loses the report (tests first)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.replay.cli_run import cli_rc


def _trace(tmp_path: Path) -> str:
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps({"timestamp": i, "input_length": 100, "output_length": 1,
                                     "hash_ids": [0]}) + "\n" for i in range(3)))
    return str(p)


@pytest.mark.skipif(shutil.which("xelatex") is not None, reason="xelatex renders .pgf here")
def test_pgf_without_latex_is_refused_before_replaying(tmp_path, capsys) -> None:
    target = tmp_path / "out.pgf"
    assert cli_rc(["replay", _trace(tmp_path), "--progress", "off", "--plot", str(target)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert f"--plot {str(target)!r}: this machine cannot write .pgf charts" in err
    assert "'xelatex' not found" in err
    assert "Traceback" not in err and not target.exists()


def test_an_uncreatable_plot_file_is_refused_before_replaying(tmp_path, capsys) -> None:
    # /proc refuses new files, even to root (for whom os.access says yes)
    assert cli_rc(["replay", _trace(tmp_path), "--progress", "off", "--plot", "/proc/x.png"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "asynccache: error: --plot '/proc/x.png': not writable" in err


def test_unknown_extension_lists_only_formats_this_machine_can_write(tmp_path, capsys) -> None:
    assert cli_rc(["replay", "--plot", str(tmp_path / "hit.xyz")]) == 2
    err = capsys.readouterr().err
    assert ".png" in err and ".svg" in err and ".pdf" in err
    if shutil.which("xelatex") is None:
        assert ".pgf" not in err


def test_checking_leaves_no_file_behind(tmp_path, capsys) -> None:
    from asynccache.replay.plots import check_plot_path

    check_plot_path(str(tmp_path / "hit.png"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [[], ["--instances", "2"], ["--sweep", "1k,2k"]])
def test_a_chart_failing_after_the_replay_still_prints_the_report(tmp_path, capsys, monkeypatch,
                                                                   argv) -> None:
    import asynccache.replay.plots as plots

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("renderer exploded")

    for name in ("plot_tiers", "plot_cluster", "plot_sweep"):
        monkeypatch.setattr(plots, name, fail)
    target = tmp_path / "hit.png"
    rc = cli_rc(["replay", _trace(tmp_path), "--progress", "off", "--json", "--plot", str(target),
              *argv])
    out, err = capsys.readouterr()
    assert rc == 2
    json.loads(out)  # the whole report, printed before the chart was tried
    assert (f"asynccache: error: --plot {str(target)!r}: the chart could not be written "
            "(RuntimeError: renderer exploded); the report above is complete") in err
    assert "Traceback" not in err
