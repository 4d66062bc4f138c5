"""``python -m asynccache``: the ``asynccache`` command line."""

from asynccache.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
