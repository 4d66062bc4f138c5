"""What a test must leave behind: no lock, no slot, no copy, no task, no thread.

The checks return readable problem lines (``"2 lock receipts still held: node 5 (device),
node 7 (host)"``); the plugin turns them into a teardown failure, and
:func:`assert_quiescent` into an ``AssertionError`` in the middle of a test (e.g. after each run
of :func:`asynccache.testing.sweep_cancellations`).

Check names (for ``@pytest.mark.asynccache_no_leak_check(...)``): ``locks`` (lock receipts and
storage prefetches still held), ``pools`` (slots not returned: allocators after close, slots
handed to callers), ``sanity`` (``sanity_check()``: tree invariants and pool accounting;
copies in flight), ``tasks`` (asyncio tasks left running), ``threads`` (copy threads alive).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import weakref
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asynccache.cache import HierarchicalCache

__all__ = [
    "CHECKS",
    "LeakError",
    "TaskSites",
    "assert_quiescent",
    "close_and_check",
    "copy_threads",
    "describe_task",
    "find_leaks",
    "format_problems",
    "held_locks",
    "leftover_tasks",
    "quiesce",
]

CHECKS: frozenset[str] = frozenset({"locks", "pools", "sanity", "tasks", "threads"})
DEFAULT_TIMEOUT_S = 20.0
_LIST_AT_MOST = 8
_COPY_THREAD_PREFIX = "asynccache-copy"
_ASYNCIO_DIR = os.path.dirname(asyncio.__file__) + os.sep


class LeakError(AssertionError):
    """A cache (or the test around it) left something behind."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__(format_problems(problems))
        self.problems = problems


def format_problems(problems: Iterable[str], prefix: str = "asynccache teardown") -> str:
    return "\n".join(f"{prefix}: {p}" for p in problems)


def _plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _listed(items: list[str]) -> str:
    counts = Counter(items)
    parts = [f"{item} x{n}" if n > 1 else item for item, n in counts.items()]
    if len(parts) > _LIST_AT_MOST:
        parts = [*parts[:_LIST_AT_MOST], f"... and {len(parts) - _LIST_AT_MOST} more"]
    return ", ".join(parts)


# ---------------------------------------------------------------------------- inspection
def _prefetch_pins(cache: HierarchicalCache) -> dict[int, Any]:
    tier = cache.storage
    ops = getattr(tier, "_prefetches", ()) if tier is not None else ()
    return {op.pin.token: op for op in ops}


def held_locks(cache: HierarchicalCache) -> list[str]:
    """One description per lock receipt still held: ``"node 5 (device)"``."""
    receipts: dict[int, tuple[Any, bool]] = getattr(cache.tree, "_receipts", {})
    by_prefetch = _prefetch_pins(cache)
    out = []
    for token, (node, is_host) in receipts.items():
        kind = "host" if is_host else "device"
        if token in by_prefetch:
            kind += ", pinned by an unfinished storage prefetch"
        elif node.id == cache.tree.root_id and not is_host:
            kind += ", the root: a request admitted with nothing cached"
        out.append(f"node {node.id} ({kind})")
    if not out and cache.tree.held_locks:  # receipts not inspectable: the count alone
        out = [f"node ? (receipt {i})" for i in range(cache.tree.held_locks)]
    return out


async def quiesce(cache: HierarchicalCache, timeout: float = DEFAULT_TIMEOUT_S) -> list[str]:
    """Wait until no copy and no storage write is in flight; a problem line if that times out."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    tier = cache.storage
    try:
        while True:
            await asyncio.wait_for(cache.flush(), max(deadline - loop.time(), 0.001))
            writes = getattr(tier, "_writes", ()) if tier is not None else ()
            if writes and tier is not None:
                await asyncio.wait_for(tier.drain(), max(deadline - loop.time(), 0.001))
                continue
            if cache.in_flight == 0:
                return []
    except TimeoutError:
        writes = len(getattr(tier, "_writes", ())) if tier is not None else 0
        return [f"{_plural(cache.in_flight, 'copy', 'copies')} and "
                f"{_plural(writes, 'storage write')} still in flight after {timeout} s"]


def _inspect(cache: HierarchicalCache, checks: frozenset[str], *, outstanding: bool) -> list[str]:
    """Problems of a running, quiesced cache."""
    problems: list[str] = []
    if "locks" in checks:
        locks = held_locks(cache)
        if locks:
            problems.append(
                f"{_plural(len(locks), 'lock receipt')} still held: {_listed(locks)} -- finish "
                "or abort every request (cache_finished_req / abort_req), release_load() every "
                "LoadBack, unlock() / unlock_host() every manual lock"
            )
        prefetches = len(_prefetch_pins(cache))
        if prefetches:
            problems.append(
                f"{_plural(prefetches, 'storage prefetch', 'storage prefetches')} started and "
                "never finished (call storage.finish_prefetch() or abort_prefetch())"
            )
    if "pools" in checks and outstanding:
        n = cache.outstanding_device_tokens
        if n:
            problems.append(
                f"device pool: {_plural(n, 'slot')} handed out by alloc_device / extend never "
                "freed (free_device) or inserted into the tree"
            )
    if "sanity" in checks:
        if cache.tree.pending_ops:
            problems.append(f"{_plural(cache.tree.pending_ops, 'tree operation')} still pending")
        try:
            cache.sanity_check()
        except Exception as exc:
            problems.append(f"sanity_check() failed: {exc}")
    return problems


async def find_leaks(cache: HierarchicalCache, *, checks: Iterable[str] = CHECKS,
                     timeout: float = DEFAULT_TIMEOUT_S) -> list[str]:
    """Wait for copies and storage writes, then list what the cache still holds.

    An empty list means: no copy in flight, no lock receipt held, no prefetch open, every
    device slot owned by the tree, ``sanity_check()`` passes. A cache that is not running
    has nothing to check here (see :func:`close_and_check`).
    """
    chosen = frozenset(checks)
    if cache.state != "running":
        return []
    problems = await quiesce(cache, timeout) if "sanity" in chosen or "locks" in chosen else []
    return problems + _inspect(cache, chosen, outstanding=True)


async def assert_quiescent(cache: HierarchicalCache, *, checks: Iterable[str] = CHECKS,
                           timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Raise :class:`LeakError` unless :func:`find_leaks` finds nothing."""
    problems = await find_leaks(cache, checks=checks, timeout=timeout)
    if problems:
        raise LeakError(problems)


async def close_and_check(cache: HierarchicalCache, *, checks: Iterable[str] = CHECKS,
                          timeout: float = DEFAULT_TIMEOUT_S) -> list[str]:
    """Check a cache as a test's teardown does: quiesce and inspect it, ``aclose()`` it, then
    check that both pools are empty and its copy threads stopped. Always closes the cache."""
    chosen = frozenset(checks)
    problems: list[str] = []
    if cache.state == "running":
        problems += await quiesce(cache, timeout)
        problems += _inspect(cache, chosen, outstanding=False)
    outstanding = cache.outstanding_device_tokens
    engine = cache.copy_engine
    try:
        await asyncio.wait_for(cache.aclose(), timeout)
    except TimeoutError:
        return [*problems, f"aclose() did not finish within {timeout} s"]
    except Exception as exc:
        problems.append(f"aclose() raised {exc!r}")
    if "pools" in chosen:
        if outstanding:  # (aclose() takes them back from the requests it interrupts)
            problems.append(f"device pool: {_plural(outstanding, 'slot')} handed out by "
                            "alloc_device / extend never freed (free_device) or inserted into "
                            "the tree before aclose()")
        used = cache.device_pool.allocator.used_size
        if used:
            problems.append(f"device pool: {_plural(used, 'slot')} still allocated after "
                            "aclose()")
        host = cache.host_pool
        if host is not None and host.allocator.used_size:
            problems.append(f"host pool: {_plural(host.allocator.used_size, 'slot')} still "
                            "allocated after aclose()")
    if "threads" in chosen and engine is not None:
        alive = sorted(t.name for t in engine.threads if t.is_alive())
        if alive:
            problems.append(f"copy threads still running after aclose(): {', '.join(alive)}")
    return problems


# ---------------------------------------------------------------------------- tasks, threads
def copy_threads() -> set[threading.Thread]:
    """Live copy-engine threads of every cache in the process."""
    return {t for t in threading.enumerate()
            if t.name.startswith(_COPY_THREAD_PREFIX) and t.is_alive()}


def describe_task(task: asyncio.Task[Any], created: str | None = None) -> str:
    """``"Task 'Task-7' running worker() (defined at test_x.py:12)"``; ``created`` (where the
    task was created, see :class:`TaskSites`) is added after the definition."""
    coro = task.get_coro()
    name = getattr(coro, "__qualname__", None) or type(coro).__name__
    code = getattr(coro, "cr_code", None) or getattr(coro, "gi_code", None)
    where = []
    if code is not None:
        where.append(f"defined at {code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno}")
    if created:
        where.append(f"created at {created}")
    detail = f" ({'; '.join(where)})" if where else ""
    return f"Task {task.get_name()!r} running {name}(){detail}"


class TaskSites:
    """Remembers where tasks are created while installed as the loop's task factory.

    A site reads ``"helper.py:8 in start_helper, from test_x.py:18 in test_y"``: the innermost
    frame outside asyncio that created the task, and the line of the test function (``test``
    in ``test_file``) that led there, when it is another frame. The previous factory (if any)
    still makes the tasks.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, test_file: str | None, test: str | None = None
    ) -> None:
        self._loop = loop
        self._test_file = os.path.realpath(test_file) if test_file else None
        self._test = test
        self._prev = loop.get_task_factory()
        # id -> (weak reference, site): by id, not a WeakKeyDictionary, so that the site of a
        # task being garbage-collected is still there when asyncio reports it (the collector
        # clears weak references before it runs finalizers).
        self._sites: dict[int, tuple[weakref.ref[Any], str]] = {}
        loop.set_task_factory(self._factory)

    def _factory(self, loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> Any:
        if self._prev is not None:
            task = self._prev(loop, coro, **kwargs)
        else:
            task = asyncio.Task(coro, loop=loop, **kwargs)
        site = self._site(sys._getframe(1))
        if site:
            if len(self._sites) > 4096:
                self._sites = {k: v for k, v in self._sites.items() if v[0]() is not None}
            self._sites[id(task)] = (weakref.ref(task), site)
        return task

    def _site(self, frame: Any) -> str | None:
        creator: str | None = None
        in_test: str | None = None  # the outermost frame seen in the test's file
        depth = 0
        while frame is not None and depth < 64:
            code = frame.f_code
            filename = code.co_filename
            if not filename.startswith(_ASYNCIO_DIR) and filename != __file__:
                here = f"{os.path.basename(filename)}:{frame.f_lineno} in {code.co_name}"
                mine = self._test_file is not None and os.path.realpath(filename) == self._test_file
                if mine and code.co_name == self._test:
                    return here if creator is None else f"{creator}, from {here}"
                if mine:
                    in_test = here
                if creator is None:
                    creator = here
            frame = frame.f_back
            depth += 1
        if in_test is not None and in_test != creator:
            return f"{creator}, from {in_test}"
        return creator

    def site(self, task: asyncio.Future[Any]) -> str | None:
        entry = self._sites.get(id(task))
        if entry is None:
            return None
        ref = entry[0]()
        return entry[1] if ref is task or ref is None else None

    def remove(self) -> None:
        """Put the previous task factory back (if this one is still installed)."""
        if self._loop.get_task_factory() == self._factory:
            self._loop.set_task_factory(self._prev)


async def leftover_tasks(baseline: set[asyncio.Task[Any]], *,
                         settle_turns: int = 3) -> list[asyncio.Task[Any]]:
    """Tasks of the running loop not in ``baseline`` and still not done after a few loop turns
    (the current task excluded)."""
    current = asyncio.current_task()
    for _ in range(settle_turns):
        await asyncio.sleep(0)
    return sorted((t for t in asyncio.all_tasks() - baseline if t is not current and not t.done()),
                  key=lambda t: t.get_name())


async def cancel_tasks(tasks: Iterable[asyncio.Task[Any]], timeout: float = 5.0) -> None:
    """Cancel ``tasks`` and wait (up to ``timeout``) for them to end."""
    pending = [t for t in tasks if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.wait(pending, timeout=timeout)
        for t in pending:  # retrieve outcomes: no "exception never retrieved" noise
            if t.done() and not t.cancelled():
                t.exception()
