"""Fixtures of the replay tests: where the shared traces are, and a hang guard.

The real traces live outside the repository (``../shared/traces`` next to the checkout, or
``$ASYNCCACHE_TRACES``); tests that need them skip cleanly when they are absent. Nothing here
copies them.
"""

from __future__ import annotations

import faulthandler
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

HANG_GUARD = 120.0


def traces_dir() -> Path:
    env = os.environ.get("ASYNCCACHE_TRACES")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "traces"


@pytest.fixture(autouse=True)
def hang_guard() -> Iterator[None]:
    faulthandler.dump_traceback_later(HANG_GUARD, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """``main()`` run in process configures logging as the command line does (a root handler,
    the root level, structlog): put everything back so later tests see the library's default."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    configured, config = structlog.is_configured(), structlog.get_config()
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    if configured:
        structlog.configure(**config)
    else:
        structlog.reset_defaults()


@pytest.fixture
def mooncake_conversation() -> Path:
    p = traces_dir() / "mooncake" / "conversation_trace.jsonl"
    if not p.is_file():
        pytest.skip(f"shared trace {p} not present")
    return p


@pytest.fixture
def mooncake_synthetic() -> Path:
    p = traces_dir() / "mooncake" / "synthetic_trace.jsonl"
    if not p.is_file():
        pytest.skip(f"shared trace {p} not present")
    return p


@pytest.fixture
def kvtester_samples() -> list[Path]:
    d = traces_dir() / "kv-cache-tester"
    paths = sorted(d.glob("trace_*.json")) if d.is_dir() else []
    if not paths:
        pytest.skip(f"no kv-cache-tester sample traces under {d}")
    return paths
