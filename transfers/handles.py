"""Awaitable handles returned by the copy engine's ``submit_*`` methods.

Awaiting a handle never cancels the copy: every await goes through ``asyncio.shield``, so a
cancelled awaiter only stops waiting. The copy completes, and the handle resolves for every
other awaiter (typically the owner of the slots, which frees them when it is safe).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from asynccache.errors import InvalidInputError, TransferError


@dataclass(frozen=True, slots=True)
class CopyResult:
    """What one copy (or one layer of a layer-wise copy) moved, and how long it took."""

    op: str  # "d2h", "h2d" or "h2d_layerwise"
    num_tokens: int
    num_bytes: int
    queued_s: float  # submission -> the worker started the copy
    duration_s: float  # start -> data in place (CUDA: issue -> event complete)
    layer: int | None = None  # the layer, for one layer of a layer-wise copy

    @property
    def throughput_bps(self) -> float:
        return self.num_bytes / self.duration_s if self.duration_s > 0 else float("inf")


def _await_shielded(fut: asyncio.Future[Any]) -> Generator[Any, None, Any]:
    if not fut.done():
        yield from asyncio.shield(fut)
    return fut.result()


async def wait_all(handles: Sequence[CopyHandle]) -> None:
    """Wait until every one of ``handles`` has finished, failed ones included (their errors
    are not raised), and the done-callbacks added before this call have run (a handle that
    finished in this loop iteration has them still queued: this yields once for them).
    Cancelling the waiter cancels no copy. One wake-up for all: no task or shield per handle."""
    if not handles:
        return
    futs = [h._fut for h in handles if not h._fut.done()]
    if futs:
        await asyncio.wait(futs)  # wakes up after the callbacks added before its own
    else:
        await asyncio.sleep(0)


class Awaitable:
    """A reusable, cancellation-safe awaitable over one future (awaiting it is optional)."""

    __slots__ = ("_fut",)

    def __init__(self, fut: asyncio.Future[Any]) -> None:
        self._fut = fut

    def __await__(self) -> Generator[Any, None, Any]:
        return _await_shielded(self._fut)

    @property
    def finished(self) -> bool:
        return self._fut.done()


class CopyHandle:
    """One submitted copy. ``await handle`` (or ``await handle.done()``) -> :class:`CopyResult`.

    ``src_indices`` / ``dst_indices`` are the slot indices as submitted (numpy int64).
    """

    __slots__ = ("_fut", "_ready", "dst_indices", "num_bytes", "num_tokens", "op",
                 "src_indices")

    def __init__(
        self,
        op: str,
        fut: asyncio.Future[Any],
        src_indices: np.ndarray,
        dst_indices: np.ndarray,
        num_bytes: int,
        ready: LayerReadiness | None = None,
    ) -> None:
        self.op = op
        self._fut = fut
        self.src_indices = src_indices
        self.dst_indices = dst_indices
        self.num_tokens = int(src_indices.shape[0])
        self.num_bytes = num_bytes
        self._ready = ready  # H->D copies: device-side readiness (whole copy or per layer)

    def __await__(self) -> Generator[Any, None, CopyResult]:
        return _await_shielded(self._fut)

    def done(self) -> Awaitable:
        """An awaitable that resolves when the whole copy is in place."""
        return Awaitable(self._fut)

    @property
    def finished(self) -> bool:
        """True once the copy completed or failed (non-blocking)."""
        return self._fut.done()

    def result(self) -> CopyResult:
        """The result of a finished copy (raises its error; ``InvalidStateError`` if pending)."""
        res: CopyResult = self._fut.result()
        return res

    def add_done_callback(self, fn: Callable[[CopyHandle], Any]) -> None:
        """Call ``fn(handle)`` on the loop once the copy is finished."""
        self._fut.add_done_callback(lambda _f: fn(self))

    def wait_device(self, stream: Any = None, *, timeout: float | None = None) -> None:
        """Make ``stream`` (default: the current stream) wait *on the device* until the whole
        copy is in place, blocking this thread only until its device work is queued (CUDA;
        CPU pools: until it is in place). H->D copies only; a failed copy raises
        :class:`TransferError`."""
        if self._ready is None:
            raise InvalidInputError(f"this {self.op} copy has no device-side readiness "
                                    "(H->D copies have it)")
        self._ready.wait(self._ready.num_layers - 1, stream, timeout)

    def __repr__(self) -> str:
        state = "finished" if self._fut.done() else "pending"
        return f"<{type(self).__name__} {self.op} tokens={self.num_tokens} {state}>"


class LayerReadiness:
    """Device-side readiness of a layer-wise load's layers (thread-safe).

    The copy worker calls :meth:`queued` as it *queues* each layer's last device work, with an
    event recorded right after it on that work's stream (CUDA), or as each layer lands (CPU
    pools: ``None``, nothing is left to wait for on a device). :meth:`wait` blocks the calling
    thread only until layer ``i`` is queued, then makes ``stream`` wait for the event on the
    device: a forward can queue layer ``i``'s kernels while the layer is still copying. Once
    the load landed, :meth:`retire` hands the events back for reuse (a wait then has nothing
    left to wait for).
    """

    __slots__ = ("_current", "_cv", "_dead", "_error", "_events", "_flush", "queued_layers")

    @property
    def num_layers(self) -> int:
        """Layers of the load (1 for a whole copy: it is ready at once)."""
        return len(self._events)

    def __init__(self, num_layers: int, current: Callable[[], Any], flush: Callable[[], None],
                 dead: Callable[[], BaseException | None]) -> None:
        self._cv = threading.Condition()
        self._events: list[Any] = [None] * num_layers
        self._error: BaseException | None = None
        self._current = current  # the calling thread's current stream
        self._flush = flush  # hands copies held back for a batch to the worker (loop thread)
        self._dead = dead  # the copy threads' death, which fails the load on the loop
        self.queued_layers = 0

    def queued(self, upto: int, event: Any) -> None:
        """Layers ``[queued_layers, upto)`` are queued; ``event`` follows their device work."""
        with self._cv:
            if upto <= self.queued_layers:
                return
            for i in range(self.queued_layers, upto):
                self._events[i] = event
            self.queued_layers = upto
            self._cv.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cv:
            self._error = exc
            self._cv.notify_all()

    def retire(self) -> list[Any]:
        """The load's device work is complete: forget its events and return them (each once)
        for reuse. A stream's ``wait_event`` is queued under the same lock, so an event is
        never recorded again between a waiter reading it and waiting on it."""
        with self._cv:
            events = list({id(e): e for e in self._events if e is not None}.values())
            self._events = [None] * len(self._events)
        return events

    def wait(self, i: int, stream: Any = None, timeout: float | None = None) -> None:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self._events):
            raise InvalidInputError(f"layer {i!r} out of range [0, {len(self._events)})")
        self._flush()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self.queued_layers <= i and self._error is None:
                if (dead := self._dead()) is not None:  # may be the thread failing the load
                    self._error = dead
                    break
                left = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
                if left <= 0:
                    raise TimeoutError(f"layer {i} of the load was not queued within {timeout} s")
                self._cv.wait(left)
            if self.queued_layers <= i:
                assert self._error is not None
                raise TransferError(f"layer {i} of the load failed: {self._error}") \
                    from self._error
            event = self._events[i]
            if event is not None:
                (stream if stream is not None else self._current()).wait_event(event)


class LayerwiseHandle(CopyHandle):
    """A layer-by-layer host -> device copy; ``await handle.layer(i)`` waits for layer ``i``.

    Layers complete in order. ``await handle`` / ``await handle.done()`` wait for all of them.
    """

    __slots__ = ("_layers",)

    def __init__(
        self,
        fut: asyncio.Future[Any],
        layer_futs: list[asyncio.Future[Any]],
        src_indices: np.ndarray,
        dst_indices: np.ndarray,
        num_bytes: int,
        ready: LayerReadiness | None = None,
    ) -> None:
        super().__init__("h2d_layerwise", fut, src_indices, dst_indices, num_bytes, ready)
        self._layers = layer_futs

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def layer(self, i: int) -> Awaitable:
        """An awaitable resolving to the :class:`CopyResult` of layer ``i`` once it is in place."""
        if isinstance(i, bool) or not 0 <= i < len(self._layers):
            raise InvalidInputError(f"layer {i!r} out of range [0, {len(self._layers)})")
        return Awaitable(self._layers[i])

    def layer_finished(self, i: int) -> bool:
        return self._layers[i].done()

    def wait_layer(self, i: int, stream: Any = None, *, timeout: float | None = None) -> None:
        """Make ``stream`` (default: the current stream) wait *on the device* until layer ``i``
        is in place, blocking this thread only until the copy of layer ``i`` is queued (CUDA;
        with CPU pools: until it is in place). For a forward that queues its kernels ahead;
        coroutines ``await layer(i)`` instead. A failed copy raises :class:`TransferError`."""
        if self._ready is None:
            raise InvalidInputError("this load has no device-side layer readiness")
        self._ready.wait(i, stream, timeout)


class GroupHandle(CopyHandle):
    """Several copies of one operation (over several pools: FULL KV, SWA KV, Mamba states,
    sidecars) as one handle: it finishes when every part has, with the first part's error if
    any failed. The first part's indices and the summed bytes describe it."""

    __slots__ = ("parts",)

    def __init__(self, parts: Sequence[CopyHandle]) -> None:
        if not parts:
            raise InvalidInputError("a GroupHandle needs at least one copy")
        fut = _joined(parts)
        first = parts[0]
        super().__init__(first.op, fut, first.src_indices, first.dst_indices,
                         sum(p.num_bytes for p in parts))
        self.parts = tuple(parts)

    def wait_device(self, stream: Any = None, *, timeout: float | None = None) -> None:
        """Every part, see :meth:`CopyHandle.wait_device`."""
        for part in self.parts:
            part.wait_device(stream, timeout=timeout)


COMPONENTS = ("full", "swa", "mamba")


def layer_map(layers: Sequence[str]) -> list[tuple[str, int]]:
    """Each model layer as (component, its index among that component's layers)."""
    if isinstance(layers, str) or not layers:
        raise InvalidInputError(f"a layer map is a non-empty sequence of {list(COMPONENTS)}, "
                                f"got {layers!r}")
    seen = dict.fromkeys(COMPONENTS, 0)
    out = []
    for i, kind in enumerate(layers):
        if kind not in seen:
            raise InvalidInputError(f"layer {i} is {kind!r}; expected one of {list(COMPONENTS)}")
        out.append((kind, seen[kind]))
        seen[kind] += 1
    return out


class LayeredGroup(GroupHandle):
    """A hybrid load: the copies of one load-back by component (``"full"``: the layer-wise KV
    load with its riders; ``"swa"``: the SWA KV, layer-wise; ``"mamba"``: the states, whole),
    waited for by layer.

    ``layers`` (the model's layers in order, each ``"full"``, ``"swa"`` or ``"mamba"``, as
    ``CacheConfig.layer_components``): model layer ``i`` is in place once what it reads is —
    its own layer of its component's load (the k-th ``"full"`` layer is the KV load's layer
    k, likewise for ``"swa"``), or the whole state copy for a ``"mamba"`` layer, or nothing
    when this load does not copy that component. Without ``layers``: layer ``i`` is the KV
    load's layer ``i`` and every other part whole (which needs a ``"full"`` part)."""

    __slots__ = ("_by_name", "_map")

    def __init__(self, parts: Mapping[str, CopyHandle],
                 layers: Sequence[str] | None = None) -> None:
        if not isinstance(parts, Mapping):
            raise InvalidInputError(f"a LayeredGroup's parts are named by component "
                                    f"({list(COMPONENTS)}), got {type(parts).__name__}")
        unknown = sorted(set(parts) - set(COMPONENTS))
        if unknown:
            raise InvalidInputError(f"unknown components {unknown}; parts are named "
                                    f"{list(COMPONENTS)}")
        full = parts.get("full")
        if layers is None and not isinstance(full, LayerwiseHandle):
            raise InvalidInputError("a LayeredGroup without a layer map needs a layer-wise "
                                    "'full' part")
        super().__init__([parts[n] for n in COMPONENTS if n in parts])
        self._by_name = dict(parts)
        self._map: list[tuple[str, int]] | None = None
        if layers is not None:
            self._map = layer_map(layers)
            for name, part in parts.items():
                need = sum(1 for kind, _ in self._map if kind == name)
                if isinstance(part, LayerwiseHandle) and part.num_layers != need:
                    raise InvalidInputError(f"the {name!r} load has {part.num_layers} layers, "
                                            f"the layer map {need}")

    @property
    def kv(self) -> LayerwiseHandle:
        kv = self._by_name.get("full")
        assert isinstance(kv, LayerwiseHandle)
        return kv

    def part(self, name: str) -> CopyHandle | None:
        """The copy of component ``name`` (None: this load does not copy it)."""
        return self._by_name.get(name)

    @property
    def num_layers(self) -> int:
        return len(self._map) if self._map is not None else self.kv.num_layers

    def _needs(self, i: int) -> list[tuple[CopyHandle, int | None]]:
        """What model layer ``i`` waits for: (copy, its layer) pairs, None = the whole copy."""
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers:
            raise InvalidInputError(f"layer {i!r} out of range [0, {self.num_layers})")
        if self._map is None:
            return [(self.kv, i), *((p, None) for p in self.parts if p is not self.kv)]
        kind, k = self._map[i]
        part = self._by_name.get(kind)
        if part is None:
            return []
        return [(part, k if isinstance(part, LayerwiseHandle) else None)]

    def layer(self, i: int) -> Awaitable:
        """An awaitable resolving once model layer ``i`` is in place (the first error of what
        it waits for, if any failed)."""
        futs = [p.layer(k)._fut if isinstance(p, LayerwiseHandle) and k is not None else p._fut
                for p, k in self._needs(i)]
        if not futs:  # nothing of this load is read by that layer
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            futs = [done]
        return Awaitable(futs[0] if len(futs) == 1 else _all_of(futs))

    def wait_layer(self, i: int, stream: Any = None, *, timeout: float | None = None) -> None:
        """Model layer ``i`` on the device (see :meth:`LayerwiseHandle.wait_layer`)."""
        for part, k in self._needs(i):
            if isinstance(part, LayerwiseHandle) and k is not None:
                part.wait_layer(k, stream, timeout=timeout)
            else:
                part.wait_device(stream, timeout=timeout)


class LayerwiseGroup(LayerwiseHandle):
    """A layer-wise load with the copies that ride it (sidecar pools, see
    :mod:`asynccache.transfers.sidecars`): ``layer(i)`` is the first part's layer ``i``;
    ``await`` waits for every part. ``parts[k].layer(j)`` waits for layer ``j`` of a rider."""

    __slots__ = ("parts",)

    def __init__(self, parts: Sequence[LayerwiseHandle]) -> None:
        if not parts:
            raise InvalidInputError("a LayerwiseGroup needs at least one copy")
        first = parts[0]
        super().__init__(_joined(parts), first._layers, first.src_indices, first.dst_indices,
                         sum(p.num_bytes for p in parts), first._ready)
        self.parts = tuple(parts)

    def wait_layer(self, i: int, stream: Any = None, *, timeout: float | None = None) -> None:
        """Layer ``i`` of the first part (the KV) and of every rider that has a layer ``i``
        (a draft model may have fewer layers than the KV), see
        :meth:`LayerwiseHandle.wait_layer`; ``parts[k].wait_layer(j)`` for a rider's own."""
        first, *riders = self.parts
        first.wait_layer(i, stream, timeout=timeout)  # checks i against the KV's layers
        for part in riders:
            if i < part.num_layers:
                part.wait_layer(i, stream, timeout=timeout)

    def wait_device(self, stream: Any = None, *, timeout: float | None = None) -> None:
        for part in self.parts:
            part.wait_device(stream, timeout=timeout)


def _joined(parts: Sequence[CopyHandle]) -> asyncio.Future[Any]:
    """A future resolved once every part finished: the first failed part's error, else one
    result for all (the first part's tokens, the summed bytes, the longest duration)."""
    first = parts[0]

    def combined() -> CopyResult:
        results = [p.result() for p in parts]
        return CopyResult(
            first.op, first.num_tokens, sum(p.num_bytes for p in parts),
            min(r.queued_s for r in results), max(r.duration_s for r in results))

    return _all_of([p._fut for p in parts], combined)


def _all_of(futs: Sequence[asyncio.Future[Any]],
            combined: Callable[[], Any] | None = None) -> asyncio.Future[Any]:
    """A future resolved once every one of ``futs`` is: the first error among them (in
    order), else ``combined()`` (default: the first one's result)."""
    out: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    out.add_done_callback(_retrieve)
    left = [len(futs)]

    def one_done(_f: asyncio.Future[Any]) -> None:
        left[0] -= 1
        if left[0] or out.done():
            return
        for f in futs:
            if f.cancelled():
                out.set_exception(TransferError("a part of the copy was cancelled"))
                return
            if (exc := f.exception()) is not None:
                out.set_exception(exc)
                return
        out.set_result(futs[0].result() if combined is None else combined())

    for f in futs:
        f.add_done_callback(one_done)
    return out


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()
