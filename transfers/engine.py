"""CopyEngine: batched device <-> host KV copies that coroutines can await.

``submit_*`` validates the slot indices on the loop thread, queues the copy and returns a handle
at once; the copy runs on the engine's worker thread(s) (see :mod:`asynccache.transfers.workers`) and its
completion comes back to the loop through a :class:`LoopBridge` in batches. Copies retire in
submission order per lane (the staged pipeline has a D->H lane and an H->D lane, the direct
worker one lane); copies of the same pages take effect in submission order. Awaiting a handle
never cancels its copy.

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
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, TypeAlias

import numpy as np
import torch

from asynccache.errors import (
    ClosedError,
    ConfigError,
    InvalidInputError,
    OwnerError,
    TransferError,
)
from asynccache.logs import get_logger
from asynccache.transfers.bridge import LoopBridge
from asynccache.transfers.handles import (
    CopyHandle,
    CopyResult,
    GroupHandle,
    LayerReadiness,
    LayerwiseGroup,
    LayerwiseHandle,
)
from asynccache.transfers.hazards import PageHazards
from asynccache.transfers.indices import SlotIndices, as_slot_array
from asynccache.transfers.pools import DevicePool, HostPool, KVPool
from asynccache.transfers.staged import (
    STAGING_BYTES,
    STAGING_SLOTS,
    StagedWorker,
    wants_direct_dma,
)
from asynccache.transfers.streams import CudaStreams, HostStreams, Streams
from asynccache.transfers.workers import DirectWorker, Job

_log = get_logger("asynccache.transfers.engine")

Mode: TypeAlias = Literal["auto", "direct", "staged"]
OPS = ("d2h", "h2d", "h2d_layerwise")
#: ``ASYNCCACHE_DEBUG_FENCES=1`` turns the fence checks on for every engine (see ``debug_fences``).
DEBUG_FENCES_ENV = "ASYNCCACHE_DEBUG_FENCES"


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
    ``"staged"`` (the CUDA pipeline: copy stream, fences, events, a staging ring; runs on CPU
    too) or ``"auto"`` (staged on CUDA, direct on CPU). ``on_complete(result)`` is called on
    the loop for every finished copy (metrics hook).

    **The fence contract.** A copy's device work waits for an explicit dependency: the
    ``after=`` of its ``submit_*`` call (a CUDA event, a stream -- an event is recorded on it
    at submission -- or a list of them), else the bound ``compute_stream`` (an event recorded
    on it at submission), else the submitting thread's current stream. Only the first two are
    explicit: kernels queued on any other stream or thread are *not* covered.
    ``debug_fences=True`` (or ``ASYNCCACHE_DEBUG_FENCES=1``) makes a submission that relies on
    the implicit current stream, submits from a stream other than the bound one, or passes an
    event that was never recorded, raise :class:`InvalidInputError`.

    ``streams``: the stream implementation (default: CUDA streams for CUDA pools, the CPU's
    for CPU pools; :class:`~asynccache.transfers.streams.LateStreams` for ordering tests).
    ``staging_bytes`` / ``staging_slots``: the staged pipeline's ring (one per lane).
    ``separate_lanes``: the staged pipeline runs D->H and H->D copies in lanes of their own
    (threads, copy stream, ring), so a load never waits behind backups; conflicts on the same
    host or device pages are ordered across lanes. ``False``: one lane for every copy.
    ``direct_dma``: whether the staged pipeline moves pages straight between the pinned host
    pool's pages and the device (no CPU gather / scatter through pinned staging). ``None``
    (default): on CUDA with a pinned page_first host pool whose pages are at least
    :data:`~asynccache.transfers.staged.DIRECT_MIN_BYTES`; ``True`` forces it (either layout;
    on CPU pools it runs the same plan with CPU copies, for tests); ``False``: staging.
    ``zero_copy``: on the direct path, whether a piece moves over the link by one kernel that
    reads (H->D) or writes (D->H) the pinned host pages themselves instead of a DMA per run of
    pages. ``None`` (default): per piece, when its runs are short
    (:func:`~asynccache.transfers.dma.prefers_zero_copy`); ``True``: always (implies the direct
    path, ``direct_dma=True``); ``False``: DMA only. The kernels take SMs from the model while
    they run (DMA uses the copy engines only).
    """

    def __init__(
        self,
        device_pool: DevicePool,
        host_pool: HostPool,
        *,
        mode: Mode = "auto",
        on_complete: Callable[[CopyResult], Any] | None = None,
        name: str = "asynccache-copy",
        compute_stream: Any = None,
        debug_fences: bool | None = None,
        streams: Streams | None = None,
        staging_bytes: int = STAGING_BYTES,
        staging_slots: int = STAGING_SLOTS,
        direct_dma: bool | None = None,
        separate_lanes: bool = True,
        zero_copy: bool | None = None,
    ) -> None:
        if not isinstance(device_pool, KVPool) or device_pool.kind != "device":
            raise ConfigError(f"device_pool must be a DevicePool, got {device_pool!r}")
        if not isinstance(host_pool, KVPool) or host_pool.kind != "host":
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
        if streams is None:
            streams = CudaStreams(device_pool.device) if cuda else HostStreams()
        elif cuda != (streams.kind == "cuda"):
            raise ConfigError(f"{type(streams).__name__} do not fit pools on {device_pool.device}")
        if mode == "auto":
            mode = "staged" if cuda or streams.asynchronous else "direct"
        if mode not in ("direct", "staged"):
            raise ConfigError(f"unknown mode {mode!r}; expected 'auto', 'direct' or 'staged'")
        if mode == "direct" and cuda:
            raise ConfigError("mode='direct' needs CPU pools; CUDA pools use mode='staged'")
        for what, v in (("staging_bytes", staging_bytes), ("staging_slots", staging_slots)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{what} must be a positive int, got {v!r}")
        if zero_copy is not None and not isinstance(zero_copy, bool):
            raise ConfigError(f"zero_copy must be None, True or False, got {zero_copy!r}")
        if zero_copy:
            if direct_dma is False:
                raise ConfigError("zero_copy=True moves pieces on the direct path; it cannot "
                                  "be combined with direct_dma=False")
            direct_dma = True
        if direct_dma is not None:
            if mode == "direct" and direct_dma:
                raise ConfigError("direct_dma=True applies to mode='staged', not mode='direct'")
            wants_direct_dma(direct_dma, host_pool, cuda)  # a ConfigError naming the problem
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.mode: Literal["direct", "staged"] = mode
        self.name = name
        self.streams = streams
        self._cuda = cuda
        self._on_complete = on_complete
        self._staging = (staging_bytes, staging_slots)
        self._direct_dma = direct_dma
        self._zero_copy = zero_copy
        if not isinstance(separate_lanes, bool):
            raise ConfigError(f"separate_lanes must be True or False, got {separate_lanes!r}")
        # Staged: D->H and H->D in lanes of their own (a load never waits behind backups).
        self.separate_lanes = separate_lanes and mode == "staged"
        self.debug_fences = (os.environ.get(DEBUG_FENCES_ENV, "") not in ("", "0")
                             if debug_fences is None else bool(debug_fences))
        self._compute_stream: Any = None
        if compute_stream is not None:
            self.bind_compute_stream(compute_stream)
        self._state: Literal["new", "running", "closing", "closed"] = "new"
        self._bridge: LoopBridge | None = None
        self._worker: DirectWorker | StagedWorker | None = None
        self._loop_thread = 0
        self._drained: asyncio.Future[Any] | None = None
        self._in_flight = 0
        self._seq = 0
        self._pending: dict[int, Job] = {}  # in flight, oldest first
        # Copies submitted in this loop iteration after its first, not handed over yet.
        self._outbox: list[Job] = []
        self._batching = False  # a flush is scheduled at the end of this iteration
        self._hazards = PageHazards(host_pool.num_pages)
        # Device pages need tracking only across lanes (one lane's copies are stream-ordered).
        self._dev_hazards = PageHazards(device_pool.num_pages) if self.separate_lanes else None
        self._fence_pool: list[Any] = []  # CUDA events of retired fences, for reuse
        self._dead: TransferError | None = None
        self._bytes_per_token = device_pool.shape.bytes_per_token
        self._riders: list[CopyEngine] = []  # sidecar engines that copy the same slots
        self.stats: dict[str, OpStats] = {op: OpStats() for op in OPS}

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Bind to the running loop and start the worker thread(s)."""
        if self._state != "new":
            raise ClosedError(f"CopyEngine {self.name!r} cannot start: it is {self._state}")
        self._bridge = LoopBridge()
        self._loop_thread = threading.get_ident()
        if self.mode == "staged":
            self._worker = StagedWorker(self.device_pool, self.host_pool, self._bridge,
                                        self.name, self._on_death, streams=self.streams,
                                        staging_bytes=self._staging[0],
                                        staging_slots=self._staging[1],
                                        direct_dma=self._direct_dma,
                                        separate_lanes=self.separate_lanes,
                                        zero_copy=self._zero_copy)
        else:
            self._worker = DirectWorker(self.device_pool, self.host_pool, self._bridge,
                                        self.name, self._on_death)
        self._worker.start()
        self._state = "running"
        _log.debug("engine_started", name=self.name, mode=self.mode, streams=self.streams.kind)

    async def aclose(self) -> None:
        """Wait for submitted copies, stop the threads, close the bridge. Idempotent.

        If a copy thread died, the copies in flight have failed already and it does not wait.
        """
        if self._state == "new":
            self._state = "closed"
            return
        if self._state == "closed":
            return
        if self._state == "running":
            assert self._bridge is not None and self._worker is not None
            self._state = "closing"
            self._flush()  # copies submitted in this iteration go before the stop
            self._drained = self._bridge.create_future()
            self._drained.add_done_callback(self._finish_close)
            if self._dead is not None:
                self._drained.set_result(None)
            else:
                self._worker.stop(self._drained)
        assert self._drained is not None
        await asyncio.shield(self._drained)

    def _finish_close(self, _fut: asyncio.Future[Any]) -> None:
        assert self._worker is not None and self._bridge is not None
        self._worker.join(timeout=1.0 if self._dead is not None else 10.0)
        alive = [t.name for t in self._worker.threads if t.is_alive()]
        self._bridge.close()
        self._state = "closed"
        if alive:
            _log.warning("engine_threads_alive", name=self.name, threads=alive)
        _log.debug("engine_closed", name=self.name)

    def _on_death(self, err: TransferError) -> None:
        """A copy thread died (called on that thread): fail everything in flight, on the loop."""
        assert self._bridge is not None
        self._bridge.call_soon(functools.partial(self._fail_all, err))

    def _fail_all(self, err: TransferError) -> None:
        self._dead = err
        pending, self._pending = self._pending, {}
        self._hazards.clear()
        if self._dev_hazards is not None:
            self._dev_hazards.clear()
        for job in pending.values():
            for worker, rider_job in job.riders:  # they would have run on the dead worker
                worker.fail(rider_job, err)
            self.stats[job.op].failed += 1
            if job.ready is not None:
                job.ready.fail(err)
            for fut in (*(job.layer_futs or ()), job.fut):
                if not fut.done():
                    fut.set_exception(err)
        self._in_flight = 0
        if pending:
            _log.error("engine_failed_copies", name=self.name, copies=len(pending),
                       error=str(err))
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

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
    def dead(self) -> TransferError | None:
        """The error of a copy thread that died (then every copy fails), else None."""
        return self._dead

    @property
    def in_flight(self) -> int:
        """Copies submitted and not yet complete."""
        return self._in_flight

    @property
    def ordered_by_host_pages(self) -> int:
        """Submissions that waited for an earlier copy of the same host pages."""
        return self._hazards.ordered

    @property
    def ordered_by_device_pages(self) -> int:
        """Submissions that waited for an earlier copy of the same device pages in the other
        lane (separate lanes only)."""
        return 0 if self._dev_hazards is None else self._dev_hazards.ordered

    @property
    def threads(self) -> list[threading.Thread]:
        return list(self._worker.threads) if self._worker is not None else []

    @property
    def worker(self) -> DirectWorker | StagedWorker | None:
        return self._worker

    # ------------------------------------------------------------------ fences
    @property
    def compute_stream(self) -> Any:
        """The stream every submission without ``after=`` is fenced behind (None: current)."""
        return self._compute_stream

    def bind_compute_stream(self, stream: Any) -> None:
        """Fence every later submission without ``after=`` behind ``stream`` (None: unbind)."""
        if stream is not None and not self.streams.is_stream(stream):
            raise ConfigError(f"compute_stream must be a {self.streams.kind} stream, got "
                              f"{stream!r}")
        self._compute_stream = stream

    def _fences(self, after: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """The events this submission's device work waits for (see the fence contract), and
        those of them the engine recorded (CUDA: pooled for reuse once the copy retired)."""
        streams = self.streams
        if after is None:
            bound = self._compute_stream
            if self.debug_fences and streams.asynchronous:
                cur = streams.current()
                if bound is None:
                    raise InvalidInputError(
                        f"CopyEngine {self.name!r}: no explicit dependency (debug_fences): "
                        "pass after= (the event recorded after the kernels that write or read "
                        "these slots) or bind compute_stream=")
                if cur != bound:
                    raise InvalidInputError(
                        f"CopyEngine {self.name!r}: submitted while {cur!r} is current but the "
                        f"engine is bound to {bound!r}; kernels queued on {cur!r} are not "
                        "covered: pass after= (debug_fences)")
            stream = bound if bound is not None else (
                streams.current() if streams.asynchronous else None)
            return ((), ()) if stream is None else self._owned((self._record_fence(stream),))
        items = after if isinstance(after, list | tuple) else (after,)
        out = []
        own = []
        for item in items:
            if streams.is_stream(item):
                own.append(self._record_fence(item))
                out.append(own[-1])
            elif streams.is_event(item):
                if self.debug_fences and not streams.recorded(item):
                    raise InvalidInputError(
                        f"CopyEngine {self.name!r}: after= event {item!r} was never recorded; "
                        "waiting for it orders nothing (debug_fences)")
                out.append(item)
            else:
                raise InvalidInputError(
                    f"after= must be a {streams.kind} event or stream (or a list of them), "
                    f"got {item!r}")
        return tuple(out), (tuple(own) if self._cuda else ())

    def _owned(self, fences: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        return fences, (fences if self._cuda else ())

    def _record_fence(self, stream: Any) -> Any:
        if self._cuda:
            ev = self._fence_pool.pop() if self._fence_pool else torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record(stream)
            return ev
        return stream.record_event()

    # ------------------------------------------------------------------ submission
    def submit_d2h(self, device_idx: SlotIndices, host_idx: SlotIndices, *,
                   after: Any = None) -> CopyHandle:
        """Copy device slots ``device_idx`` to host slots ``host_idx`` (all layers).

        ``after``: what the copy's device reads wait for (see the fence contract)."""
        self._check_riders()
        job, src, dst = self._job("d2h", device_idx, host_idx, layerwise=False, after=after,
                                  hand_over=not self._riders)
        handle = CopyHandle("d2h", job.fut, src, dst, job.num_bytes)
        if not self._riders:
            return handle
        return GroupHandle([handle, *self._ride(job, src, dst, after)])

    def submit_h2d(self, host_idx: SlotIndices, device_idx: SlotIndices, *,
                   after: Any = None) -> CopyHandle:
        """Copy host slots ``host_idx`` to device slots ``device_idx`` (all layers).

        ``after``: what the copy's device writes wait for (kernels still reading the slots)."""
        self._check_riders()
        job, src, dst = self._job("h2d", host_idx, device_idx, layerwise=False, after=after,
                                  hand_over=not self._riders)
        handle = CopyHandle("h2d", job.fut, src, dst, job.num_bytes, job.ready)
        if not self._riders:
            return handle
        return GroupHandle([handle, *self._ride(job, src, dst, after)])

    def submit_h2d_layerwise(
        self, host_idx: SlotIndices, device_idx: SlotIndices, *, after: Any = None
    ) -> LayerwiseHandle:
        """Copy host -> device layer by layer; ``await handle.layer(i)`` waits for layer ``i``
        (with riders: a :class:`LayerwiseGroup`, each rider loaded layer by layer too)."""
        self._check_riders()
        job, src, dst = self._job("h2d_layerwise", host_idx, device_idx, layerwise=True,
                                  after=after, hand_over=not self._riders)
        assert job.layer_futs is not None
        handle = LayerwiseHandle(job.fut, job.layer_futs, src, dst, job.num_bytes, job.ready)
        if not self._riders:
            return handle
        parts: list[LayerwiseHandle] = [handle]
        for part in self._ride(job, src, dst, after):
            assert isinstance(part, LayerwiseHandle)
            parts.append(part)
        return LayerwiseGroup(parts)

    # ------------------------------------------------------------------ riders (sidecars)
    def add_rider(self, rider: CopyEngine) -> None:
        """Make ``rider`` (an engine over a sidecar's device and host pools) copy the same
        slots as every later submission here, in the same handle (a :class:`GroupHandle`, or a
        :class:`LayerwiseGroup` for layer-wise loads). Its pools must have at least as many
        slots as this engine's and the same page size; it is started and closed by its owner
        (start it before the first copy, close it after this engine)."""
        if not isinstance(rider, CopyEngine) or rider is self or rider in self._riders:
            raise ConfigError(f"a rider must be another CopyEngine, got {rider!r}")
        for mine, theirs, what in ((self.device_pool, rider.device_pool, "device"),
                                   (self.host_pool, rider.host_pool, "host")):
            if theirs.page_size != mine.page_size:
                raise ConfigError(f"rider {rider.name!r}: {what} page_size {theirs.page_size} "
                                  f"!= {mine.page_size}")
            if theirs.num_slots < mine.num_slots:
                raise ConfigError(f"rider {rider.name!r}: {theirs.num_slots} {what} slots < "
                                  f"{mine.num_slots} of {self.name!r}")
        self._riders.append(rider)

    def _ride(self, job: Job, src: np.ndarray, dst: np.ndarray, after: Any) -> list[CopyHandle]:
        """Submit the riders' copies of ``job`` (not handed over yet), then hand it over.

        Where this engine and a rider both copy directly (CPU pools), the rider's copy is not
        handed to the rider's own threads: it rides ``job`` itself, and this engine's worker
        runs it right after ``job``'s copy, with the rider's pools and helper and completing
        through the rider's engine (its stats, its handle, its layers). That saves the
        wake-ups of the rider's threads per copy, which on a small machine compete with the
        source's copy for the cores (``scripts/bench_sidecars.py``). Other riders (staged, with
        riders of their own, or with a ``submit_*`` wrapped on the instance, as
        :func:`asynccache.testing.copy_faults` does) go through their public ``submit_*``.
        """
        parts: list[CopyHandle] = []
        inline: list[tuple[DirectWorker, Job]] = []
        public = _PUBLIC_SUBMIT[job.op]
        try:
            for r in self._riders:
                worker = r._worker
                if (isinstance(self._worker, DirectWorker) and isinstance(worker, DirectWorker)
                        and not r._riders and public not in vars(r)):
                    rjob, rsrc, rdst = r._job(job.op, src, dst, after=after, hand_over=False,
                                              layerwise=job.layer_futs is not None)
                    inline.append((worker, rjob))
                    parts.append(r._handle(rjob, rsrc, rdst))
                else:
                    submit: Callable[..., CopyHandle] = getattr(r, public)
                    parts.append(submit(src, dst, **_after(after)))
        finally:
            job.riders = tuple(inline)
            self._hand_over(job)
        return parts

    @staticmethod
    def _handle(job: Job, src: np.ndarray, dst: np.ndarray) -> CopyHandle:
        if job.layer_futs is not None:
            return LayerwiseHandle(job.fut, job.layer_futs, src, dst, job.num_bytes, job.ready)
        return CopyHandle(job.op, job.fut, src, dst, job.num_bytes, job.ready)

    @property
    def riders(self) -> tuple[CopyEngine, ...]:
        return tuple(self._riders)

    def _check_riders(self) -> None:
        """Every rider can take a copy (checked before anything is queued: a submission is
        queued on all of them, or on none)."""
        for r in self._riders:
            r._check_open()

    def _check_open(self) -> None:
        if self._dead is not None:
            raise TransferError(f"CopyEngine {self.name!r} is dead: {self._dead}") \
                from self._dead
        if self._state != "running":
            raise ClosedError(
                f"CopyEngine {self.name!r} is {self._state}; "
                + ("call start() or use 'async with'" if self._state == "new" else "no new copies")
            )

    def _job(
        self, op: str, src_idx: SlotIndices, dst_idx: SlotIndices, *, layerwise: bool,
        after: Any = None, hand_over: bool = True,
    ) -> tuple[Job, Any, Any]:
        """Make and register one copy; hand it to the worker unless ``hand_over`` is False
        (then the caller hands it over, see :meth:`_ride`)."""
        self._check_open()
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
        fences, own_fences = self._fences(after)  # the last check: nothing is recorded before it passes
        bridge = self._bridge
        assert bridge is not None and self._worker is not None
        num_tokens = int(src_pages.shape[0]) * self.device_pool.page_size
        fut = bridge.create_future()
        layer_futs = ready = None
        if layerwise:
            layer_futs = [bridge.create_future() for _ in range(self.device_pool.shape.num_layers)]
            for lf in layer_futs:
                lf.add_done_callback(_mark_retrieved)
            ready = LayerReadiness(len(layer_futs), self.streams.current, self._flush_here,
                                   self._worker_death)
        elif op == "h2d":  # a whole load: device-side readiness of the copy as one "layer"
            ready = LayerReadiness(1, self.streams.current, self._flush_here, self._worker_death)
        seq = self._seq
        self._seq += 1
        deps = self._hazards.note(seq, dst_pages if op == "d2h" else src_pages,
                                  op == "d2h", self._pending)
        dev_deps: tuple[Job, ...] = ()
        if self._dev_hazards is not None:  # a D->H reads device pages, an H->D writes them
            dev_deps = self._dev_hazards.note(seq, src_pages if op == "d2h" else dst_pages,
                                              op != "d2h", self._pending)
        job = Job(
            op=op,
            src_pages=src_pages,
            dst_pages=dst_pages,
            fut=fut,
            layer_futs=layer_futs,
            num_tokens=num_tokens,
            num_bytes=num_tokens * self._bytes_per_token,
            submitted=time.perf_counter(),
            fences=fences,
            own_fences=own_fences,
            deps=deps,
            dev_deps=dev_deps,
            seq=seq,
            on_done=functools.partial(self._job_done, op, seq),
            ready=ready,
        )
        fut.add_done_callback(_mark_retrieved)
        self._in_flight += 1
        self._pending[seq] = job
        if hand_over:
            self._hand_over(job)
        return job, src_slots, dst_slots

    def _hand_over(self, job: Job) -> None:
        assert self._worker is not None and self._bridge is not None
        if self._batching:
            # A copy was handed over earlier in this loop iteration: this one waits for the
            # iteration's end and goes with the others, one wake-up of the worker for all.
            self._outbox.append(job)
        else:
            # The iteration's first copy starts at once (a lone copy waits for nothing, and
            # a caller that runs other work before it awaits still overlaps with it).
            self._batching = True
            self._worker.submit_many([job])
            self._bridge.loop.call_soon(self._flush)

    def _flush_here(self) -> None:
        """:meth:`_flush` now if called on the loop's thread (a thread blocking there in
        ``wait_layer`` would otherwise hold back the copy it waits for); else nothing."""
        if threading.get_ident() == self._loop_thread:
            self._flush()

    def _worker_death(self) -> BaseException | None:
        return self._dead or (self._worker.dead if self._worker is not None else None)

    def _flush(self) -> None:
        """End of the loop iteration: hand the copies submitted after its first one to the
        worker as one batch."""
        self._batching = False
        jobs, self._outbox = self._outbox, []
        if jobs and self._worker is not None:
            self._worker.submit_many(jobs)

    def _job_done(self, op: str, seq: int, res: CopyResult | None,
                  err: BaseException | None) -> None:
        """Bookkeeping on the loop, run by the bridge just before the copy's future resolves."""
        job = self._pending.pop(seq, None)
        if job is None:  # failed already, when a copy thread died
            return
        self._in_flight -= 1
        self._hazards.retire(op == "d2h")
        if self._dev_hazards is not None:
            self._dev_hazards.retire(op != "d2h")
        if job.own_fences and len(self._fence_pool) < 64:
            # The copy stream's wait on them was issued before the copy ran (it captured their
            # state then): recording them again for a later copy is safe.
            self._fence_pool.extend(job.own_fences)
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


_PUBLIC_SUBMIT = {"d2h": "submit_d2h", "h2d": "submit_h2d", "h2d_layerwise": "submit_h2d_layerwise"}


def _after(after: Any) -> dict[str, Any]:
    """``after=`` for a rider's submission (only when given: a wrapped submit may not take it)."""
    return {} if after is None else {"after": after}
