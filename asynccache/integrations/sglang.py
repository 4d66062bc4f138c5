"""asynccache's storage backends as SGLang's HiCache L3 (``--hicache-storage-backend dynamic``).

SGLang loads third-party L3 backends at run time::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "asynccache",
        "module_path": "asynccache.integrations.sglang", "class_name": "AsyncCacheStorage",
        "url": "file:///mnt/kv", "page_size": 64, "kv_dtype": "bfloat16"}'

``url`` is any :func:`asynccache.storage.open_backend` URL (``file:///dir``,
``s3://bucket/prefix?endpoint=...``); ``page_size`` / ``kv_dtype`` name the pages' format in the
object names (with the model, the TP / PP rank and size and the host layout from SGLang's
storage config: MLA models share one object per page across TP ranks). Pages get asynccache's
checksummed page format and crash-safe index, so a torn or corrupt object is a miss, never
wrong KV. Keys are SGLang's page hashes (64 hex digits, optionally ``.<pool>``).

SGLang's factory needs ``backend_name``, ``module_path`` and ``class_name``; the adapter needs
``url`` and ``page_size``; optional: ``kv_dtype``, ``timeout_s`` (default 60), ``layout_extra``,
``backend_kwargs`` and ``interface_v1``.

SGLang calls the backend from its own threads and has no event loop to offer: the adapter runs
one private loop in a daemon thread, and every call is a coroutine submitted to it and waited
for. A call past ``timeout_s`` is cancelled on that loop and answers only once the backend call
has ended, so the caller's pages are never read or written after it returns. A timed-out data
call degrades like any storage fault, never raising into SGLang: ``batch_get`` / ``get`` give
``None`` per page, ``batch_set`` / ``set`` ``False``, the v1 calls ``False`` per page,
``batch_exists`` 0, ``exists`` ``False``; each logs a ``sglang_storage_timeout`` warning and
counts in ``get_stats()["timeouts"]``. ``clear``, ``delete``, ``close`` and
``register_mem_pool_host`` raise ``TimeoutError``. A loop so wedged that a cancelled call has not
ended ``grace_s`` (10 s) past the deadline is given up on (``sglang_storage_loop_wedged`` error
event, ``get_stats()["timeouts_unfinished"]``): only then can a late backend call still touch
the pages. ``close()`` on such a loop raises ``TimeoutError`` after the same wait
(``sglang_storage_close_unfinished``); its shutdown runs once the blocking call returns.
After :meth:`AsyncCacheStorage.close` every call raises
:class:`~asynccache.errors.ClosedError`; a call racing ``close()`` from another thread ends
normally or raises it (close() cancels the calls on the loop), never a timeout.

SGLang's controller uses the generic calls (``batch_set`` of host pool pages, ``batch_get``
into page tensors, ``batch_exists``), or, with ``"interface_v1": 1`` in the extra config,
``batch_set_v1`` / ``batch_get_v1`` over the host pool it registered with
``register_mem_pool_host`` (keys plus the pages' host token indices). Both paths store the same
object: the page's flat bytes in the order of ``get_data_page(index, flat=True)``, so pages
written by one are read by the other. A v1 page that is one contiguous piece of the host pool
(MLA's ``page_first``) is read and written in place. An MHA page's K and V halves (and, in
``layer_first``, its layers) are apart in the pool: the file backend takes them as ``Pieces``
(written by one ``pwritev`` with the checksum streamed over them, a verified read copied out
into them), with no gathering copy; other backends (S3) get them gathered into one staging
page per call, and reads scattered back the same way.

SGLang's host pools and controller import modules that import torchvision at module level;
where it is not installed, import them inside
:func:`asynccache.integrations.sglang_import_guard.missing_package_stand_in`.

Needs the ``sglang`` package (its ``HiCacheStorage`` base class); see
``scripts/install_sglang_cpu.sh`` for a CPU-only install.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import torch

from asynccache.errors import ClosedError, ConfigError, InvalidInputError
from asynccache.logs import get_logger
from asynccache.storage.base import Pieces, StorageLayout
from asynccache.storage.factory import open_backend

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
except Exception as exc:  # pragma: no cover - only without sglang
    raise ImportError(
        "asynccache.integrations.sglang needs the sglang package (scripts/install_sglang_cpu.sh "
        f"installs it CPU-only): {exc!r}"
    ) from exc

T = TypeVar("T")

_DEFAULT_TIMEOUT_S = 60.0
#: How long past ``timeout_s`` a caller waits for a cancelled call to end on the adapter's loop
#: (a cancelled file-backend call ends after at most a memcpy) before giving up on a wedged loop.
_GRACE_S = 10.0

_log = get_logger("integrations.sglang")


class _Unfinished(TimeoutError):
    """The call's coroutine had not ended when the caller stopped waiting (a wedged loop)."""


def layout_for(storage_config: Any, *, page_size: int, kv_dtype: str = "bfloat16",
               extra: str = "") -> StorageLayout:
    """The :class:`StorageLayout` of SGLang's pages for a ``HiCacheStorageConfig``."""
    return StorageLayout(
        model=storage_config.model_name or "sglang", page_size=page_size, kv_dtype=kv_dtype,
        kv_layout="page_first" if storage_config.is_page_first_layout else "layer_first",
        tp_rank=storage_config.tp_rank, tp_size=storage_config.tp_size,
        kv_replicated=bool(storage_config.is_mla_model),
        pp_rank=storage_config.pp_rank, pp_size=storage_config.pp_size, extra=extra)


def _contiguous_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """``t``'s elements in its flat order as contiguous views (split along leading dims)."""
    if t.is_contiguous():
        return [t.view(-1)]
    return [part for sub in t.unbind(0) for part in _contiguous_parts(sub)]


def _check_tensors(call: str, name: str, keys: Sequence[str], tensors: Any) -> None:
    """One tensor per key, or an InvalidInputError naming the first that is not."""
    if tensors is None or len(tensors) != len(keys):
        raise InvalidInputError(f"{call} needs {name}: one tensor per key ({len(keys)} keys), "
                                f"got {tensors!r}")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise InvalidInputError(f"{call}: {name}[{i}] is not a tensor: {t!r}")


class AsyncCacheStorage(HiCacheStorage):  # type: ignore[misc]  # (sglang ships no type hints)
    """An SGLang ``HiCacheStorage`` over one asynccache storage backend (see the module
    docstring). ``storage_config``: SGLang's ``HiCacheStorageConfig``; its ``extra_config``
    holds ``url`` (required), ``page_size`` (required), ``kv_dtype``, ``layout_extra``,
    ``timeout_s`` and ``backend_kwargs`` (passed to ``open_backend``: S3 credentials...)."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        url = extra.get("url")
        if not isinstance(url, str):
            raise ConfigError(f"extra_config needs 'url' (a storage URL), got {url!r}")
        page_size = extra.get("page_size")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ConfigError(f"extra_config needs 'page_size' (an int >= 1), got {page_size!r}")
        self.page_size = page_size
        self.timeout_s = float(extra.get("timeout_s", _DEFAULT_TIMEOUT_S))
        self.layout = layout_for(storage_config, page_size=page_size,
                                 kv_dtype=str(extra.get("kv_dtype", "bfloat16")),
                                 extra=str(extra.get("layout_extra", "")))
        self.mem_pool_host: Any = None
        self.grace_s = _GRACE_S
        self._url = url
        self._backend_kwargs = dict(extra.get("backend_kwargs") or {})
        self._closed = False
        #: Held while a call checks ``_closed`` and hands its coroutine to the loop, and while
        #: close() sets it: every call that found the adapter open is on the loop before
        #: close() submits its shutdown (which cancels it), none lands on a stopped loop.
        self._submit_lock = threading.Lock()
        self._counts_lock = threading.Lock()
        self._timeouts = 0
        self._timeouts_unfinished = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, daemon=True,
                                        name="asynccache-sglang-storage")
        self._thread.start()
        try:
            self.backend = self._submit(
                "open", open_backend(url, self.layout, **self._backend_kwargs))
        except BaseException:
            self._stop_loop()
            raise

    # ------------------------------------------------------------------ plumbing
    def _closed_error(self, call: str) -> ClosedError:
        return ClosedError(f"AsyncCacheStorage ({self._url}) is closed: {call} after close()")

    def _run(self, call: str, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the adapter's loop; ClosedError after :meth:`close` (``coro`` is
        closed unrun), TimeoutError past ``timeout_s`` (once ``coro`` has ended)."""
        return self._submit(call, coro, open_only=True)

    def _submit(self, call: str, coro: Coroutine[Any, Any, T], open_only: bool = False) -> T:
        """The deadline cancels ``coro`` on the loop and this returns only once it has ended,
        so a timed-out call never touches the caller's buffers afterwards (the storage
        protocol's promise for a cancelled call). Only a loop that does not end a cancelled
        call within ``grace_s`` is given up on: an error event and :class:`_Unfinished`.

        ``open_only``: ClosedError once :meth:`close` has begun. The check and the hand-over
        to the loop are one step under ``_submit_lock`` (close() sets ``_closed`` under it):
        a call that found the adapter open is on the loop before close()'s shutdown, which
        cancels it (ClosedError) if it has not ended; it never lands on a stopped loop."""
        timeout_s = self.timeout_s

        async def bounded() -> T:
            async with asyncio.timeout(timeout_s):
                return await coro

        runner = bounded()
        with self._submit_lock:
            if open_only and self._closed:
                runner.close()
                coro.close()
                raise self._closed_error(call)
            try:
                future = asyncio.run_coroutine_threadsafe(runner, self._loop)
            except RuntimeError:  # a closed loop (defensive: close() stops it after these)
                runner.close()
                coro.close()
                raise self._closed_error(call) from None
        try:
            return future.result(timeout_s + self.grace_s)
        except concurrent.futures.CancelledError:  # close() cancelled it
            coro.close()  # ended (the task is done); one cancelled before it began: unrun
            raise self._closed_error(call) from None
        except TimeoutError:
            with self._counts_lock:
                self._timeouts += 1
            if future.done():
                raise
            future.cancel()
            with self._counts_lock:
                self._timeouts_unfinished += 1
            _log.error("sglang_storage_loop_wedged", call=call, timeout_s=timeout_s,
                       grace_s=self.grace_s, url=self._url)
            raise _Unfinished(f"{call}: the adapter's loop did not end the call within "
                              f"{timeout_s + self.grace_s:.3g} s") from None

    def _io(self, call: str, keys: Sequence[str], coro: Coroutine[Any, Any, T]) -> T | None:
        """A data call: its result, or None (a miss / a skipped write) past the deadline."""
        try:
            return self._run(call, coro)
        except TimeoutError as exc:
            _log.warning("sglang_storage_timeout", call=call, pages=len(keys),
                         timeout_s=self.timeout_s, unfinished=isinstance(exc, _Unfinished))
            return None

    async def _shutdown(self) -> None:
        """Close the backend (bounded by ``timeout_s``), cancel the calls still on the loop
        (they raise ClosedError), then stop the loop, whatever happened before."""
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.backend.aclose()
        finally:
            me = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not me]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)
            # Next iteration: that iteration still runs this task's completion callbacks (they
            # are queued before it starts), so close() hears of the end before the loop stops.
            self._loop.call_soon(self._loop.stop)

    def _run_loop(self) -> None:
        """The loop thread: runs the loop until it is stopped, then closes it (here, so that a
        loop blocked when close() gave up on it is still closed once the blocking call ends)."""
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(self.grace_s)

    def close(self) -> None:
        """Close the backend and stop the adapter's loop (SGLang calls it on detach). Later
        calls raise :class:`~asynccache.errors.ClosedError`. Past ``timeout_s`` it raises
        ``TimeoutError``; on a loop blocked by a backend call, only after ``grace_s`` more,
        with a ``sglang_storage_close_unfinished`` error event: the shutdown then runs, and
        the loop closes, once the blocking call returns."""
        with self._submit_lock:  # after every call that found the adapter open is submitted
            if self._closed:
                return
            self._closed = True
        future = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        try:
            future.result(self.timeout_s + self.grace_s)
        except TimeoutError:
            with self._counts_lock:
                self._timeouts += 1
            if future.done():
                raise  # the backend's aclose() outlived timeout_s; the loop has stopped
            with self._counts_lock:
                self._timeouts_unfinished += 1
            _log.error("sglang_storage_close_unfinished", timeout_s=self.timeout_s,
                       grace_s=self.grace_s, url=self._url)
            raise _Unfinished(f"close: the adapter's loop did not run the shutdown within "
                              f"{self.timeout_s + self.grace_s:.3g} s") from None
        self._thread.join(self.grace_s)

    # ------------------------------------------------------------------ SGLang's interface
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take SGLang's host pool (for the v1 calls). A page's bytes are in the pool's own
        layout (``page_first_direct`` and ``page_head`` order them differently from the
        ``layer_first`` that SGLang's storage config reports for them), so a pool whose layout
        differs from the storage layout's switches the adapter to objects named for it."""
        if getattr(mem_pool_host, "page_size", self.page_size) != self.page_size:
            raise ConfigError(f"host pool page_size {mem_pool_host.page_size} != the "
                              f"storage's page_size {self.page_size} (extra_config)")
        host_layout = getattr(mem_pool_host, "layout", self.layout.kv_layout)
        if host_layout != self.layout.kv_layout:
            layout = dataclasses.replace(self.layout, kv_layout=str(host_layout))
            backend = self._run("register_mem_pool_host",
                                open_backend(self._url, layout, **self._backend_kwargs))
            old, self.backend, self.layout = self.backend, backend, layout
            self._run("register_mem_pool_host", old.aclose())
        self.mem_pool_host = mem_pool_host

    def _host_pages(self, call: str, keys: Sequence[str], host_indices: Any) -> list[torch.Tensor]:
        """The registered host pool's page views (``get_data_page(..., flat=False)``) for the
        token indices of ``len(keys)`` pages, or an error naming what is wrong."""
        host = self.mem_pool_host
        if host is None:
            raise ConfigError(f"{call} needs SGLang's host pool: call register_mem_pool_host first")
        if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1:
            raise InvalidInputError(f"{call}: host_indices must be a 1-D tensor of token "
                                    f"indices, got {host_indices!r}")
        if host_indices.numel() != len(keys) * self.page_size:
            raise InvalidInputError(
                f"{call}: {len(keys)} keys need {len(keys) * self.page_size} host indices "
                f"(page_size {self.page_size}), got {host_indices.numel()}")
        starts = host_indices[:: self.page_size].tolist()
        for i, start in enumerate(starts):
            if start % self.page_size:
                raise InvalidInputError(f"{call}: page {i} starts at host index {start}, "
                                        f"not a multiple of page_size {self.page_size}")
        return [host.get_data_page(start, flat=False) for start in starts]

    def _page_buffers(self, pages: list[torch.Tensor]) -> tuple[list[Any], list[int]]:
        """One buffer per host-pool page: the page itself where it is contiguous; else its
        contiguous pieces (``Pieces``, read and written in place) where the backend takes
        them; else a row of one staging tensor (those pages' indices are returned too)."""
        bufs: list[Any] = []
        staged: list[int] = []
        pieces = bool(getattr(self.backend, "takes_pieces", False))
        for i, page in enumerate(pages):
            if page.is_contiguous():
                bufs.append(page.view(-1))
            elif pieces:
                bufs.append(Pieces(_contiguous_parts(page)))
            else:
                bufs.append(None)
                staged.append(i)
        if staged:
            staging = torch.empty((len(staged), pages[staged[0]].numel()),
                                  dtype=pages[staged[0]].dtype)
            for row, i in enumerate(staged):
                bufs[i] = staging[row]
        return bufs, staged

    def batch_set_v1(self, keys: list[str], host_indices: Any,
                     extra_info: Any = None) -> list[bool]:
        """Store the host pool pages at ``host_indices`` (``page_size`` token indices per key)."""
        pages = self._host_pages("batch_set_v1", keys, host_indices)
        bufs, staged = self._page_buffers(pages)
        for i in staged:
            bufs[i].view(pages[i].shape).copy_(pages[i])
        ok = self._io("batch_set_v1", keys, self.backend.set_batch(list(keys), bufs))
        return [False] * len(keys) if ok is None else list(ok)

    def batch_get_v1(self, keys: list[str], host_indices: Any,
                     extra_info: Any = None) -> list[bool]:
        """Read pages into the host pool at ``host_indices``; True per page filled (verified)."""
        pages = self._host_pages("batch_get_v1", keys, host_indices)
        bufs, staged = self._page_buffers(pages)
        got = self._io("batch_get_v1", keys, self.backend.get_batch(list(keys), bufs))
        if got is None:
            return [False] * len(keys)
        ok = list(got)
        for i in staged:
            if ok[i]:
                pages[i].copy_(bufs[i].view(pages[i].shape))
        return ok

    def get(self, key: str, target_location: Any = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        _check_tensors("batch_get", "target_locations", keys, target_locations)
        bufs = [t.contiguous() for t in target_locations]
        ok = self._io("batch_get", keys, self.backend.get_batch(list(keys), bufs))
        if ok is None:
            return [None] * len(keys)
        out: list[torch.Tensor | None] = []
        for hit, buf, target in zip(ok, bufs, target_locations, strict=True):
            if hit and buf is not target:
                target.copy_(buf)
            out.append(target if hit else None)
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value if value is not None else target_location])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        data = values if values is not None else target_locations
        _check_tensors("batch_set", "values", keys, data)
        ok = self._io("batch_set", keys,
                      self.backend.set_batch(list(keys), [v.contiguous() for v in data]))
        return ok is not None and all(ok)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading ``keys`` are stored (SGLang's consecutive-prefix count)."""
        n = self._io("batch_exists", keys, self.backend.exists_prefix(list(keys)))
        return 0 if n is None else int(n)

    def clear(self) -> None:
        self._run("clear", self.backend.clear())

    def get_stats(self) -> dict[str, Any]:
        """The backend's stats, plus ``timeouts`` (calls past ``timeout_s``) and
        ``timeouts_unfinished`` (those the adapter's loop had not ended ``grace_s`` later)."""
        stats: dict[str, Any] = dict(self.backend.stats())
        with self._counts_lock:
            stats["timeouts"] = self._timeouts
            stats["timeouts_unfinished"] = self._timeouts_unfinished
        return stats

    def delete(self, keys: Sequence[str]) -> int:
        return int(self._run("delete", self.backend.delete(list(keys))))
