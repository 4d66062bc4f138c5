"""The threads that execute copies for :class:`asynccache.transfers.engine.CopyEngine`.

* :class:`DirectWorker` (CPU pools): a worker thread (and, for large copies, a helper) copies
  each job's plan straight from source pages into destination pages (numpy slice assignments
  on byte views, one per segment of pages consecutive on both sides).
* :class:`~asynccache.transfers.staged.StagedWorker` (CUDA; also runs on CPU): the pipeline of
  issuer + completer through a fixed staging ring, see :mod:`asynccache.transfers.staged`.

Both post completions through the :class:`LoopBridge` (one thread hop per burst) and retire
jobs in submission order. A failing job fails its own futures with :class:`TransferError`;
the threads keep serving later jobs. A thread that *dies* (a bug outside a job's own error
handling) makes the worker dead: every thread is told to stop and the engine fails every
copy in flight, so no coroutine waits forever on a copy nobody will finish.

The threads are daemons (a copy hung on the device must not keep the process alive), but one
still inside a torch call when the interpreter finalizes aborts the process ("terminate called
without an active exception", exit 134) as it tries to take the GIL back. So at exit, the
workers of engines nobody closed are stopped: their queued copies are dropped and their threads
joined (at most ``EXIT_JOIN_S``) before finalization.

Ordering across jobs (see :mod:`asynccache.transfers.hazards`): a job carries the earlier jobs
whose host pages it conflicts with (``deps``); before it touches host memory the worker waits
until each of them is done with its host side (``host_done``). Before it touches device memory
it waits for the job's ``fences`` (the caller's ``after=``, or the compute stream's event).
"""

from __future__ import annotations

import atexit
import collections
import functools
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from asynccache.errors import TransferError
from asynccache.logs import get_logger
from asynccache.transfers.bridge import Completion, LoopBridge
from asynccache.transfers.chunks import Chunk, SharedChunks, layer_chunks, whole_chunks
from asynccache.transfers.handles import CopyResult
from asynccache.transfers.plan import CopyPlan, as_numpy_bytes, make_plan
from asynccache.transfers.pools import KVPool
from asynccache.transfers.streams import HOST_STREAM

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
    # Events the copy's device work waits for (recorded by the submitter's compute stream, or
    # given as ``after=``); on the CPU the worker blocks on them.
    fences: tuple[Any, ...] = ()
    own_fences: tuple[Any, ...] = ()  # those of ``fences`` the engine recorded (reused)
    # Earlier jobs whose host pages this one reads or writes (see hazards.py).
    deps: tuple[Job, ...] = ()
    # Earlier jobs of the other lane whose device pages this one reads or writes (staged
    # worker with separate lanes only; see hazards.py): waited for until they are settled.
    dev_deps: tuple[Job, ...] = ()
    seq: int = 0
    # Runs on the loop just before ``fut`` resolves (engine bookkeeping: stats, in-flight).
    on_done: Callable[[CopyResult | None, BaseException | None], None] | None = None
    started: float = 0.0
    layers_done: int = 0
    mark: float = 0.0  # when the previous layer was in place (layer durations are deltas)
    host_done: bool = False  # this job no longer reads or writes host memory
    settled: bool = False  # complete (or failed): no longer reads or writes any memory
    # Copies of riders' pools that run right after this one on this worker's thread, each
    # with the rider's own worker (pools, helper, bridge); see CopyEngine._ride.
    riders: tuple[tuple[DirectWorker, Job], ...] = ()
    # Layer-wise loads: device-side readiness of each layer (handles.LayerReadiness).
    ready: Any = None


@dataclass(eq=False, slots=True)
class Stop:
    fut: Any  # resolved once every earlier job has completed (None: stop after a death)


def transfer_error(job: Job, exc: BaseException) -> TransferError:
    if isinstance(exc, TransferError) and "died" in str(exc):
        return exc
    err = TransferError(f"{job.op} copy of {job.num_tokens} tokens failed: {exc!r}")
    err.__cause__ = exc
    return err


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
# At interpreter exit, how long the threads of engines nobody closed get to finish the copy
# they are in (their queued copies are dropped).
EXIT_JOIN_S = 5.0

_started: weakref.WeakSet[WorkerBase] = weakref.WeakSet()


@atexit.register
def _stop_at_exit() -> None:
    """Stop the workers whose threads still run (see the module docstring)."""
    workers = [w for w in list(_started) if any(t.is_alive() for t in w.threads)]
    for w in workers:
        w.abandon(TransferError("the interpreter is exiting: copies not started are dropped"))
    deadline = time.monotonic() + EXIT_JOIN_S
    for w in workers:
        w.join(max(0.0, deadline - time.monotonic()))


class JobQueue:
    """Jobs in submission order for one consuming thread.

    Jobs arrive in batches (one list per loop iteration, see CopyEngine._flush): one wake-up
    of the consuming thread per batch; ``backlog`` (that thread's alone) holds the rest of
    the batch being worked through."""

    def __init__(self) -> None:
        self.batches: queue.SimpleQueue[list[Job] | Stop] = queue.SimpleQueue()
        self.backlog: collections.deque[Job] = collections.deque()

    def put(self, item: list[Job] | Stop) -> None:
        self.batches.put(item)

    def next(self) -> Job | Stop:
        """The next job in submission order (blocks); only the consuming thread calls it."""
        backlog = self.backlog
        if backlog:
            return backlog.popleft()
        item = self.batches.get()
        if isinstance(item, Stop):
            return item
        backlog.extend(item)
        return backlog.popleft()


class WorkerBase:
    """Threads, the helper, ordering waits, completions and death handling."""

    def __init__(self, device: KVPool, host: KVPool, bridge: LoopBridge, name: str,
                 on_death: Callable[[TransferError], None] | None = None) -> None:
        self.device = device
        self.host = host
        self.bridge = bridge
        self.name = name
        self.num_layers = device.shape.num_layers
        self.queues: list[JobQueue] = []  # each consuming thread's jobs (set by the subclass)
        self.threads: list[threading.Thread] = []
        self.on_death = on_death
        # Guards host_done flags, staging slots and ``dead``; notified when any changes.
        self.cv = threading.Condition()
        self.dead: TransferError | None = None
        self._waiting = 0  # threads in wait_deps
        self._half: queue.SimpleQueue[SharedChunks | None] = queue.SimpleQueue()

    def start(self) -> None:
        _started.add(self)
        for t in self.threads:
            t.start()

    def _thread(self, target: Callable[[], None], role: str) -> threading.Thread:
        name = f"{self.name}-{role}"

        def run() -> None:
            try:
                self.thread_init()
                target()
            except BaseException as exc:
                self._die(name, exc)

        return threading.Thread(target=run, name=name, daemon=True)

    def thread_init(self) -> None:
        """Called first on every thread (the staged worker sets the CUDA device)."""

    # ---------------------------------------------------------------- death
    def _die(self, thread: str, exc: BaseException) -> None:
        err = TransferError(f"copy thread {thread!r} died: {exc!r}; every copy in flight fails")
        err.__cause__ = exc
        if not self._mark_dead(err):
            return
        _log.error("copy_thread_died", thread=thread, error=repr(exc))
        self._stop_others()
        if self.on_death is not None:
            self.on_death(err)

    def abandon(self, err: TransferError) -> None:
        """Make the worker dead without telling the engine (whose loop may be gone): the
        threads finish the copy they are in, skip the rest and stop."""
        if self._mark_dead(err):
            self._stop_others()

    def _mark_dead(self, err: TransferError) -> bool:
        """Set ``dead`` and wake every waiting thread; False if the worker was dead already
        (its threads were told to stop then)."""
        with self.cv:
            if self.dead is not None:
                return False
            self.dead = err
            self.cv.notify_all()
            return True

    def _stop_others(self) -> None:
        for q in self.queues:
            q.put(Stop(None))
        self._half.put(None)

    def check_alive(self) -> None:
        if self.dead is not None:
            raise self.dead

    # ---------------------------------------------------------------- ordering
    def wait_deps(self, job: Job) -> None:
        """Wait until every earlier job this one conflicts with is done with host memory."""
        if job.deps:
            self._wait_until(job.deps, "host_done")
            job.deps = ()

    def wait_dev_deps(self, job: Job) -> None:
        """Wait until every earlier job of the other lane that reads or writes this one's
        device pages is settled (its device work complete)."""
        if job.dev_deps:
            self._wait_until(job.dev_deps, "settled")
            job.dev_deps = ()

    def _wait_until(self, deps: tuple[Job, ...], flag: str) -> None:
        with self.cv:
            self._waiting += 1
            try:
                while not all(getattr(d, flag) for d in deps):
                    if self.dead is not None:
                        raise self.dead
                    self.cv.wait()
            finally:
                self._waiting -= 1

    def mark_host_done(self, job: Job, settled: bool = False) -> None:
        # Lock-free unless a thread waits: the flag is written before ``_waiting`` is read
        # and a waiter counts itself before it reads the flag (both under the GIL), so one of
        # the two sees the other.
        job.host_done = True
        if settled:
            job.settled = True
        if self._waiting:
            with self.cv:
                self.cv.notify_all()

    # ---------------------------------------------------------------- the helper thread
    def _helper_thread(self) -> threading.Thread:
        return self._thread(self._run_helper, "helper")

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

    def copy_shared(self, plan: CopyPlan, src: np.ndarray, dst: np.ndarray) -> None:
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

    def submit_many(self, jobs: list[Job]) -> None:
        """Hand ``jobs`` over in submission order, with one wake-up of the consuming thread."""
        self.queues[0].put(jobs)

    def stop(self, drained: Any) -> None:
        for q in self.queues:
            q.put(Stop(drained))

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self.threads:
            if t.ident is None:
                continue
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    # ---------------------------------------------------------------- completions
    def result(self, job: Job, duration: float, layer: int | None = None) -> CopyResult:
        nbytes = job.num_bytes if layer is None else job.num_bytes // self.num_layers
        return CopyResult(
            op=job.op,
            num_tokens=job.num_tokens,
            num_bytes=nbytes,
            queued_s=job.started - job.submitted,
            duration_s=duration,
            layer=layer,
        )

    def layer_done(self, job: Job, layer: int) -> CopyResult:
        now = time.perf_counter()
        res = self.result(job, now - job.mark, layer)
        job.mark = now
        job.layers_done = layer + 1
        return res

    def layers_through(self, job: Job, upto: int) -> list[Completion]:
        """Completions of layers ``job.layers_done .. upto - 1``."""
        assert job.layer_futs is not None
        if job.ready is not None:  # in place now (a staged worker said so when it queued them)
            job.ready.queued(upto, None)
        return [(job.layer_futs[layer], self.layer_done(job, layer), None)
                for layer in range(job.layers_done, upto)]

    def finish(
        self, job: Job, res: CopyResult | None, err: BaseException | None, items: list[Completion]
    ) -> None:
        """Post ``items`` then the job's own completion, after its bookkeeping, in one batch."""
        if job.ready is not None and res is not None:  # in place (no-op if said when queued)
            job.ready.queued(job.ready.num_layers, None)
        self.mark_host_done(job, settled=True)
        if job.on_done is not None:
            items.append((None, functools.partial(job.on_done, res, err), None))
        items.append((job.fut, res, err))
        self.bridge.complete_many(items)

    def fail(self, job: Job, exc: BaseException) -> None:
        err = transfer_error(job, exc)
        if job.ready is not None:
            job.ready.fail(err)
        items: list[Completion] = []
        if job.layer_futs is not None:
            items.extend((f, None, err) for f in job.layer_futs[job.layers_done :])
        self.finish(job, None, err, items)
        _log.warning("copy_failed", op=job.op, tokens=job.num_tokens, error=repr(exc))


class DirectWorker(WorkerBase):
    """CPU pools: a worker thread (plus a helper for large copies) copies page to page.

    Each job is planned into segments (:func:`make_plan`) and cut into chunks
    (:mod:`asynccache.transfers.chunks`); the worker and the helper take chunks in order. A
    layer-wise load posts each completed layer group as soon as every chunk up to it is done.
    Jobs run one after the other, so host-page conflicts are ordered by construction; fences
    (``after=``: events of a late stream, say) are waited for on the worker thread.
    """

    def __init__(self, device: KVPool, host: KVPool, bridge: LoopBridge, name: str,
                 on_death: Callable[[TransferError], None] | None = None, **_: Any) -> None:
        super().__init__(device, host, bridge, name, on_death)
        self._dev_np = as_numpy_bytes(device.page_view())
        self._host_np = as_numpy_bytes(host.page_view())
        self._layer_page_bytes = device.page_bytes // self.num_layers
        self.jobs = JobQueue()
        self.queues = [self.jobs]
        self.threads = [self._thread(self._run, "worker"), self._helper_thread()]

    def _run(self) -> None:
        try:
            while True:
                item = self.jobs.next()
                if isinstance(item, Stop):
                    if item.fut is not None:
                        self.bridge.set_result(item.fut, None)
                    return
                if self.dead is not None:
                    continue  # the engine failed it (and its riders' copies) already
                try:
                    self._copy(item)
                except BaseException as exc:  # never let the worker die with jobs queued
                    self.fail(item, exc)
                for worker, job in item.riders:
                    worker.run_riding(job)
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
        for fence in job.fences:
            HOST_STREAM.wait_event(fence)  # the CPU has no copy stream: wait here
        self.wait_deps(job)
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
            items = self.layers_through(job, self.num_layers)
        self.finish(job, self.result(job, time.perf_counter() - start), None, items)

    def run_riding(self, job: Job) -> None:
        """Copy ``job`` (one of this worker's jobs) on the thread of the worker it rides."""
        if self.dead is not None:
            self.fail(job, self.dead)
            return
        try:
            self._copy(job)
        except BaseException as exc:
            self.fail(job, exc)

    def _post_layers(self, job: Job, shared: SharedChunks) -> None:
        """Post the layers completed so far, except the last (it rides with the job)."""
        assert job.layer_futs is not None
        upto = min(shared.completed_layers(self.num_layers), self.num_layers - 1)
        if upto > job.layers_done:
            self.bridge.complete_many(self.layers_through(job, upto))

