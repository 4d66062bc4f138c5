"""The ``asynccache`` pytest plugin: real caches, storage and S3 for integration tests.

Registered through the ``pytest11`` entry point, so it is active once asynccache is installed;
``-p no:asynccache`` turns it off. Fixtures (async ones run on pytest-asyncio, in strict or
auto mode):

==============================  =============================================================
``asynccache_cache``            a started CPU ``HierarchicalCache`` on small pools; indirect
                                parametrization with a dict of config overrides (or a
                                ``CacheConfig``) changes it
``asynccache_cache_factory``    ``await factory(config=None, *, start=True, **overrides)``
                                builds more; ``factory.track(cache)`` checks one you built
``asynccache_file_storage``     a started ``FileBackend`` in a temporary directory, laid out for
                                ``asynccache_cache`` (attach it yourself)
``asynccache_s3``               (session) a SeaweedFS S3 server on 127.0.0.1 with a bucket and
                                credentials: an ``S3Server``; skips when ``weed`` is missing
``asynccache_s3_storage``       an ``S3Backend`` for ``asynccache_cache`` on that server, under
                                a fresh prefix
``asynccache_s3_proxy``         a ``TcpProxy`` in front of that server: pass, delay or
                                black-hole its traffic (``proxy.s3`` reaches it through it)
``asynccache_kv``               a ``KVFactory``: seeded prompts, their KV, a bit-exact checker
                                and a reference request loop (``serve``)
==============================  =============================================================

At teardown every cache the fixtures built is flushed, checked and closed; the test errors
with a message naming what leaked: lock receipts still held, storage prefetches never
finished, slots never returned, ``sanity_check()`` failures, asyncio tasks left running, copy
threads alive. ``@pytest.mark.asynccache_no_leak_check`` turns the checks off
(``asynccache_no_leak_check("tasks")`` only the named ones); the caches are still closed. A
test that already failed is not failed again: what leaked becomes a warning.
"""

from __future__ import annotations

import asyncio
import warnings
import zlib
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import pytest

from asynccache.testing.leaks import (
    CHECKS,
    DEFAULT_TIMEOUT_S,
    TaskSites,
    cancel_tasks,
    close_and_check,
    copy_threads,
    describe_task,
    format_problems,
    leftover_tasks,
)

try:
    import pytest_asyncio
except ImportError:  # pragma: no cover - the [test] extra installs it
    pytest_asyncio = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from asynccache.cache import HierarchicalCache
    from asynccache.config import CacheConfig
    from asynccache.storage.file import FileBackend
    from asynccache.storage.s3 import S3Backend
    from asynccache.testing.kv import KVFactory
    from asynccache.testing.netproxy import TcpProxy
    from asynccache.testing.s3 import S3Server

NO_LEAK_CHECK = "asynccache_no_leak_check"
CONFIG_MARK = "asynccache_config"
_CALL_REPORT = pytest.StashKey[pytest.TestReport]()
_F = TypeVar("_F", bound=Callable[..., Any])


# ---------------------------------------------------------------------------- hooks
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "asynccache_teardown_timeout",
        "seconds the asynccache fixtures wait at teardown for copies, writes and close "
        f"(default {DEFAULT_TIMEOUT_S:g})",
        default=str(DEFAULT_TIMEOUT_S),
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{NO_LEAK_CHECK}(*checks): skip the asynccache fixtures' teardown leak checks (all, or "
        f"only the named ones: {', '.join(sorted(CHECKS))}); caches are still closed",
    )
    config.addinivalue_line(
        "markers",
        f"{CONFIG_MARK}(**overrides): CacheConfig overrides for every cache that "
        "asynccache_cache / asynccache_cache_factory build in this test",
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call":
        item.stash[_CALL_REPORT] = report
    return report


def _async_fixture(**kwargs: Any) -> Callable[[_F], _F]:
    """``pytest_asyncio.fixture`` (strict mode needs it); without pytest-asyncio, a fixture that
    skips the test with the reason."""

    def deco(fn: _F) -> _F:
        if pytest_asyncio is not None:
            made: _F = cast(Any, pytest_asyncio).fixture(**kwargs)(fn)
            return made
        name = fn.__name__

        def unavailable() -> None:
            pytest.skip(f"{name} needs pytest-asyncio (pip install pytest-asyncio)")

        stub: _F = cast(Any, pytest.fixture(name=name, **kwargs))(unavailable)
        return stub

    return deco


def _checks_of(node: pytest.Item | pytest.Collector) -> frozenset[str]:
    mark = node.get_closest_marker(NO_LEAK_CHECK)
    if mark is None:
        return CHECKS
    unknown = set(mark.args) - CHECKS
    if unknown:
        pytest.fail(f"@pytest.mark.{NO_LEAK_CHECK}: unknown checks {sorted(unknown)}; "
                    f"known: {sorted(CHECKS)}", pytrace=False)
    return CHECKS - frozenset(mark.args) if mark.args else frozenset()


def _timeout_of(config: pytest.Config) -> float:
    raw = config.getini("asynccache_teardown_timeout")
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise pytest.UsageError(f"asynccache_teardown_timeout = {raw!r} is not a number") from None
    if value <= 0:
        raise pytest.UsageError(f"asynccache_teardown_timeout must be > 0, got {value}")
    return value


# ---------------------------------------------------------------------------- the factory
@dataclass(eq=False)
class _Tracked:
    cache: HierarchicalCache
    finalized: bool = False
    problems: list[str] = field(default_factory=list)


class CacheFactory:
    """Builds started caches for one test and checks / closes them at its teardown.

    ``await factory(**overrides)``: a cache of :data:`~asynccache.testing.DEFAULT_CONFIG` +
    the test's ``asynccache_config`` marker + ``overrides`` (or of ``config``, a full
    ``CacheConfig``). ``start=False`` returns it unstarted (``await cache.start()`` yourself).
    """

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self._request = request
        self.checks = _checks_of(request.node)
        self.timeout = _timeout_of(request.config)
        mark = request.node.get_closest_marker(CONFIG_MARK)
        self.defaults: dict[str, Any] = dict(mark.kwargs) if mark is not None else {}
        if mark is not None and mark.args:
            raise pytest.UsageError(f"@pytest.mark.{CONFIG_MARK} takes keyword overrides only")
        self._tracked: list[_Tracked] = []
        self._extra: list[str] = []
        self._baseline_tasks = set(asyncio.all_tasks())
        self._baseline_threads = copy_threads()
        # A pending task nobody references is garbage-collected before teardown can see it;
        # asyncio reports that (and unretrieved task exceptions) to the loop's handler.
        self._loop = asyncio.get_running_loop()
        self._lost: list[str] = []
        self._prev_handler = self._loop.get_exception_handler()
        self._loop.set_exception_handler(self._on_loop_error)
        # Where the test created each task: leak reports name the test's own line.
        path = getattr(request.node, "path", None)
        test = getattr(getattr(request.node, "function", None), "__name__", None)
        self._sites = TaskSites(self._loop, str(path) if path is not None else None, test)

    def _describe(self, task: asyncio.Task[Any]) -> str:
        return describe_task(task, self._sites.site(task))

    def _on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        task = context.get("task") or context.get("future")
        message = str(context.get("message", ""))
        if isinstance(task, asyncio.Task):
            if message.startswith("Task was destroyed but it is pending"):
                self._lost.append(f"{self._describe(task)} was garbage-collected while still "
                                  "pending (nothing kept a reference to it or awaited it)")
            elif message.startswith("Task exception was never retrieved"):
                self._lost.append(f"{self._describe(task)} raised "
                                  f"{context.get('exception')!r} and nobody awaited it")
        if self._prev_handler is not None:
            self._prev_handler(loop, context)
        else:
            loop.default_exception_handler(context)

    @property
    def caches(self) -> list[HierarchicalCache]:
        return [t.cache for t in self._tracked]

    def config(self, config: CacheConfig | None = None, **overrides: Any) -> CacheConfig:
        """The config :meth:`__call__` would use."""
        from asynccache.testing.configs import small_config

        if config is not None:
            return small_config(config, **overrides) if overrides else config
        return small_config(**{**self.defaults, **overrides})

    async def __call__(self, config: CacheConfig | None = None, *, start: bool = True,
                       **overrides: Any) -> HierarchicalCache:
        from asynccache.cache import HierarchicalCache

        cache = self.track(HierarchicalCache(self.config(config, **overrides)))
        if start:
            await cache.start()
        return cache

    def track(self, cache: HierarchicalCache) -> HierarchicalCache:
        """Check and close ``cache`` (built elsewhere) at teardown like the factory's own."""
        if all(t.cache is not cache for t in self._tracked):
            self._tracked.append(_Tracked(cache))
        return cache

    def report(self, problem: str) -> None:
        """Add a problem line to this test's teardown verdict."""
        self._extra.append(problem)

    async def close(self, cache: HierarchicalCache) -> None:
        """Check ``cache`` for leaks and close it now (an engine restart in the middle of a
        test); what it leaked fails the test at teardown. Idempotent."""
        self.track(cache)
        for t in self._tracked:
            if t.cache is cache and not t.finalized:
                t.finalized = True
                t.problems = await close_and_check(cache, checks=self.checks,
                                                   timeout=self.timeout)

    async def close_using(self, backend: Any) -> None:
        """:meth:`close` the caches whose attached storage is (a wrapper of) ``backend``: the
        storage fixtures call it before they close their backend."""
        for t in self._tracked:
            tier = t.cache.storage
            if tier is None or t.finalized:
                continue
            b = tier.backend
            while b is not backend and hasattr(b, "inner"):
                b = b.inner
            if b is backend:
                await self.close(t.cache)

    async def _teardown(self) -> list[str]:
        try:
            return await self._checked_teardown()
        finally:
            self._sites.remove()
            if self._loop.get_exception_handler() == self._on_loop_error:
                self._loop.set_exception_handler(self._prev_handler)

    async def _checked_teardown(self) -> list[str]:
        problems: list[str] = []
        many = len(self._tracked) > 1
        for i, t in enumerate(self._tracked, 1):
            await self.close(t.cache)
            problems += [f"cache {i} of {len(self._tracked)}: {p}" if many else p
                         for p in t.problems]
        problems += self._extra
        tasks = await leftover_tasks(self._baseline_tasks)
        if tasks and "tasks" in self.checks:
            problems.append(
                f"{len(tasks)} background task{'s' if len(tasks) > 1 else ''} still running "
                f"(cancelled now): {'; '.join(self._describe(t) for t in tasks)}"
            )
        await cancel_tasks(tasks)
        if self._lost and "tasks" in self.checks:
            problems += [f"background task lost: {lost}" for lost in self._lost]
        if "threads" in self.checks:
            known = {th for t in self._tracked if t.cache.copy_engine is not None
                     for th in t.cache.copy_engine.threads}
            left = sorted(t.name for t in copy_threads() - self._baseline_threads - known)
            if left:
                problems.append(
                    f"copy threads still running: {', '.join(left)} (a HierarchicalCache that "
                    "was never closed? use 'async with', or asynccache_cache_factory.track())"
                )
        return problems

    def _verdict(self, problems: list[str]) -> None:
        if not problems:
            return
        item = self._request.node
        message = format_problems(problems)
        where, line = _location(item)
        call = item.stash.get(_CALL_REPORT, None)
        if call is None or not call.passed:
            # The test failed (or never ran): its own error is what matters; ours is a warning,
            # located at the test (not in this plugin).
            warnings.warn_explicit(
                pytest.PytestWarning(f"{message}\n(not failing the test: it did not pass anyway)"),
                pytest.PytestWarning,
                filename=where,
                lineno=line,
                module=getattr(getattr(item, "module", None), "__name__", None),
            )
            return
        pytest.fail(
            f"{message}\n(in {item.name} at {item.location[0]}:{line}; opt out with "
            f"@pytest.mark.{NO_LEAK_CHECK}, or "
            f"@pytest.mark.{NO_LEAK_CHECK}(\"tasks\", ...) for some of: "
            f"{', '.join(sorted(CHECKS))})",
            pytrace=False,
        )


def _location(item: pytest.Item) -> tuple[str, int]:
    """The test's file and the 1-based line of its definition."""
    path, line0, _name = item.reportinfo()
    return str(path), (line0 or 0) + 1


def _attached_problems(backend: Any, label: str) -> list[str]:
    stuck = backend.stats().get("stuck_threads", 0) if hasattr(backend, "stats") else 0
    return [f"{label}: {stuck} I/O threads stuck (abandoned after a timeout)"] if stuck else []


# ---------------------------------------------------------------------------- fixtures
@_async_fixture()
async def asynccache_cache_factory(request: pytest.FixtureRequest) -> AsyncIterator[CacheFactory]:
    """``await asynccache_cache_factory(**config_overrides)``: started CPU caches on small
    pools; every one is checked for leaks and closed at teardown."""
    factory = CacheFactory(request)
    yield factory
    factory._verdict(await factory._teardown())


@_async_fixture()
async def asynccache_cache(asynccache_cache_factory: CacheFactory,
                           request: pytest.FixtureRequest) -> HierarchicalCache:
    """A started CPU ``HierarchicalCache`` on small pools (``asynccache.testing.DEFAULT_CONFIG``).

    Parametrize indirectly with config overrides::

        @pytest.mark.parametrize("asynccache_cache", [{"page_size": 1},
                                 {"write_policy": "write_back"}], indirect=True)
    """
    param = getattr(request, "param", None)
    from asynccache.config import CacheConfig

    if param is None:
        return await asynccache_cache_factory()
    if isinstance(param, CacheConfig):
        return await asynccache_cache_factory(param)
    if isinstance(param, dict):
        return await asynccache_cache_factory(**param)
    raise pytest.UsageError(
        f"asynccache_cache: indirect parameter must be a dict of CacheConfig overrides or a "
        f"CacheConfig, got {param!r}"
    )


@_async_fixture()
async def asynccache_file_storage(asynccache_cache: HierarchicalCache,
                                  asynccache_cache_factory: CacheFactory,
                                  tmp_path: Path) -> AsyncIterator[FileBackend]:
    """A started ``FileBackend`` in a temporary directory with ``asynccache_cache``'s layout.

    Not attached: ``asynccache_cache.attach_storage(asynccache_file_storage, StoragePolicy())``
    (or a ``faults(...)`` wrapper of it). At teardown the cache using it is checked and closed
    first, then the backend.
    """
    from asynccache.storage.file import FileBackend

    backend = FileBackend(tmp_path / "asynccache-storage", asynccache_cache.storage_layout(),
                          io_threads=2, timeout_s=10.0)
    await backend.start()
    yield backend
    await asynccache_cache_factory.close_using(backend)
    for p in _attached_problems(backend, "file storage"):
        asynccache_cache_factory.report(p)
    await backend.aclose()


@pytest.fixture(scope="session")
def asynccache_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A SeaweedFS S3 server (``weed mini``) on free 127.0.0.1 ports for the whole session,
    with one bucket and generated credentials. Skips when the ``weed`` binary is missing."""
    from asynccache.storage.seaweed import LocalSeaweed, find_weed, weed_problem
    from asynccache.testing.s3 import S3Server

    problem = weed_problem(find_weed())
    if problem is not None:
        pytest.skip(f"asynccache_s3: {problem}")
    server = LocalSeaweed(tmp_path_factory.mktemp("asynccache-s3"), bucket="asynccache-test")
    server.start()
    try:
        yield S3Server.of(server)
    finally:
        server.stop()


@pytest.fixture
def asynccache_s3_proxy(asynccache_s3: S3Server) -> Iterator[TcpProxy]:
    """A :class:`~asynccache.testing.netproxy.TcpProxy` on 127.0.0.1 in front of
    ``asynccache_s3``: ``proxy.s3`` is that server as seen through the proxy (``backend()``,
    ``url()``...); ``pass_through()``, ``delay(s)``, ``black_hole()`` and ``reset()`` decide
    what the S3 traffic meets, on connections already open too."""
    import dataclasses

    from asynccache.testing.netproxy import TcpProxy

    proxy = TcpProxy(asynccache_s3.endpoint).start()
    proxy.s3 = dataclasses.replace(asynccache_s3, endpoint=proxy.endpoint)
    try:
        yield proxy
    finally:
        proxy.stop()


@_async_fixture()
async def asynccache_s3_storage(asynccache_cache: HierarchicalCache,
                                asynccache_cache_factory: CacheFactory,
                                asynccache_s3: S3Server) -> AsyncIterator[S3Backend]:
    """An ``S3Backend`` on ``asynccache_s3`` under a fresh prefix, with ``asynccache_cache``'s
    layout (checked with a probe round trip; not attached). Its objects are removed at
    teardown."""
    backend = asynccache_s3.backend(asynccache_cache.storage_layout())
    try:
        await backend.check()
    except BaseException:
        await backend.aclose()
        raise
    yield backend
    await asynccache_cache_factory.close_using(backend)
    try:
        await backend.clear()
    finally:
        await backend.aclose()


@pytest.fixture
def asynccache_kv(request: pytest.FixtureRequest) -> KVFactory:
    """A ``KVFactory`` seeded from the test's node id: the same prompts on every run."""
    from asynccache.testing.kv import KVFactory

    return KVFactory(seed=zlib.crc32(request.node.nodeid.encode()))
