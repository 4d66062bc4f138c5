"""The top-level namespace (every name of ``asynccache.__all__`` resolves, lazily) and the
library's logging (importing configures nothing; events are stdlib records an application
routes like any other library's)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

import asynccache
from asynccache import errors
from asynccache.logs import EVENT_ATTR, get_logger

TIMEOUT = 120  # a hang guard, not a performance assertion


def test_every_name_in_all_resolves() -> None:
    assert len(set(asynccache.__all__)) == len(asynccache.__all__)
    for name in asynccache.__all__:
        assert getattr(asynccache, name) is not None, name
    namespace: dict[str, object] = {}
    exec("from asynccache import *", namespace)
    assert set(asynccache.__all__) <= set(namespace)
    assert set(asynccache.__all__) <= set(dir(asynccache))


def test_the_whole_exception_hierarchy_is_exported() -> None:
    classes = {name for name, value in vars(errors).items()
               if isinstance(value, type) and issubclass(value, errors.AsyncCacheError)}
    assert classes <= set(asynccache.__all__), sorted(classes - set(asynccache.__all__))
    for name in classes:
        assert getattr(asynccache, name) is getattr(errors, name)


def test_names_the_readme_uses_come_from_the_top_level() -> None:
    from asynccache.l3 import StoragePolicy
    from asynccache.ranks import TorchRankGroup
    from asynccache.storage.factory import open_backend

    assert asynccache.StoragePolicy is StoragePolicy
    assert asynccache.TorchRankGroup is TorchRankGroup
    assert asynccache.open_backend is open_backend
    assert issubclass(asynccache.PoolExhaustedError, asynccache.AsyncCacheError)
    assert issubclass(asynccache.ConfigError, ValueError)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = asynccache.nope  # type: ignore[attr-defined]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)


def test_importing_asynccache_configures_no_logging() -> None:
    proc = _run("""
        import logging
        import structlog

        root = logging.getLogger()
        before = (list(root.handlers), root.level)
        import asynccache
        import asynccache.cache, asynccache.cli, asynccache.l3, asynccache.replay.driver
        import asynccache.storage, asynccache.storage.s3, asynccache.testing.plugin
        import asynccache.transfers.engine
        for name in asynccache.__all__:
            getattr(asynccache, name)
        from asynccache.logs import get_logger
        get_logger("probe").info("probe_event", n=1)  # logging through it configures nothing
        assert not structlog.is_configured(), "importing asynccache configured structlog"
        assert (list(root.handlers), root.level) == before, (root.handlers, root.level)
        own = logging.getLogger("asynccache")
        assert own.handlers == [] and own.level == logging.NOTSET and own.propagate
        print("ok")
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
    assert proc.stderr == ""  # an INFO event goes nowhere without a handler at INFO


def test_without_any_set_up_warnings_reach_stderr_through_stdlib() -> None:
    proc = _run("""
        from asynccache.logs import get_logger
        log = get_logger("storage.probe")
        log.debug("probe_debug")
        log.warning("probe_failed", key="k1", n=3)
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == ["probe_failed key='k1' n=3"]  # logging's lastResort


def test_events_are_stdlib_records_of_asynccache_loggers(caplog: pytest.LogCaptureFixture) -> None:
    log = get_logger("storage.probe").bind(backend="file")
    with caplog.at_level(logging.WARNING, logger="asynccache"):
        log.info("probe_quiet")  # below the logger's level: dropped before formatting
        log.warning("probe_failed", key="k1", n=3)
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("probe_crashed")
    records = [r for r in caplog.records if r.name.startswith("asynccache")]
    assert [(r.name, r.levelno) for r in records] == [
        ("asynccache.storage.probe", logging.WARNING), ("asynccache.storage.probe", logging.ERROR)]
    warning, crash = records
    assert warning.getMessage() == "probe_failed backend='file' key='k1' n=3"
    assert getattr(warning, EVENT_ATTR) == {"event": "probe_failed", "backend": "file",
                                            "key": "k1", "n": 3}
    assert crash.exc_info is not None and crash.exc_info[0] is ValueError
    assert get_logger("asynccache.transfers.engine")._logger.name == "asynccache.transfers.engine"
