"""Fixtures shared by the engine-level suites (tests/cache, tests/l3, tests/buffer).

``cache_factory``: the body of each suite's ``make_cache`` fixture (build and start caches,
then at teardown check and close every one of them with the suite's own checks).
Storage: backends made for a test are closed at its teardown, after its caches; one real
SeaweedFS S3 server serves the whole session (one per xdist worker; each test writes under
its own random prefix).
tests/storage keeps its own server fixture (its tests exercise bucket-level behaviour)."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from asynccache import CacheConfig, HierarchicalCache
from asynccache.storage.faults import FaultInjectingBackend, FaultRule
from asynccache.storage.file import FileBackend
from asynccache.storage.seaweed import LocalSeaweed, find_weed, weed_problem

TIMEOUT = 20.0

#: ``-n auto`` (pytest-xdist) starts at most this many workers: each one imports torch and
#: SGLang and starts its own S3 servers, and the rank tests start up to four processes each.
MAX_AUTO_WORKERS = 8


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per CPU this process may run on, at most ``MAX_AUTO_WORKERS``."""
    affinity = getattr(os, "sched_getaffinity", None)  # not on macOS / Windows
    cpus = len(affinity(0)) if affinity else os.cpu_count() or 1
    return max(1, min(MAX_AUTO_WORKERS, cpus))


CacheMaker = Callable[..., Awaitable[HierarchicalCache]]


@pytest.fixture
def hold_copies(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], threading.Event]]:
    """``hold()`` makes the CPU copy workers wait, before each copy they start from then on,
    until the event it returns is set (at teardown at the latest): a copy is in flight for as
    long as a test needs, however fast or slow the machine."""
    import asynccache.transfers.staged as staged
    import asynccache.transfers.workers as workers

    gates: list[threading.Event] = []

    def held(gate: threading.Event, real: Callable[..., Any]) -> Callable[..., Any]:
        def wait_then(*args: Any) -> Any:
            if not gate.wait(timeout=TIMEOUT):
                raise RuntimeError("the copies were never let go")
            return real(*args)
        return wait_then

    def hold() -> threading.Event:
        gate = threading.Event()
        gates.append(gate)
        monkeypatch.setattr(workers, "make_plan", held(gate, workers.make_plan))
        monkeypatch.setattr(staged, "make_plan", held(gate, staged.make_plan))
        # the staged issuer's first call on a job
        monkeypatch.setattr(staged, "check_pairs", held(gate, staged.check_pairs))
        return gate

    yield hold
    for gate in gates:
        gate.set()


def copy_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("asynccache-copy") and t.is_alive()}


@asynccontextmanager
async def _made_caches(config: Callable[..., CacheConfig],
                       at_rest: Callable[[HierarchicalCache], Awaitable[None]],
                       close_and_check: Callable[[HierarchicalCache], Awaitable[None]],
                       ) -> AsyncIterator[CacheMaker]:
    """``make(strict=True, start=True, **config_overrides)`` builds (and starts) a cache. At the
    end every cache made is checked with ``at_rest`` (if running) and ``close_and_check``
    (``strict=False``: just closed); the first failure is raised after all are closed, and no
    copy thread may be left alive when every cache was strict."""
    made: list[tuple[HierarchicalCache, bool]] = []
    baseline = copy_threads()

    async def make(*, strict: bool = True, start: bool = True, **overrides: Any) -> HierarchicalCache:
        cache = HierarchicalCache(config(**overrides))
        made.append((cache, strict))
        if start:
            await cache.start()
        return cache

    yield make

    errors: list[BaseException] = []
    for cache, strict in made:
        try:
            if strict:
                if cache.state == "running":
                    await at_rest(cache)
                await close_and_check(cache)
            else:
                await asyncio.wait_for(cache.aclose(), TIMEOUT)
        except BaseException as exc:  # report the first failure, still close the others
            errors.append(exc)
    if errors:
        raise errors[0]
    if all(strict for _, strict in made):
        left = copy_threads() - baseline
        assert not left, f"copy threads left alive: {sorted(t.name for t in left)}"


@pytest.fixture
def cache_factory() -> Callable[..., AbstractAsyncContextManager[CacheMaker]]:
    return _made_caches


@pytest.fixture
async def backends() -> AsyncIterator[list[Any]]:
    """Backends to close at teardown (after the caches: this fixture is set up first)."""
    made: list[Any] = []
    yield made
    for b in reversed(made):
        await asyncio.wait_for(b.aclose(), TIMEOUT)


@pytest.fixture
def storage_dir(tmp_path: Path) -> Path:
    return tmp_path / "l3"


@pytest.fixture
def make_file_backend(backends: list[Any], storage_dir: Path) -> Callable[..., Awaitable[Any]]:
    async def make(cache: HierarchicalCache, rules: Sequence[FaultRule] | None = None, *,
                   root: Path | None = None, seed: int = 0, **kwargs: Any) -> Any:
        inner = FileBackend(root or storage_dir, cache.storage_layout(), **kwargs)
        await inner.start()
        backend: Any = inner
        if rules is not None:
            backend = FaultInjectingBackend(inner, rules, seed=seed)
        backends.append(backend)
        return backend

    return make


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSeaweed]:
    """One real SeaweedFS S3 server on 127.0.0.1 for the session (tests use random prefixes)."""
    problem = weed_problem(find_weed())
    if problem:
        pytest.skip(problem)
    server = LocalSeaweed(tmp_path_factory.mktemp("seaweedfs-engine"), bucket="asynccache-engine")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def make_s3_backend(backends: list[Any]) -> Callable[..., Any]:
    def make(server: LocalSeaweed, cache: HierarchicalCache, prefix: str, **kwargs: Any) -> Any:
        from asynccache.storage.s3 import S3Backend

        b = S3Backend(server.bucket, cache.storage_layout(), prefix=prefix,
                      endpoint=server.endpoint, access_key_id=server.access_key,
                      secret_access_key=server.secret_key, **kwargs)
        backends.append(b)
        return b

    return make
