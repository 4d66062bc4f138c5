"""Streams and events for the staged copy pipeline: CUDA, the CPU, and a late CPU harness.

The staged worker (:mod:`asynccache.transfers.staged`) speaks to one small interface:

* ``new_stream()`` / ``current()`` / ``use(stream)``: a stream, the calling thread's current
  stream, and a context that makes a stream current (``torch.cuda.stream``);
* ``launch(stream, fn)``: queue device work on ``stream``. On CUDA ``fn`` issues kernels and
  copies under the stream and returns at once (they run later); CPU work in ``fn`` would be
  wrong there, and is wrong here too: the harness runs ``fn`` late, on another thread;
* ``event()``: a reusable blocking event; streams and events have the methods of
  ``torch.cuda.Stream`` / ``torch.cuda.Event`` that the pipeline uses: ``stream.wait_event(e)``,
  ``stream.record_event()``, ``event.record(stream)``, ``event.synchronize()``,
  ``event.query()``.

Three implementations:

* :class:`CudaStreams`: torch's CUDA streams and events (blocking-sync events: a thread
  waiting in ``synchronize()`` sleeps instead of spinning a core).
* :class:`HostStreams`: CPU pools, where nothing is asynchronous: ``launch`` runs ``fn`` now,
  events are complete when recorded, and ``stream.wait_event(e)`` blocks the caller until
  ``e`` completes (a user's event, e.g. a :class:`LateEvent`).
* :class:`LateStreams`: a CPU harness with CUDA's semantics and none of its speed: every
  stream is a thread that runs its work in order, each item after a random delay, so work on
  different streams completes out of order and everything completes *after* the call that
  queued it returned. An ordering bug that CUDA would hide on a fast GPU (a copy not waiting
  for the kernel that writes its source, a CPU read of a buffer before its event) shows up
  as wrong bytes in a CPU test. ``close()`` stops its threads.
"""

from __future__ import annotations

import contextlib
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["CudaStreams", "HostStreams", "LateEvent", "LateStream", "LateStreams", "Streams"]


class Streams:
    """The interface (see the module docstring); a subclass per kind of device."""

    kind = "abstract"
    #: True when work queued with :meth:`launch` runs after ``launch`` returns.
    asynchronous = True

    def new_stream(self) -> Any:
        raise NotImplementedError

    def current(self) -> Any:
        raise NotImplementedError

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        raise NotImplementedError

    def launch(self, stream: Any, fn: Callable[[], None]) -> None:
        raise NotImplementedError

    def event(self) -> Any:
        raise NotImplementedError

    def is_stream(self, obj: Any) -> bool:
        raise NotImplementedError

    def is_event(self, obj: Any) -> bool:
        raise NotImplementedError

    def recorded(self, event: Any) -> bool:
        """False for an event never recorded (waiting on it would order nothing)."""
        return True

    def thread_init(self) -> None:
        """Called first on every copy thread (CUDA: ``set_device``)."""

    def close(self) -> None:
        """Release what the streams hold (the harness's threads)."""


# --------------------------------------------------------------------------------- CUDA
class CudaStreams(Streams):
    """torch's CUDA streams and events on one device."""

    kind = "cuda"

    def __init__(self, device: torch.device | str) -> None:
        device = torch.device(device)
        if device.index is None:  # "cuda": the current device, named (set_device needs one)
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device

    def new_stream(self) -> Any:
        return torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]

    def current(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def launch(self, stream: Any, fn: Callable[[], None]) -> None:
        with torch.cuda.stream(stream):
            fn()

    def event(self) -> Any:
        # blocking: a thread in synchronize() sleeps instead of spinning a core
        return torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]

    def is_stream(self, obj: Any) -> bool:
        return isinstance(obj, torch.cuda.Stream)

    def is_event(self, obj: Any) -> bool:
        return isinstance(obj, torch.cuda.Event)

    def recorded(self, event: Any) -> bool:
        # torch creates the CUDA event lazily, at its first record(): 0 means never recorded,
        # and a stream told to wait for it waits for nothing.
        return bool(getattr(event, "cuda_event", 1))

    def thread_init(self) -> None:
        torch.cuda.set_device(self.device)


# --------------------------------------------------------------------------------- CPU
class _DoneEvent:
    """An event on the CPU: complete as soon as it is recorded."""

    __slots__ = ()

    def record(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


DONE_EVENT = _DoneEvent()


class _HostStream:
    """The CPU's one "stream": work runs when it is issued."""

    __slots__ = ()

    def wait_event(self, event: Any) -> None:
        event.synchronize()  # a user's event (e.g. a LateEvent) may still be pending

    def record_event(self, event: Any = None) -> Any:
        return DONE_EVENT if event is None else event

    def __repr__(self) -> str:
        return "<host stream>"


HOST_STREAM = _HostStream()


class HostStreams(Streams):
    """CPU pools: nothing is asynchronous (see the module docstring)."""

    kind = "host"
    asynchronous = False

    def new_stream(self) -> Any:
        return HOST_STREAM

    def current(self) -> Any:
        return HOST_STREAM

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext(stream)

    def launch(self, stream: Any, fn: Callable[[], None]) -> None:
        fn()

    def event(self) -> Any:
        return DONE_EVENT

    def is_stream(self, obj: Any) -> bool:
        return isinstance(obj, _HostStream | LateStream)

    def is_event(self, obj: Any) -> bool:
        return isinstance(obj, _DoneEvent | LateEvent)


# --------------------------------------------------------------------------------- the harness
class LateEvent:
    """A :class:`LateStreams` event: complete once its stream ran everything queued before the
    last ``record``. ``synchronize()`` blocks until then (and raises the error of a failed item
    of that stream, as CUDA reports a kernel fault at the next synchronisation)."""

    __slots__ = ("_cv", "_done", "_error", "_recorded", "name")

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._cv = threading.Condition()
        self._recorded = 0  # records so far
        self._done = 0  # records completed
        self._error: BaseException | None = None

    @property
    def was_recorded(self) -> bool:
        return self._recorded > 0

    def record(self, stream: LateStream | None = None) -> None:
        if stream is None:
            raise ValueError("LateEvent.record needs the stream")
        stream._record(self)

    def _arm(self) -> int:
        with self._cv:
            self._recorded += 1
            return self._recorded

    def _complete(self, gen: int, error: BaseException | None) -> None:
        with self._cv:
            self._done = max(self._done, gen)
            if error is not None:
                self._error = error
            self._cv.notify_all()

    def query(self) -> bool:
        with self._cv:
            return self._done >= self._recorded

    def synchronize(self) -> None:
        with self._cv:
            want = self._recorded
            while self._done < want:
                self._cv.wait()
            error = self._error
        if error is not None:
            raise RuntimeError(f"late stream work failed: {error!r}") from error

    def __repr__(self) -> str:
        return f"<LateEvent {self.name} {self._done}/{self._recorded}>"


class LateStream:
    """One stream of a :class:`LateStreams`: a thread that runs its items in order, late."""

    def __init__(self, owner: LateStreams, name: str) -> None:
        self.owner = owner
        self.name = name
        self._items: queue.SimpleQueue[tuple[Callable[[], None], bool] | None] = (
            queue.SimpleQueue())
        self._error: BaseException | None = None
        self.ran = 0
        self._thread = threading.Thread(target=self._run, name=f"late-stream-{name}",
                                         daemon=True)
        self._thread.start()

    def _put(self, fn: Callable[[], None], delayed: bool = True) -> None:
        if self.owner.closed:
            raise RuntimeError(f"LateStreams closed: cannot queue on stream {self.name}")
        self._items.put((fn, delayed))

    def _run(self) -> None:
        while True:
            item = self._items.get()
            if item is None:
                return
            fn, delayed = item
            if delayed:
                d = self.owner.delay()
                if d > 0:
                    time.sleep(d)
            try:
                fn()
            except BaseException as exc:  # sticky, like a CUDA fault
                self._error = self._error or exc
            self.ran += 1

    def _record(self, event: LateEvent) -> None:
        gen = event._arm()
        self._put(lambda: event._complete(gen, self._error), delayed=False)

    # torch.cuda.Stream's methods
    def wait_event(self, event: LateEvent) -> None:
        """Later items of this stream wait until ``event`` completes (the caller does not)."""
        if not isinstance(event, LateEvent):
            raise TypeError(f"a LateStream waits for LateEvents, got {event!r}")
        target = event._recorded

        def wait() -> None:
            with event._cv:
                while event._done < target:
                    event._cv.wait()

        self._put(wait, delayed=False)

    def record_event(self, event: LateEvent | None = None) -> LateEvent:
        event = event if event is not None else LateEvent(self.name)
        self._record(event)
        return event

    def synchronize(self) -> None:
        self.record_event().synchronize()

    def query(self) -> bool:
        return self.record_event().query()

    def _stop(self) -> None:
        self._items.put(None)

    def __repr__(self) -> str:
        return f"<LateStream {self.name}>"


class LateStreams(Streams):
    """The late CPU harness (see the module docstring). ``delay_s=(lo, hi)``: each item of a
    stream starts a uniform random delay in ``[lo, hi]`` after the previous one ended."""

    kind = "late"

    def __init__(self, delay_s: tuple[float, float] = (0.0, 0.003), seed: int = 0) -> None:
        lo, hi = delay_s
        if not 0 <= lo <= hi:
            raise ValueError(f"delay_s must be (lo, hi) with 0 <= lo <= hi, got {delay_s!r}")
        self.delay_s = (float(lo), float(hi))
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        self._streams: list[LateStream] = []
        self._local = threading.local()
        self.closed = False
        self.default = self.new_stream("default")

    def delay(self) -> float:
        lo, hi = self.delay_s
        if hi == 0:
            return 0.0
        with self._rng_lock:
            return self._rng.uniform(lo, hi)

    def new_stream(self, name: str | None = None) -> LateStream:
        s = LateStream(self, name or f"s{len(self._streams)}")
        self._streams.append(s)
        return s

    def current(self) -> LateStream:
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else self.default

    @contextlib.contextmanager
    def _use(self, stream: LateStream) -> Iterator[LateStream]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        stack.append(stream)
        try:
            yield stream
        finally:
            stack.pop()

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        if not isinstance(stream, LateStream):
            raise TypeError(f"not a LateStream: {stream!r}")
        return self._use(stream)

    def launch(self, stream: Any, fn: Callable[[], None]) -> None:
        stream._put(fn)

    def event(self) -> LateEvent:
        return LateEvent()

    def is_stream(self, obj: Any) -> bool:
        return isinstance(obj, LateStream)

    def is_event(self, obj: Any) -> bool:
        return isinstance(obj, LateEvent)

    def recorded(self, event: Any) -> bool:
        return bool(event.was_recorded)

    def close(self) -> None:
        """Let every stream finish what it has queued, then stop its thread."""
        if self.closed:
            return
        self.closed = True
        for s in self._streams:
            s._stop()
        for s in self._streams:
            s._thread.join(timeout=10)

    def __enter__(self) -> LateStreams:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
