"""The staged copy pipeline (CUDA; on the CPU it runs the same logic with other streams).

A *lane* per direction (D->H: backups; H->D: loads), each with two threads, its own copy
stream and a fixed staging ring, so a load never waits behind a backup (``separate_lanes=
False``: one lane for both); a helper thread shared by the lanes:

* the **issuer** takes its lane's jobs in submission order. It first waits until the other
  lane's earlier copies of the same device pages are settled (:meth:`WorkerBase.wait_dev_deps`;
  see :mod:`~asynccache.transfers.hazards`). For each job it queues the job's fences on
  the copy stream (``copy_stream.wait_event``: the caller's ``after=`` events, or the compute
  stream's event recorded at submit), then cuts the job into pieces that fit one staging slot
  (:func:`~asynccache.transfers.chunks.ring_chunks`) and, per piece, takes a free slot:

  - D->H: queues on the copy stream the index upload, a device gather of the pages into the
    slot's device buffer and a ``non_blocking`` copy into its pinned host buffer, then records
    the slot's event;
  - H->D: first waits until no earlier job still writes the host pages it reads
    (:meth:`WorkerBase.wait_deps`), gathers them on the CPU into the pinned buffer, then queues
    the ``non_blocking`` upload and the scatter (``index_copy_``) into the pool, and records the
    slot's event.

* the **completer** takes the pieces in the same order, waits for each slot's event (a
  blocking-sync event: it sleeps), scatters a D->H piece from the pinned buffer into the host
  pages, gives the slot back, and posts layer and job completions through the bridge;
* a **helper** shares large CPU gathers / scatters (two cores of memcpy in front of the DMA).

Each ring has ``staging_slots`` slots of ``staging_bytes / staging_slots`` bytes (at least one
page of one layer), pinned host + device buffers, index buffers and an event each, allocated
the first time they are needed and reused for good: a 4 GiB retraction goes through the same
few MiB as a one-page backup, and nothing is allocated per job. A slot is reused only after
the completer saw its event (the DMA no longer reads or writes it).

On CPU pools the device buffers and index uploads are skipped (the "device" is host memory);
with :class:`~asynccache.transfers.streams.LateStreams` everything queued on the copy stream
runs late on another thread, which is what the ordering tests use.
"""

from __future__ import annotations

import collections
import functools
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from asynccache.errors import ConfigError, TransferError
from asynccache.transfers import workers
from asynccache.transfers.bridge import Completion, LoopBridge
from asynccache.transfers.chunks import RingChunk, ring_chunks
from asynccache.transfers.dma import (
    SegmentCopier,
    as_words,
    device_alias,
    layer_first_segments,
    page_first_segments,
    prefers_zero_copy,
    run_count,
    zero_copy_views,
)
from asynccache.transfers.plan import as_numpy_bytes, check_pairs, identity_pages, make_plan
from asynccache.transfers.pools import KVPool, register_host_memory
from asynccache.transfers.streams import Streams
from asynccache.transfers.workers import Job, JobQueue, Stop, WorkerBase

#: Bytes of the staging ring of one staged engine (pinned host, and as much on the device).
STAGING_BYTES = 64 << 20
#: Slots in the ring: pieces in flight at once (one being filled while others move).
STAGING_SLOTS = 4
#: A pinned page_first host pool whose pages are at least this big goes the direct way by
#: default (a DMA per run of host pages, or a zero-copy kernel per piece of short runs).
DIRECT_MIN_BYTES = 128 << 10


def wants_direct_dma(direct_dma: bool | None, host: Any, cuda: bool) -> bool:
    """Whether a staged worker moves pages straight between ``host``'s own pinned pages and
    the device side of its ring (no CPU gather / scatter through pinned staging). ``None``: on
    CUDA with a pinned page_first host pool of pages of at least :data:`DIRECT_MIN_BYTES`.
    ``True`` forces it, for either layout (a layer_first pool moved 3x faster that way than
    through staging on an H200, but one GPU run saw a load wait behind a fenced backup there,
    so it is not the default yet; on CPU pools: the same plan with CPU copies, for tests)."""
    if direct_dma is None:
        return (cuda and getattr(host, "layout", None) == "page_first"
                and bool(getattr(host, "pinned", False))
                and int(host.page_bytes) >= DIRECT_MIN_BYTES)
    if not isinstance(direct_dma, bool):
        raise ConfigError(f"direct_dma must be None, True or False, got {direct_dma!r}")
    return direct_dma


def _call(stream: Any, fn: Callable[[], None]) -> None:
    """``Streams.launch`` for work that names its stream itself."""
    fn()


class _Slot:
    """One staging slot: pinned host bytes, device bytes, page indices, an event."""

    __slots__ = ("dev", "event", "host", "idx_dev", "idx_host", "idx_np", "link", "views")

    def __init__(self, host: torch.Tensor, dev: torch.Tensor | None, idx_host: torch.Tensor,
                 idx_dev: torch.Tensor | None, event: Any) -> None:
        self.host = host
        self.dev = dev
        self.idx_host = idx_host
        self.idx_np = idx_host.numpy()
        self.idx_dev = idx_dev
        self.event = event
        self.link: Any = None  # direct DMA: the hand-over between the kernel and copy streams
        # direct: the views of a piece's bytes by (first layer, end layer, pages), built once
        self.views: dict[tuple[int, int, int], tuple[Any, ...]] = {}


class StagingRing:
    """A fixed number of staging slots, taken and given back under the worker's condition."""

    def __init__(self, worker: WorkerBase, streams: Streams, count: int, slot_bytes: int,
                 max_pages: int, device: torch.device, *, direct: bool = False) -> None:
        self.worker = worker
        self.streams = streams
        self.count = count
        self.slot_bytes = slot_bytes
        self.max_pages = max_pages
        self.device = device
        self.cuda = streams.kind == "cuda"
        self.direct = direct  # DMA straight to / from the host pool: no host side, a device side
        self._free: list[_Slot] = []
        self.made = 0  # slots allocated so far (at most ``count``)
        self.in_use = 0
        self.peak_in_use = 0

    @property
    def allocated_bytes(self) -> int:
        """Staging bytes allocated on one side (host, and as much on the device on CUDA; only
        the device side with direct DMA)."""
        return self.made * self.slot_bytes

    def fill(self) -> None:
        """Allocate every slot now. On CUDA the worker does so before its first copy: a
        device allocation or a host registration made while kernels run keeps the commands
        issued after it from running beside them (CUDA's implicit synchronization), so a lazy
        first slot could hold a load behind the model's forward."""
        made = [self._new() for _ in range(self.count - self.made)]
        with self.worker.cv:
            self._free.extend(made)
            self.made += len(made)

    def acquire(self) -> _Slot:
        cv = self.worker.cv
        slot: _Slot | None
        with cv:
            while True:
                if self.worker.dead is not None:
                    raise self.worker.dead
                if self._free:
                    slot = self._free.pop()
                    break
                if self.made < self.count:
                    self.made += 1
                    slot = None
                    break
                cv.wait()
            self.in_use += 1
            self.peak_in_use = max(self.peak_in_use, self.in_use)
        return slot if slot is not None else self._new()

    def release(self, slot: _Slot) -> None:
        with self.worker.cv:
            self._free.append(slot)
            self.in_use -= 1
            self.worker.cv.notify_all()

    def _new(self) -> _Slot:
        host = torch.empty(0 if self.direct else self.slot_bytes, dtype=torch.uint8)
        # direct: the device pages, then the host pages (zero-copy pieces index both)
        idx_len = self.max_pages * (2 if self.direct else 1)
        idx_host = torch.empty(idx_len, dtype=torch.int64)
        if self.cuda:  # exactly these bytes (torch's pinned allocator rounds up)
            register_host_memory(host)
            register_host_memory(idx_host)
        dev = idx_dev = None
        if self.cuda or self.direct:
            dev = torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
        if self.cuda:
            idx_dev = torch.empty(idx_len, dtype=torch.int64, device=self.device)
        slot = _Slot(host, dev, idx_host, idx_dev, self.streams.event())
        if self.direct:
            slot.link = self.streams.event()
        return slot


@dataclass(eq=False, slots=True)
class _Piece:
    """One piece of a job whose device work is queued behind its slot's event."""

    job: Job
    slot: _Slot | None = None
    layers_after: int = -1  # layers complete once this piece is (layer-wise loads)
    finish: Callable[[], None] | None = None  # CPU work after the event (staging -> host)
    last: bool = False  # the job is complete once this piece is
    error: BaseException | None = None


class _Lane:
    """One direction's pipeline: its jobs, issuer -> completer queue, copy stream(s), ring."""

    __slots__ = ("copy_stream", "issued", "jobs", "kernel_stream", "name", "ring")

    def __init__(self, name: str, streams: Streams, ring: StagingRing, direct: bool) -> None:
        self.name = name
        self.jobs = JobQueue()
        self.issued: queue.SimpleQueue[_Piece | Stop] = queue.SimpleQueue()
        self.copy_stream = streams.new_stream()
        # Direct DMA: the gather / scatter kernels run on a stream of their own, so the next
        # piece's kernel overlaps this piece's DMA (one stream would idle the copy engine
        # while the kernel runs). Device pages: every kernel of the lane on it, in submission
        # order; host pages: every DMA of the lane on the copy stream, in submission order.
        self.kernel_stream = streams.new_stream() if direct else None
        self.ring = ring


class StagedWorker(WorkerBase):
    """Issuer + completer per lane, and a helper, over staging rings (see the module
    docstring). ``separate_lanes``: D->H copies go through one lane and H->D copies through
    another (each with its own threads, copy stream and ring), else every copy through one."""

    def __init__(self, device: KVPool, host: KVPool, bridge: LoopBridge, name: str,
                 on_death: Callable[[TransferError], None] | None = None, *,
                 streams: Streams, staging_bytes: int = STAGING_BYTES,
                 staging_slots: int = STAGING_SLOTS, direct_dma: bool | None = None,
                 separate_lanes: bool = True, zero_copy: bool | None = None) -> None:
        super().__init__(device, host, bridge, name, on_death)
        self.streams = streams
        self.cuda = streams.kind == "cuda"
        self.direct = wants_direct_dma(direct_dma, host, self.cuda)
        self._host_np = as_numpy_bytes(host.page_view())
        self._dev_u8 = device.page_view().view(torch.uint8)  # (L, KV, P, page-layer bytes)
        self._kv = int(self._dev_u8.shape[1])
        self._rb = int(self._dev_u8.shape[3])
        self.layer_page_bytes = self._kv * self._rb
        self._page_first = host.layout == "page_first"
        self._host_pages = host.num_pages
        if self.direct:  # the host pool's bytes in memory order
            host_view = host.page_view()  # (L, KV, P, rb); page_first: a strided view of
            if self._page_first:          # (P, L, KV, rb), each page contiguous
                host_view = host_view.permute(2, 0, 1, 3)
            host_bytes = host_view.view(torch.uint8)
            self.copier = SegmentCopier(host_bytes, self.cuda)
            # zero-copy pieces: kernels index the pool's pinned bytes (on CPU pools: the
            # same index ops on the bytes themselves)
            self._host_alias = device_alias(host_bytes) if self.cuda else host_bytes
            if self._host_alias.device != self._dev_u8.device:
                # registered under another device's context: torch places the alias there
                # (the DMAs still work), so this engine's kernels cannot index it
                if zero_copy:
                    raise ConfigError(
                        f"zero_copy=True: the host pool is mapped on "
                        f"{self._host_alias.device}, not on the engine's {self._dev_u8.device}")
                zero_copy = False
        self.zero_copy = zero_copy
        per_slot = max(1, staging_bytes // max(1, staging_slots))
        slot_bytes = max(self.layer_page_bytes, min(per_slot, device.nbytes))

        def lane(lane_name: str) -> _Lane:
            ring = StagingRing(self, streams, max(1, staging_slots), slot_bytes,
                               slot_bytes // self.layer_page_bytes, device.device,
                               direct=self.direct)
            return _Lane(lane_name, streams, ring, self.direct)

        self.lanes = [lane("out"), lane("in")] if separate_lanes else [lane("all")]
        self.queues = [ln.jobs for ln in self.lanes]
        self._stopped = 0  # lanes whose completer stopped
        # Layer readiness events of landed loads, for reuse (deque: thread-safe append / pop).
        self._layer_events: collections.deque[Any] = collections.deque()
        self.threads = [self._helper_thread()]  # shares large staging gathers / scatters
        for ln in self.lanes:
            lane_name = "" if len(self.lanes) == 1 else f"{ln.name}-"
            self.threads += [
                self._thread(functools.partial(self._issue_loop, ln), lane_name + "issuer"),
                self._thread(functools.partial(self._complete_loop, ln), lane_name + "completer"),
            ]

    def thread_init(self) -> None:
        self.streams.thread_init()

    def start(self) -> None:
        if self.cuda:  # no allocation and no kernel loading on the copy path
            for ring in self.rings:
                ring.fill()
            self.warm_up()
        super().start()

    def warm_up(self) -> None:
        """Run the index kernels of the copy paths once, on a few pages and layer ranges,
        before any copy: torch loads CUDA kernels lazily (``CUDA_MODULE_LOADING=LAZY``), and
        loading one may wait for the kernels running on the device, so a first load-back
        issued while the model's forward runs could wait for that forward. On a lane's own
        stream (nothing waits for the model there); reads the pools only (the gathers write a
        slot, the scatters a scratch buffer)."""
        lane = self.lanes[0]
        ring, device = lane.ring, self._dev_u8.device
        layer_ranges = {(0, 1), (0, min(2, self.num_layers)), (0, self.num_layers)}
        shapes = sorted((a, b, n) for a, b in layer_ranges for n in {1, min(ring.max_pages, 17)}
                        if (b - a) * n * self.layer_page_bytes <= ring.slot_bytes)
        slot = ring.acquire()

        def work() -> None:
            for a, b, n in shapes:
                pages = torch.zeros(n, dtype=torch.int64, device=device)
                if self.direct:
                    wpool, wstage, dim, hside, sside, hdim = self._direct_views(slot, a, b, n)
                    torch.index_select(wpool, dim, pages, out=wstage)
                    if self.zero_copy is not False:
                        torch.index_select(hside, hdim, pages, out=sside)
                elif slot.dev is not None:
                    torch.index_select(as_words(self._dev_u8[a:b]), 2, pages,
                                       out=as_words(self._stage(slot.dev, b - a, n)))
            for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
                scratch = torch.zeros((2, 1, 4), dtype=dtype, device=device)
                index = torch.zeros(1, dtype=torch.int64, device=device)
                scratch.index_copy_(0, index, torch.ones((1, 1, 4), dtype=dtype, device=device))
                scratch.index_copy_(2, index, torch.ones((2, 1, 1), dtype=dtype, device=device))

        stream = lane.kernel_stream if lane.kernel_stream is not None else lane.copy_stream
        try:
            self.streams.launch(stream, work)
            stream.record_event().synchronize()
        finally:
            ring.release(slot)

    @property
    def separate_lanes(self) -> bool:
        return len(self.lanes) > 1

    def lane_of(self, op: str) -> _Lane:
        return self.lanes[-1] if op != "d2h" else self.lanes[0]

    @property
    def rings(self) -> list[StagingRing]:
        return [ln.ring for ln in self.lanes]

    def submit_many(self, jobs: list[Job]) -> None:
        if not self.separate_lanes:
            super().submit_many(jobs)
            return
        for ln in self.lanes:
            mine = [j for j in jobs if self.lane_of(j.op) is ln]
            if mine:
                ln.jobs.put(mine)

    def _stop_others(self) -> None:
        super()._stop_others()
        for ln in self.lanes:
            ln.issued.put(Stop(None))

    def _stage(self, buf: torch.Tensor, layers: int, n: int) -> torch.Tensor:
        return buf[: layers * self._kv * n * self._rb].view(layers, self._kv, n, self._rb)

    # ---------------------------------------------------------------- issuer
    def _issue_loop(self, lane: _Lane) -> None:
        while True:
            item = lane.jobs.next()
            if isinstance(item, Stop):
                lane.issued.put(item)
                return
            if self.dead is not None:
                continue
            try:
                self._issue(lane, item)
            except BaseException as exc:
                lane.issued.put(_Piece(item, error=exc, last=True))

    def _issue(self, lane: _Lane, job: Job) -> None:
        job.started = job.mark = time.perf_counter()
        # Validates the pair lists (lengths, repeated destinations) before any work is queued.
        check_pairs(job.src_pages, job.dst_pages)
        for fence in job.fences:  # device work of this job (and later ones) waits for them
            lane.copy_stream.wait_event(fence)
            if lane.kernel_stream is not None:
                lane.kernel_stream.wait_event(fence)
        layerwise = job.layer_futs is not None
        pieces = ring_chunks(int(job.src_pages.shape[0]), self.num_layers,
                             self.layer_page_bytes, lane.ring.slot_bytes, layerwise=layerwise,
                             group_bytes=workers.LAYER_GROUP_BYTES)
        if not pieces:
            lane.issued.put(_Piece(job, last=True))
            return
        h2d = job.op != "d2h"
        # Device pages: copies of one lane are ordered on its streams; the other lane's
        # earlier copies of the same device pages must be settled first.
        self.wait_dev_deps(job)
        if self.direct and not self.separate_lanes:
            # Every host read and write of this engine is a DMA on the one copy stream, in
            # submission order: no host-page hazard is left to wait for.
            job.deps = ()
        elif h2d or self.direct:
            # an earlier D->H may still be writing these host pages (or, by DMA, an earlier
            # H->D of the other lane still reading the pages this D->H writes)
            self.wait_deps(job)
        for i, piece in enumerate(pieces):
            slot = lane.ring.acquire()
            out = _Piece(job, slot, piece[4], last=i == len(pieces) - 1)
            try:
                if self.direct:
                    self._issue_direct(lane, job, slot, piece, h2d)
                elif h2d:
                    self._issue_h2d(lane, job, slot, piece)
                else:
                    out.finish = self._issue_d2h(lane, job, slot, piece)
            except BaseException as exc:
                out.error, out.last = exc, True
                lane.issued.put(out)  # the completer syncs the slot, gives it back, fails the job
                return
            upto = out.layers_after if layerwise else (1 if out.last else 0)
            if job.ready is not None and upto > 0:
                # the layers' (a whole load's) device work is queued: a forward may wait for
                # it on the device
                try:
                    done = self._layer_events.pop()
                except IndexError:
                    done = self.streams.event()
                done.record(lane.kernel_stream if self.direct else lane.copy_stream)
                job.ready.queued(upto, done)
            lane.issued.put(out)
        if h2d and not self.direct:
            self.mark_host_done(job)  # every host page is in staging now

    def _issue_direct(self, lane: _Lane, job: Job, slot: _Slot, piece: RingChunk,
                      h2d: bool) -> None:
        """Queue one piece that moves by DMA straight between the pinned host pool and the
        slot's device buffer, which holds the piece in the host pool's own order -- page-major
        ``(n, layers, KV, rb)`` for a page_first pool, ``(layers, KV, n, rb)`` for a layer_first
        one -- so that every run of consecutive host pages is one (2D) copy
        (:mod:`~asynccache.transfers.dma`); the device pool side is one gather (D->H) or
        scatter (H->D) kernel between the pool and that buffer."""
        a, b, lo, hi, _ = piece
        n = hi - lo
        dev_pages, host_pages = ((job.dst_pages, job.src_pages) if h2d
                                 else (job.src_pages, job.dst_pages))
        dev_pages, host_pages = dev_pages[lo:hi], host_pages[lo:hi]
        wpool, wstage, dim, hside, sside, hdim = self._direct_views(slot, a, b, n)
        zero_copy = self.zero_copy
        if zero_copy is None:
            nbytes = n * (b - a) * self.layer_page_bytes
            zero_copy = prefers_zero_copy(run_count(host_pages), nbytes)
        segs: list[Any] = []
        if not zero_copy:
            if self._page_first:
                segs = page_first_segments(host_pages, (a, b), self.num_layers,
                                           self.layer_page_bytes)
            else:
                segs = layer_first_segments(host_pages, (a, b), self._kv, self._rb,
                                            self._host_pages)
        flat, copier, stream = slot.dev, self.copier, lane.copy_stream
        assert flat is not None
        pinned_idx: torch.Tensor | None = None  # CUDA: the indices to upload into idx_all
        if self.cuda:
            assert slot.idx_dev is not None
            m = 2 * n if zero_copy else n
            slot.idx_np[:n] = dev_pages
            if zero_copy:
                slot.idx_np[n:m] = host_pages
            idx_all, pinned_idx = slot.idx_dev[:m], slot.idx_host[:m]
            idx, hidx = idx_all[:n], idx_all[n:]
        else:
            idx, hidx = torch.from_numpy(dev_pages), torch.from_numpy(host_pages)

        def upload() -> None:  # the first stream of the piece brings the indices over
            if pinned_idx is not None:
                idx_all.copy_(pinned_idx, non_blocking=True)

        def device_side() -> None:
            if h2d:
                wpool.index_copy_(dim, idx, wstage)
            else:
                torch.index_select(wpool, dim, idx, out=wstage)

        if zero_copy:
            def link_side() -> None:
                if h2d:
                    torch.index_select(hside, hdim, hidx, out=sside)
                else:
                    hside.index_copy_(hdim, hidx, sside)
        else:
            def link_side() -> None:
                copier.copy(segs, flat, not h2d, stream)

        # raw DMAs name their stream: no current-stream switch around them
        on_stream = self.streams.launch if zero_copy or not copier.raw else _call

        kernels, link = lane.kernel_stream, slot.link
        assert kernels is not None
        def upload_and(then: Callable[[], None]) -> Callable[[], None]:
            def both() -> None:
                upload()
                then()
            return both

        if h2d:  # into the slot over the link, then the scatter; free after the scatter
            if zero_copy:
                self.streams.launch(stream, upload_and(link_side))
            else:  # the upload on the kernel stream, which waits for the DMA anyway
                self.streams.launch(kernels, upload)
                on_stream(stream, link_side)
            link.record(stream)
            kernels.wait_event(link)
            self.streams.launch(kernels, device_side)
            slot.event.record(kernels)
        else:  # the gather, then out of the slot over the link; free after that
            self.streams.launch(kernels, upload_and(device_side))
            link.record(kernels)
            stream.wait_event(link)
            on_stream(stream, link_side)
            slot.event.record(stream)

    def _direct_views(self, slot: _Slot, a: int, b: int, n: int) -> tuple[Any, ...]:
        """(pool words, slot words, pool page dim, zero-copy host side, slot side, host page
        dim) of a direct piece of layers ``[a, b)`` x ``n`` pages in ``slot``:
        built once per shape and slot (views cost microseconds each, a piece needs seven)."""
        views = slot.views.get((a, b, n))
        if views is not None:
            return views
        assert slot.dev is not None
        if self._page_first:
            stage = slot.dev[: n * (b - a) * self.layer_page_bytes].view(n, b - a, self._kv,
                                                                         self._rb)
            pool = self._dev_u8[a:b].permute(2, 0, 1, 3)  # (P, layers, KV, rb), strided
            dim = 0
        else:
            stage = self._stage(slot.dev, b - a, n)  # (layers, KV, n, rb)
            pool = self._dev_u8[a:b]
            dim = 2
        hside, sside, hdim = zero_copy_views(self._host_alias, stage, self._page_first,
                                             (a, b), self._kv, self._rb)
        views = (as_words(pool), as_words(stage), dim, hside, sside, hdim)
        if len(slot.views) >= 64:  # many copy sizes: start over rather than grow
            slot.views.clear()
        slot.views[(a, b, n)] = views
        return views

    def _issue_d2h(self, lane: _Lane, job: Job, slot: _Slot,
                   piece: RingChunk) -> Callable[[], None]:
        a, b, lo, hi, _ = piece
        n = hi - lo
        src_pages = job.src_pages[lo:hi]
        hstage = self._stage(slot.host, b - a, n)
        pool = self._dev_u8[a:b]
        if self.cuda:
            assert slot.dev is not None and slot.idx_dev is not None
            slot.idx_np[:n] = src_pages
            idx_h, idx_d = slot.idx_host[:n], slot.idx_dev[:n]
            dstage = self._stage(slot.dev, b - a, n)

            def work() -> None:
                idx_d.copy_(idx_h, non_blocking=True)
                torch.index_select(as_words(pool), 2, idx_d, out=as_words(dstage))
                hstage.copy_(dstage, non_blocking=True)
        else:
            idx = torch.from_numpy(src_pages)

            def work() -> None:
                torch.index_select(pool, 2, idx, out=hstage)

        self.streams.launch(lane.copy_stream, work)
        slot.event.record(lane.copy_stream)
        dst_pages = job.dst_pages[lo:hi]
        host = self._host_np[a:b]

        def finish() -> None:
            self.copy_shared(make_plan(identity_pages(n), dst_pages), as_numpy_bytes(hstage),
                             host)

        return finish

    def _issue_h2d(self, lane: _Lane, job: Job, slot: _Slot, piece: RingChunk) -> None:
        a, b, lo, hi, _ = piece
        n = hi - lo
        hstage = self._stage(slot.host, b - a, n)
        self.copy_shared(make_plan(job.src_pages[lo:hi], identity_pages(n)), self._host_np[a:b],
                         as_numpy_bytes(hstage))
        dst_pages = job.dst_pages[lo:hi]
        pool = self._dev_u8[a:b]
        if self.cuda:
            assert slot.dev is not None and slot.idx_dev is not None
            slot.idx_np[:n] = dst_pages
            idx_h, idx_d = slot.idx_host[:n], slot.idx_dev[:n]
            dstage = self._stage(slot.dev, b - a, n)

            def work() -> None:
                idx_d.copy_(idx_h, non_blocking=True)
                dstage.copy_(hstage, non_blocking=True)
                as_words(pool).index_copy_(2, idx_d, as_words(dstage))
        else:
            idx = torch.from_numpy(dst_pages)

            def work() -> None:
                pool.index_copy_(2, idx, hstage)

        self.streams.launch(lane.copy_stream, work)
        slot.event.record(lane.copy_stream)

    # ---------------------------------------------------------------- completer
    def _complete_loop(self, lane: _Lane) -> None:
        failed: Job | None = None
        while True:
            item = lane.issued.get()
            if isinstance(item, Stop):
                with self.cv:
                    self._stopped += 1
                    last = self._stopped == len(self.lanes)
                if last:  # every earlier job of every lane has completed
                    self._stop_helper()
                    if item.fut is not None:
                        self.bridge.set_result(item.fut, None)
                return
            job = item.job
            try:
                if item.slot is not None:
                    item.slot.event.synchronize()
                if job is failed or self.dead is not None:
                    continue  # the rest of a job that already failed
                if item.error is not None:
                    raise item.error
                if item.finish is not None:
                    self.wait_deps(job)  # earlier copies that read / write these host pages
                    item.finish()
                if item.slot is not None:  # free before the completion is posted
                    lane.ring.release(item.slot)
                    item.slot = None
                if item.last:
                    items: list[Completion] = []
                    if job.layer_futs is not None:
                        items = self.layers_through(job, self.num_layers)
                    if job.ready is not None:  # every layer's device work is complete
                        self._layer_events.extend(job.ready.retire())
                    self.finish(job, self.result(job, time.perf_counter() - job.started), None,
                                items)
                elif item.layers_after > job.layers_done:
                    self.bridge.complete_many(self.layers_through(job, item.layers_after))
            except BaseException as exc:
                failed = job
                self.fail(job, exc)
            finally:
                if item.slot is not None:
                    lane.ring.release(item.slot)


def staging_peak(worker: Any) -> tuple[int, int]:
    """(slots allocated, bytes allocated) of a staged worker's rings, (0, 0) otherwise."""
    rings = getattr(worker, "rings", ())
    return sum(r.made for r in rings), sum(r.allocated_bytes for r in rings)

