"""``faults(backend, ...)``: wrap a storage backend so that it fails the way real storage does.

Backends with a fault hook (``FileBackend``, ``S3Backend``: ``set_fault_hook``) get
:class:`asynccache.storage.faults.FaultInjectingBackend`: faults strike their raw I/O, *below* the page
format, so the backend's checksums and degrade paths are what the test exercises (a flipped
byte is caught by the checksum and served as a miss).

Any other object implementing the :class:`storage.StorageBackend` protocol (your own backend)
gets the same rules applied at the protocol level: ``EIO`` / ``ENOSPC`` / ``DROP`` turn pages
into misses / skipped writes (and truncate ``exists_prefix``), ``DELAY`` stalls the call, and
``FLIP_BYTES`` corrupts a page *after* the backend read it (or before it writes it) and still
reports success -- a backend that silently serves wrong data, which only a bit-exact check
of the served KV (``asynccache_kv.check``) catches. ``SHORT_READ`` and ``PARTIAL_WRITE`` need
the raw-I/O hook.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import anyio

from asynccache.storage.base import (
    EvictionListener,
    StorageBackend,
    StorageLayout,
    listen_for_evictions,
    readable_view,
    stop_listening,
    writable_view,
)
from asynccache.storage.faults import (
    FaultHook,
    FaultInjectingBackend,
    FaultKind,
    FaultRule,
    flip_byte,
)

__all__ = ["ProtocolFaultAdapter", "faults"]

_FAIL = frozenset({FaultKind.EIO, FaultKind.ENOSPC, FaultKind.DROP})
_PROTOCOL_KINDS = _FAIL | {FaultKind.DELAY, FaultKind.FLIP_BYTES}


def _rule(spec: FaultRule | FaultKind | str, *, rate: float, ops: Iterable[str] | None,
          keys: Iterable[str] | None, after: int, times: int | None,
          delay_s: float) -> FaultRule:
    if isinstance(spec, FaultRule):
        return spec
    try:
        kind = FaultKind(spec)
    except ValueError:
        raise ValueError(
            f"unknown fault kind {spec!r}; choose one of {[k.value for k in FaultKind]}"
        ) from None
    return FaultRule(
        kind, rate=rate, ops=frozenset(ops) if ops is not None else None,
        keys=frozenset(keys) if keys is not None else None, after=after, times=times,
        delay_s=delay_s,
    )


def faults(
    backend: Any,
    *rules: FaultRule | FaultKind | str,
    rate: float = 1.0,
    ops: Iterable[str] | None = None,
    keys: Iterable[str] | None = None,
    after: int = 0,
    times: int | None = None,
    delay_s: float = 0.05,
    seed: int = 0,
) -> FaultInjectingBackend:
    """Wrap ``backend`` so that it injects faults; attach the wrapper to the cache instead.

    ``rules``: :class:`~asynccache.storage.faults.FaultRule` objects, or fault kinds (``"eio"``,
    ``FaultKind.DELAY``...) made into rules with the keyword arguments (``rate``, ``ops`` of
    ``read`` / ``write`` / ``exists`` / ``delete``, ``keys``, ``after``, ``times``,
    ``delay_s``). More rules can be added later (``wrapper.add_rule``), all removed with
    ``wrapper.clear_rules()``; ``wrapper.injected`` counts what fired. Closing the wrapper
    closes ``backend``.

    >>> flaky = faults(backend, "eio", ops={"read"}, rate=0.3)
    >>> cache.attach_storage(flaky, StoragePolicy(prefetch_threshold=0))
    """
    made = [_rule(r, rate=rate, ops=ops, keys=keys, after=after, times=times, delay_s=delay_s)
            for r in rules]
    if callable(getattr(backend, "set_fault_hook", None)):
        return FaultInjectingBackend(backend, made, seed=seed)
    for rule in made:
        if rule.kind not in _PROTOCOL_KINDS:
            raise ValueError(
                f"{type(backend).__name__} has no set_fault_hook(): {rule.kind.value} faults need "
                f"raw-I/O access; at the protocol level only "
                f"{sorted(k.value for k in _PROTOCOL_KINDS)} can be injected"
            )
    return FaultInjectingBackend(ProtocolFaultAdapter(backend), made, seed=seed)


class ProtocolFaultAdapter:
    """Gives any protocol backend a fault hook, applied per page around its calls."""

    def __init__(self, inner: StorageBackend) -> None:
        self.inner = inner
        self._hook: FaultHook | None = None

    def set_fault_hook(self, hook: FaultHook | None) -> None:
        self._hook = hook

    @property
    def layout(self) -> StorageLayout:
        return self.inner.layout

    async def _decide(self, op: str, keys: Sequence[str]) -> list[FaultKind | None]:
        """The fault of each key (delays are served here, at once, like a slow device)."""
        hook = self._hook
        kinds: list[FaultKind | None] = []
        delay = 0.0
        for key in keys:
            fault = hook.decide(op, key) if hook is not None else None
            if fault is not None and fault.kind is FaultKind.DELAY:
                delay = max(delay, fault.delay_s)
                fault = None
            kinds.append(fault.kind if fault is not None else None)
        if delay:
            await anyio.sleep(delay)
        return kinds

    async def exists_prefix(self, keys: Sequence[str]) -> int:
        kinds = await self._decide("exists", keys)
        upto = next((i for i, k in enumerate(kinds) if k in _FAIL), len(kinds))
        return await self.inner.exists_prefix(list(keys)[:upto]) if upto else 0

    async def get_batch(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        keys, buffers = list(keys), list(buffers)
        kinds = await self._decide("read", keys)
        todo = [i for i, k in enumerate(kinds) if k not in _FAIL]
        out = [False] * len(keys)
        if todo:
            got = await self.inner.get_batch([keys[i] for i in todo], [buffers[i] for i in todo])
            for i, ok in zip(todo, got, strict=True):
                out[i] = ok
                if ok and kinds[i] is FaultKind.FLIP_BYTES:
                    flip_byte(writable_view(buffers[i], i), 0.5)
        return out

    async def set_batch(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        keys, buffers = list(keys), list(buffers)
        kinds = await self._decide("write", keys)
        todo = [i for i, k in enumerate(kinds) if k not in _FAIL]
        out = [False] * len(keys)
        if todo:
            bufs: list[Any] = []
            for i in todo:
                if kinds[i] is FaultKind.FLIP_BYTES:
                    bad = bytearray(readable_view(buffers[i], i))
                    flip_byte(bad, 0.5)
                    bufs.append(bad)
                else:
                    bufs.append(buffers[i])
            got = await self.inner.set_batch([keys[i] for i in todo], bufs)
            for i, ok in zip(todo, got, strict=True):
                out[i] = ok
        return out

    async def delete(self, keys: Sequence[str]) -> int:
        keys = list(keys)
        kinds = await self._decide("delete", keys)
        todo = [k for k, kind in zip(keys, kinds, strict=True) if kind not in _FAIL]
        return await self.inner.delete(todo) if todo else 0

    async def clear(self) -> int:
        return await self.inner.clear()

    def add_eviction_listener(self, fn: EvictionListener) -> None:
        listen_for_evictions(self.inner, fn)

    def remove_eviction_listener(self, fn: EvictionListener) -> None:
        stop_listening(self.inner, fn)

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()

    async def aclose(self) -> None:
        await self.inner.aclose()
