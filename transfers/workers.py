"""The threads that execute copies for :class:`asynccache.transfers.engine.CopyEngine`.

* :class:`DirectWorker` (CPU pools): a worker thread (and, for large copies, a helper) copies
  each job's plan straight from source pages into destination pages (numpy slice assignments
  on byte views, one per segment of pages consecutive on both sides).
* :class:`StagedWorker` (CUDA; also runs on CPU, where it exercises the same pipeline): an
  *issuer* thread gathers host pages into pinned staging, enqueues DMA + device gather/scatter
  on a dedicated copy stream behind the job's fence on the compute stream and records an event
  per batch / per layer; a *completer* thread synchronises those events in submission order,
  finishes device -> host copies (staging -> host pages) and posts completions. Large CPU
  gathers / scatters are shared with a helper thread, as in the direct worker.

Both post completions through the :class:`LoopBridge` (one thread hop per burst) and retire
jobs in submission order. A failing job fails its own futures with :class:`TransferError`;
the threads keep serving later jobs.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from asynccache.errors import TransferError
from asynccache.logs import get_logger
from asynccache.transfers.bridge import Completion, LoopBridge
from asynccache.transfers.chunks import Chunk, SharedChunks, layer_chunks, whole_chunks
from asynccache.transfers.handles import CopyResult
from asynccache.transfers.plan import CopyPlan, as_numpy_bytes, identity_pages, make_plan
from asynccache.transfers.pools import DevicePool, HostPool

_log = get_logger("asynccache.transfers.workers")


@dataclass(eq=False, slots=True)
class Job:
    """One submitted copy, as the worker threads see it."""

    op: str  # "d2h" | "h2d" | "h2d_layerwise"
    src_pages: np.ndarray
    dst_pages: np.ndarray
    fut: Any  # asyncio.Future[CopyResult]
    layer_futs: list[Any] | None
    num_tokens: int
    num_bytes: int
    submitted: float
    fence: Any = None  # torch.cuda.Event recorded on the compute stream at submission
    # Runs on the loop just before ``fut`` resolves (engine bookkeeping: stats, in-flight).
    on_done: Callable[[CopyResult | None, BaseException | None], None] | None = None
    started: float = 0.0
    layers_done: int = 0
    mark: float = 0.0  # when the previous layer was in place (layer durations are deltas)


@dataclass(eq=False, slots=True)
class _Stop:
    fut: Any  # resolved once every earlier job has completed


@dataclass(eq=False, slots=True)
class _Issued:
    """A job (or one layer of it) whose device work is queued behind ``event``."""

    job: Job
    event: Any
    layer: int | None = None  # None: the whole job is complete after ``finish``
    finish: Callable[[], None] | None = None  # CPU work after the event (staging -> host)
    keep: tuple[Any, ...] = field(default_factory=tuple)  # buffers the DMA still reads
    error: BaseException | None = None


class _NullEvent:
    """Stands in for a CUDA event on the CPU: work is complete when issued."""

    def record(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None


_NULL_EVENT = _NullEvent()


def _transfer_error(job: Job, exc: BaseException) -> TransferError:
    err = TransferError(f"{job.op} copy of {job.num_tokens} tokens failed: {exc!r}")
    err.__cause__ = exc
    return err


class _WorkerBase:
    def __init__(self, device: DevicePool, host: HostPool, bridge: LoopBridge, name: str) -> None:
        self.device = device
        self.host = host
        self.bridge = bridge
        self.name = name
        self.num_layers = device.shape.num_layers
        self.jobs: queue.SimpleQueue[Job | _Stop] = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        for t in self.threads:
            t.start()

    # ---------------------------------------------------------------- the helper thread
    def _helper_thread(self) -> threading.Thread:
        self._half: queue.SimpleQueue[SharedChunks | None] = queue.SimpleQueue()
        return threading.Thread(target=self._run_helper, name=f"{self.name}-helper", daemon=True)

    def _run_helper(self) -> None:
        while True:
            shared = self._half.get()
            if shared is None:
                return
            if shared.enter():
                try:
                    shared.work()
                finally:
                    shared.leave()

    def _stop_helper(self) -> None:
        self._half.put(None)

    def _copy_shared(self, plan: CopyPlan, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy ``plan`` between ``(L, 2, P, R)`` numpy byte views, all their layers, sharing
        the chunks of a large copy with the helper thread."""
        layers = int(src.shape[0])
        layer_page_bytes = int(src.shape[1]) * int(src.shape[3])
        chunks = whole_chunks(plan.num_pages, layers, layer_page_bytes,
                              parallel_bytes=PARALLEL_BYTES, chunk_bytes=CHUNK_BYTES,
                              max_chunks=MAX_CHUNKS)

        def run(c: Chunk) -> None:
            plan.copy_part(src, dst, slice(c[0], c[1]), c[2], c[3])

        shared = SharedChunks(chunks, run)
        if len(chunks) > 1:
            self._half.put(shared)
        shared.work()
        shared.close()
        if shared.error is not None:
            raise shared.error

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def stop(self, drained: Any) -> None:
        self.jobs.put(_Stop(drained))

    def join(self, timeout: float | None = None) -> None:
        for t in self.threads:
            t.join(timeout)

    # ---------------------------------------------------------------- completions
    def _result(self, job: Job, duration: float, layer: int | None = None) -> CopyResult:
        nbytes = job.num_bytes if layer is None else job.num_bytes // self.num_layers
        return CopyResult(
            op=job.op,
            num_tokens=job.num_tokens,
            num_bytes=nbytes,
            queued_s=job.started - job.submitted,
            duration_s=duration,
            layer=layer,
        )

    def _layer_done(self, job: Job, layer: int) -> CopyResult:
        now = time.perf_counter()
        res = self._result(job, now - job.mark, layer)
        job.mark = now
        job.layers_done = layer + 1
        return res

    def _finish(
        self, job: Job, res: CopyResult | None, err: BaseException | None, items: list[Completion]
    ) -> None:
        """Post ``items`` then the job's own completion, after its bookkeeping, in one batch."""
        if job.on_done is not None:
            items.append((None, functools.partial(job.on_done, res, err), None))
        items.append((job.fut, res, err))
        self.bridge.complete_many(items)

    def _fail(self, job: Job, exc: BaseException) -> None:
        err = _transfer_error(job, exc)
        items: list[Completion] = []
        if job.layer_futs is not None:
            items.extend((f, None, err) for f in job.layer_futs[job.layers_done :])
        self._finish(job, None, err, items)
        _log.warning("copy_failed", op=job.op, tokens=job.num_tokens, error=repr(exc))


# A copy (or a layer group) of at least this many bytes is shared with the helper thread: one
# thread's memcpy reaches about half of what two reach here (measured 14.6 vs 25.2 GB/s on
# cache-resident 32 MiB buffers; numpy assignments release the GIL).
PARALLEL_BYTES = 1 << 20
# Shared copies are cut into chunks of about this size (at most MAX_CHUNKS per copy or layer
# group) that the two threads take in order: a late helper costs at most one chunk.
CHUNK_BYTES = 1 << 20
MAX_CHUNKS = 8
# A layer-wise load completes layers in groups of at least this many bytes, and in at most
# MAX_LAYER_GROUPS groups: one hand-off to the loop per group instead of one per layer (each
# wakes the loop, which competes with the copy threads for the cores).
LAYER_GROUP_BYTES = 2 << 20
MAX_LAYER_GROUPS = 4


class DirectWorker(_WorkerBase):
    """CPU pools: a worker thread (plus a helper for large copies) copies page to page.

    Each job is planned into segments (:func:`make_plan`) and cut into chunks
    (:mod:`asynccache.transfers.chunks`); the worker and the helper take chunks in order. A layer-wise
    load posts each completed layer group as soon as every chunk up to it is done.
    """

    def __init__(self, device: DevicePool, host: HostPool, bridge: LoopBridge, name: str) -> None:
        super().__init__(device, host, bridge, name)
        self._dev_np = as_numpy_bytes(device.page_view())
        self._host_np = as_numpy_bytes(host.page_view())
        self._layer_page_bytes = device.page_bytes // self.num_layers
        self.threads = [
            threading.Thread(target=self._run, name=f"{name}-worker", daemon=True),
            self._helper_thread(),
        ]

    def _run(self) -> None:
        try:
            while True:
                item = self.jobs.get()
                if isinstance(item, _Stop):
                    self.bridge.set_result(item.fut, None)
                    return
                try:
                    self._copy(item)
                except BaseException as exc:  # never let the worker die with jobs queued
                    self._fail(item, exc)
        finally:
            self._stop_helper()

    def _chunks(self, n: int, layerwise: bool) -> list[Chunk]:
        kw = {"parallel_bytes": PARALLEL_BYTES, "chunk_bytes": CHUNK_BYTES,
              "max_chunks": MAX_CHUNKS}
        if layerwise:
            return layer_chunks(n, self.num_layers, self._layer_page_bytes,
                                group_bytes=LAYER_GROUP_BYTES, max_groups=MAX_LAYER_GROUPS,
                                **kw)
        return whole_chunks(n, self.num_layers, self._layer_page_bytes, **kw)

    def _copy(self, job: Job) -> None:
        job.started = job.mark = start = time.perf_counter()
        plan = make_plan(job.src_pages, job.dst_pages)
        src, dst = (self._dev_np, self._host_np) if job.op == "d2h" else (self._host_np, self._dev_np)
        layerwise = job.layer_futs is not None

        def run(c: Chunk) -> None:
            plan.copy_part(src, dst, slice(c[0], c[1]), c[2], c[3])

        shared = SharedChunks(
            self._chunks(plan.num_pages, layerwise), run,
            functools.partial(self._post_layers, job) if layerwise else None,
        )
        if len(shared.chunks) > 1:
            self._half.put(shared)
        shared.work()
        shared.close()
        if shared.error is not None:
            raise shared.error
        items: list[Completion] = []
        if job.layer_futs is not None:  # the layers not posted yet ride with the job
            items = [
                (job.layer_futs[layer], self._layer_done(job, layer), None)
                for layer in range(job.layers_done, self.num_layers)
            ]
        self._finish(job, self._result(job, time.perf_counter() - start), None, items)

    def _post_layers(self, job: Job, shared: SharedChunks) -> None:
        """Post the layers completed so far, except the last (it rides with the job)."""
        assert job.layer_futs is not None
        upto = min(shared.completed_layers(self.num_layers), self.num_layers - 1)
        if upto > job.layers_done:
            self.bridge.complete_many(
                [(job.layer_futs[layer], self._layer_done(job, layer), None)
                 for layer in range(job.layers_done, upto)]
            )


class StagedWorker(_WorkerBase):
    """CUDA pools (or CPU, to test the pipeline): issuer + completer threads, see module doc."""

    def __init__(self, device: DevicePool, host: HostPool, bridge: LoopBridge, name: str) -> None:
        super().__init__(device, host, bridge, name)
        self.cuda = device.device.type == "cuda"
        self.pin = self.cuda
        self.stream: Any = (
            torch.cuda.Stream(device=device.device) if self.cuda else None  # type: ignore[no-untyped-call]
        )
        self.issued: queue.SimpleQueue[_Issued | _Stop] = queue.SimpleQueue()
        self._host_np = as_numpy_bytes(host.page_view())
        self.threads = [
            threading.Thread(target=self._issue_loop, name=f"{name}-issuer", daemon=True),
            threading.Thread(target=self._complete_loop, name=f"{name}-completer", daemon=True),
            self._helper_thread(),  # shares large staging gathers / scatters (CPU memcpy)
        ]

    # ---------------------------------------------------------------- CUDA helpers
    def _stream_ctx(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def _event(self) -> Any:
        if not self.cuda:
            return _NULL_EVENT
        # blocking: the completer sleeps in synchronize() instead of spinning a core
        ev = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        ev.record(self.stream)
        return ev

    def _to_device(self, pages: np.ndarray) -> torch.Tensor:
        idx = torch.from_numpy(pages)
        if not self.cuda:
            return idx
        # From pinned memory, non-blocking: a pageable copy would synchronise the copy stream
        # (and so wait for the compute stream behind the fence) on the issuer thread.
        return idx.pin_memory().to(self.device.device, non_blocking=True)

    def _staging(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=self.device.shape.dtype, pin_memory=self.pin)

    # ---------------------------------------------------------------- issuer
    def _issue_loop(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device.device)
        while True:
            item = self.jobs.get()
            if isinstance(item, _Stop):
                self.issued.put(item)
                return
            try:
                self._issue(item)
            except BaseException as exc:
                self.issued.put(_Issued(item, _NULL_EVENT, error=exc))

    def _issue(self, job: Job) -> None:
        job.started = job.mark = time.perf_counter()
        n = int(job.src_pages.shape[0])
        dev, host = self.device, self.host
        # Validates the pair lists (lengths, repeated destinations) before any work is queued.
        make_plan(job.src_pages, job.dst_pages)
        if n == 0:
            if job.layer_futs is not None:
                for layer in range(self.num_layers):
                    self.issued.put(_Issued(job, _NULL_EVENT, layer=layer))
            self.issued.put(_Issued(job, _NULL_EVENT))
            return
        if job.op == "d2h":
            with self._stream_ctx():
                if job.fence is not None:
                    self.stream.wait_event(job.fence)
                src_idx = self._to_device(job.src_pages)
                gstage = torch.index_select(dev.page_view(), 2, src_idx)
                hstage = self._staging(tuple(gstage.shape))
                hstage.copy_(gstage, non_blocking=self.cuda)
                event = self._event()
            to_host = make_plan(identity_pages(n), job.dst_pages)
            self.issued.put(
                _Issued(
                    job,
                    event,
                    finish=lambda: self._copy_shared(to_host, as_numpy_bytes(hstage),
                                                     self._host_np),
                    keep=(gstage, hstage, src_idx),
                )
            )
            return
        gather = make_plan(job.src_pages, identity_pages(n))
        with self._stream_ctx():
            if job.fence is not None:
                self.stream.wait_event(job.fence)
            dst_idx = self._to_device(job.dst_pages)
        if job.op == "h2d":
            hstage = self._staging((self.num_layers, 2, n, host.page_view().shape[3]))
            self._copy_shared(gather, self._host_np, as_numpy_bytes(hstage))
            with self._stream_ctx():
                gstage = hstage.to(dev.device, non_blocking=self.cuda)
                dev.page_view().index_copy_(2, dst_idx, gstage)
                event = self._event()
            self.issued.put(_Issued(job, event, keep=(hstage, gstage, dst_idx)))
            return
        for layer in range(self.num_layers):
            src_layer = host.layer_page_view(layer)
            hstage = self._staging((2, n, src_layer.shape[2]))
            self._copy_shared(gather, as_numpy_bytes(src_layer)[None], as_numpy_bytes(hstage)[None])
            with self._stream_ctx():
                gstage = hstage.to(dev.device, non_blocking=self.cuda)
                dev.layer_page_view(layer).index_copy_(1, dst_idx, gstage)
                event = self._event()
            self.issued.put(_Issued(job, event, layer=layer, keep=(hstage, gstage, dst_idx)))
        self.issued.put(_Issued(job, _NULL_EVENT))

    # ---------------------------------------------------------------- completer
    def _complete_loop(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device.device)
        failed: Job | None = None
        while True:
            item = self.issued.get()
            if isinstance(item, _Stop):
                self._stop_helper()
                self.bridge.set_result(item.fut, None)
                return
            job = item.job
            if job is failed:
                continue  # the rest of a job that already failed
            try:
                if item.error is not None:
                    raise item.error
                item.event.synchronize()
                if item.finish is not None:
                    item.finish()
                if item.layer is not None:
                    assert job.layer_futs is not None
                    res = self._layer_done(job, item.layer)
                    self.bridge.set_result(job.layer_futs[item.layer], res)
                else:
                    res = self._result(job, time.perf_counter() - job.started)
                    self._finish(job, res, None, [])
            except BaseException as exc:
                failed = job
                self._fail(job, exc)
            finally:
                item.keep = ()
