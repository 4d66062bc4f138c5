"""CopyEngine: batched device <-> host KV copies that coroutines can await.

``submit_*`` validates the slot indices on the loop thread, queues the copy and returns a handle
at once; the copy runs on the engine's worker thread(s) (see :mod:`asynccache.transfers.workers`) and its
completion comes back to the loop through a :class:`LoopBridge` in batches. Copies retire in
submission order. Awaiting a handle never cancels its copy.

Lifecycle::

    async with CopyEngine(device_pool, host_pool) as engine:
        handle = engine.submit_d2h(device_idx, host_idx)
        result = await handle          # CopyResult: bytes moved, duration

``aclose()`` waits for every copy already submitted, stops the threads and closes the bridge;
later submissions raise :class:`ClosedError`.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, TypeAlias

import torch

from asynccache.errors import ClosedError, ConfigError, InvalidInputError, OwnerError
from asynccache.logs import get_logger
from asynccache.transfers.bridge import LoopBridge
from asynccache.transfers.handles import CopyHandle, CopyResult, LayerwiseHandle
from asynccache.transfers.indices import SlotIndices, as_slot_array
from asynccache.transfers.pools import DevicePool, HostPool, KVPool
from asynccache.transfers.workers import DirectWorker, Job, StagedWorker

_log = get_logger("asynccache.transfers.engine")

Mode: TypeAlias = Literal["auto", "direct", "staged"]
OPS = ("d2h", "h2d", "h2d_layerwise")


@dataclass(slots=True)
class OpStats:
    """Totals for one kind of copy (updated on the loop thread as copies complete)."""

    ops: int = 0
    failed: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0  # summed copy durations


class CopyEngine:
    """Moves KV pages between a :class:`DevicePool` and a :class:`HostPool`.

    ``mode``: ``"direct"`` (CPU pools only: one worker thread copying page to page),
    ``"staged"`` (the CUDA pipeline: copy stream, fences, events; runs on CPU too) or
    ``"auto"`` (staged on CUDA, direct on CPU). ``on_complete(result)`` is called on the loop
    for every finished copy (metrics hook).
    """

    def __init__(
        self,
        device_pool: DevicePool,
        host_pool: HostPool,
        *,
        mode: Mode = "auto",
        on_complete: Callable[[CopyResult], Any] | None = None,
        name: str = "asynccache-copy",
    ) -> None:
        if not isinstance(device_pool, DevicePool):
            raise ConfigError(f"device_pool must be a DevicePool, got {device_pool!r}")
        if not isinstance(host_pool, HostPool):
            raise ConfigError(f"host_pool must be a HostPool, got {host_pool!r}")
        if device_pool.shape != host_pool.shape:
            raise ConfigError(
                f"pool shapes differ: device {device_pool.shape} vs host {host_pool.shape}"
            )
        if device_pool.page_size != host_pool.page_size:
            raise ConfigError(
                f"page sizes differ: device {device_pool.page_size} vs host {host_pool.page_size}"
            )
        cuda = device_pool.device.type == "cuda"
        if mode == "auto":
            mode = "staged" if cuda else "direct"
        if mode not in ("direct", "staged"):
            raise ConfigError(f"unknown mode {mode!r}; expected 'auto', 'direct' or 'staged'")
        if mode == "direct" and cuda:
            raise ConfigError("mode='direct' needs CPU pools; CUDA pools use mode='staged'")
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.mode: Literal["direct", "staged"] = mode
        self.name = name
        self._cuda = cuda
        self._on_complete = on_complete
        self._state: Literal["new", "running", "closing", "closed"] = "new"
        self._bridge: LoopBridge | None = None
        self._worker: DirectWorker | StagedWorker | None = None
        self._loop_thread = 0
        self._drained: asyncio.Future[Any] | None = None
        self._in_flight = 0
        self._bytes_per_token = device_pool.shape.bytes_per_token
        self.stats: dict[str, OpStats] = {op: OpStats() for op in OPS}

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Bind to the running loop and start the worker thread(s)."""
        if self._state != "new":
            raise ClosedError(f"CopyEngine {self.name!r} cannot start: it is {self._state}")
        self._bridge = LoopBridge()
        self._loop_thread = threading.get_ident()
        worker_cls = StagedWorker if self.mode == "staged" else DirectWorker
        self._worker = worker_cls(self.device_pool, self.host_pool, self._bridge, self.name)
        self._worker.start()
        self._state = "running"
        _log.debug("engine_started", name=self.name, mode=self.mode)

    async def aclose(self) -> None:
        """Wait for submitted copies, stop the threads, close the bridge. Idempotent."""
        if self._state == "new":
            self._state = "closed"
            return
        if self._state == "closed":
            return
        if self._state == "running":
            assert self._bridge is not None and self._worker is not None
            self._state = "closing"
            self._drained = self._bridge.create_future()
            self._drained.add_done_callback(self._finish_close)
            self._worker.stop(self._drained)
        assert self._drained is not None
        await asyncio.shield(self._drained)

    def _finish_close(self, _fut: asyncio.Future[Any]) -> None:
        assert self._worker is not None and self._bridge is not None
        self._worker.join(timeout=10.0)
        alive = [t.name for t in self._worker.threads if t.is_alive()]
        self._bridge.close()
        self._state = "closed"
        if alive:
            _log.warning("engine_threads_alive", name=self.name, threads=alive)
        _log.debug("engine_closed", name=self.name)

    async def __aenter__(self) -> CopyEngine:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    @property
    def running(self) -> bool:
        return self._state == "running"

    @property
    def closed(self) -> bool:
        return self._state == "closed"

    @property
    def in_flight(self) -> int:
        """Copies submitted and not yet complete."""
        return self._in_flight

    @property
    def threads(self) -> list[threading.Thread]:
        return list(self._worker.threads) if self._worker is not None else []

    # ------------------------------------------------------------------ submission
    def submit_d2h(self, device_idx: SlotIndices, host_idx: SlotIndices) -> CopyHandle:
        """Copy device slots ``device_idx`` to host slots ``host_idx`` (all layers)."""
        job, src, dst = self._job("d2h", device_idx, host_idx, layerwise=False)
        return CopyHandle("d2h", job.fut, src, dst, job.num_bytes)

    def submit_h2d(self, host_idx: SlotIndices, device_idx: SlotIndices) -> CopyHandle:
        """Copy host slots ``host_idx`` to device slots ``device_idx`` (all layers)."""
        job, src, dst = self._job("h2d", host_idx, device_idx, layerwise=False)
        return CopyHandle("h2d", job.fut, src, dst, job.num_bytes)

    def submit_h2d_layerwise(
        self, host_idx: SlotIndices, device_idx: SlotIndices
    ) -> LayerwiseHandle:
        """Copy host -> device layer by layer; ``await handle.layer(i)`` waits for layer ``i``."""
        job, src, dst = self._job("h2d_layerwise", host_idx, device_idx, layerwise=True)
        assert job.layer_futs is not None
        return LayerwiseHandle(job.fut, job.layer_futs, src, dst, job.num_bytes)

    def _job(
        self, op: str, src_idx: SlotIndices, dst_idx: SlotIndices, *, layerwise: bool
    ) -> tuple[Job, Any, Any]:
        if self._state != "running":
            raise ClosedError(
                f"CopyEngine {self.name!r} is {self._state}; "
                + ("call start() or use 'async with'" if self._state == "new" else "no new copies")
            )
        if threading.get_ident() != self._loop_thread:
            raise OwnerError("CopyEngine.submit_* must be called on the engine's event loop thread")
        src_pool: KVPool
        dst_pool: KVPool
        if op == "d2h":
            src_pool, dst_pool, src_name, dst_name = (
                self.device_pool,
                self.host_pool,
                "device_idx",
                "host_idx",
            )
        else:
            src_pool, dst_pool, src_name, dst_name = (
                self.host_pool,
                self.device_pool,
                "host_idx",
                "device_idx",
            )
        src_slots = as_slot_array(src_idx, name=src_name)
        dst_slots = as_slot_array(dst_idx, name=dst_name)
        src_pages = src_pool.allocator.pages_of(src_slots, name=src_name)
        dst_pages = dst_pool.allocator.pages_of(dst_slots, name=dst_name)
        # With page_size 1 the page ids are the caller's own array: the worker needs a copy
        # that the caller cannot change under it.
        if src_pages is src_slots:
            src_pages = src_pages.copy()
        if dst_pages is dst_slots:
            dst_pages = dst_pages.copy()
        if src_pages.shape[0] != dst_pages.shape[0]:
            raise InvalidInputError(
                f"{src_name} has {src_pages.shape[0] * src_pool.page_size} slots but "
                f"{dst_name} has {dst_pages.shape[0] * dst_pool.page_size}"
            )
        bridge = self._bridge
        assert bridge is not None and self._worker is not None
        num_tokens = int(src_pages.shape[0]) * self.device_pool.page_size
        fut = bridge.create_future()
        layer_futs = None
        if layerwise:
            layer_futs = [bridge.create_future() for _ in range(self.device_pool.shape.num_layers)]
            for lf in layer_futs:
                lf.add_done_callback(_mark_retrieved)
        fence = None
        if self._cuda:
            fence = torch.cuda.Event()  # type: ignore[no-untyped-call]
            fence.record(torch.cuda.current_stream(self.device_pool.device))
        job = Job(
            op=op,
            src_pages=src_pages,
            dst_pages=dst_pages,
            fut=fut,
            layer_futs=layer_futs,
            num_tokens=num_tokens,
            num_bytes=num_tokens * self._bytes_per_token,
            submitted=time.perf_counter(),
            fence=fence,
            on_done=functools.partial(self._job_done, op),
        )
        fut.add_done_callback(_mark_retrieved)
        self._in_flight += 1
        self._worker.submit(job)
        return job, src_slots, dst_slots

    def _job_done(self, op: str, res: CopyResult | None, err: BaseException | None) -> None:
        """Bookkeeping on the loop, run by the bridge just before the copy's future resolves."""
        self._in_flight -= 1
        st = self.stats[op]
        if res is None:
            st.failed += 1
            return
        st.ops += 1
        st.tokens += res.num_tokens
        st.bytes += res.num_bytes
        st.seconds += res.duration_s
        if self._on_complete is not None:
            try:
                self._on_complete(res)
            except Exception:
                _log.exception("on_complete_failed", name=self.name)

    def __repr__(self) -> str:
        return (
            f"<CopyEngine {self.name!r} mode={self.mode} {self._state} in_flight={self._in_flight}>"
        )


def _mark_retrieved(fut: asyncio.Future[Any]) -> None:
    # The worker already logged a failure; a copy nobody awaits (its awaiter was cancelled)
    # must not make asyncio complain that the exception was never retrieved.
    if not fut.cancelled():
        fut.exception()
