"""Running the ``asynccache`` command line in-process, for the CLI tests."""

from __future__ import annotations

from asynccache.cli import main


def cli_rc(argv: list[str]) -> int:
    """``main(argv)``'s exit status, whether it returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code) if exc.code is not None else 0
