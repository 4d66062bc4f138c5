"""The command line's surface: ``--version``, ``python -m asynccache``, help that imports no
torch, every option's default and choices, examples that parse, choices equal to the engine's."""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

import pytest

import asynccache
from asynccache import cli

TIMEOUT = 120  # a hang guard, not a performance assertion


def _replay_parser() -> argparse.ArgumentParser:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["replay"]


def test_version_and_python_dash_m() -> None:
    for cmd in ([sys.executable, "-m", "asynccache", "--version"],
                [sys.executable, "-m", "asynccache.cli", "--version"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, cwd="/")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == f"asynccache {asynccache.__version__}"


def test_help_imports_neither_torch_nor_numpy() -> None:
    code = ("import sys, contextlib, io\n"
            "from asynccache.cli import main\n"
            "for argv in (['--help'], ['replay', '--help'], ['--version']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "        main(argv)\n"
            "print(sorted(m for m in ('torch', 'numpy', 'structlog', 'matplotlib')"
            " if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=TIMEOUT, cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    help_ = subprocess.run([sys.executable, "-m", "asynccache", "replay", "--help"],
                           capture_output=True, text=True, timeout=TIMEOUT, cwd="/")
    assert help_.returncode == 0 and "examples:" in help_.stdout


def test_every_option_shows_its_default_and_choices() -> None:
    parser = _replay_parser()
    text = parser.format_help()
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        fmt = parser._get_formatter()
        help_ = fmt._get_help_string(action) % {"default": action.default}
        assert "default" in help_, action.option_strings
        if action.choices:
            assert "{" + ",".join(map(str, action.choices)) + "}" in text.replace("\n", "")\
                .replace(" ", ""), action.option_strings
    # The definitions and the replay model are in the help.
    for phrase in ("hit blocks / all prompt blocks", "partial last one included",
                   "infinite-cache bound", "never on this machine's speed",
                   "--storage-write-bandwidth", "--prefill-rate",
                   "n - 1 cacheable positions", "served positions / cacheable positions",
                   "the report counts the draft bytes checked"):
        assert phrase in " ".join(text.split()), phrase


def test_the_epilog_has_three_examples_that_parse() -> None:
    examples = [line.strip() for line in _joined_epilog() if line.strip().startswith("asynccache ")]
    assert len(examples) >= 3
    for ex in examples:
        argv = shlex.split(ex)[1:]
        args = cli.build_parser().parse_args(argv)
        assert args.command == "replay"


def _joined_epilog() -> list[str]:
    out, cur = [], ""
    for line in cli.EPILOG.splitlines():
        cur = cur + " " + line.strip() if cur else line
        if cur.endswith("\\"):
            cur = cur[:-1]
            continue
        out.append(cur)
        cur = ""
    return out


def test_choices_equal_the_engine_s() -> None:
    from asynccache.config import _DTYPES, HOST_MODES
    from asynccache.l3 import PREFETCH_POLICIES
    from asynccache.logs import LOG_FORMATS
    from asynccache.replay.cluster import ROUTES
    from asynccache.replay.load import FORMATS
    from asynccache.tree.queues import POLICIES
    from asynccache.tree.tree import WRITE_POLICIES

    assert tuple(WRITE_POLICIES) == cli.WRITE_POLICIES
    assert sorted(cli.EVICTION_POLICIES) == sorted(POLICIES)
    assert tuple(PREFETCH_POLICIES) == cli.PREFETCH_POLICIES
    assert tuple(HOST_MODES) == cli.HOST_MODES
    assert set(cli.DTYPES) <= set(_DTYPES)
    assert tuple(LOG_FORMATS) == cli.LOG_FORMATS
    assert tuple(ROUTES) == cli.ROUTES
    assert tuple(FORMATS) == cli.FORMATS


@pytest.mark.parametrize(("text", "value"), [
    ("4096", 4096), ("64k", 64_000), ("64Ki", 65_536), ("3M", 3_000_000), ("2GiB", 2 << 30),
    ("1.5e6", 1_500_000), ("1T", 10**12)])
def test_sizes(text: str, value: int) -> None:
    assert cli.parse_size(text) == value


def test_rates() -> None:
    assert cli.parse_rate("500MB/s") == 500_000_000
    assert cli.parse_rate("1GiB") == 1 << 30
    with pytest.raises(argparse.ArgumentTypeError, match="bad size 'fast'"):
        cli.parse_rate("fast")


def test_replay_argument_errors_show_the_replay_usage(capsys) -> None:
    """An error ``_check_args`` finds shows ``asynccache replay``'s usage, as argparse's own
    errors in the subcommand do, not the top-level one."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["replay", "--max-in-flight", "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: asynccache replay [-h]")
    assert err.rstrip().endswith("asynccache replay: error: --max-in-flight must be >= 1, got 0")
