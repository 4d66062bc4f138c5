"""Fault injection for storage backends: a testing tool for this project and its users.

:class:`FaultInjectingBackend` wraps a real backend (``FileBackend``, ``S3Backend``, or any
backend with a ``set_fault_hook`` method) and makes its raw I/O fail the way real storage
does. The faults are injected *below* the page format, where the real failures happen, so the
backend's own verification and degrade paths are what a test exercises:

=================  =====================================================================
kind               effect at the raw I/O layer
=================  =====================================================================
``EIO``            the read / write / stat / unlink fails with ``OSError(EIO)``
``ENOSPC``         a write fails with ``OSError(ENOSPC)`` half-way (nothing is published)
``PARTIAL_WRITE``  a write "succeeds" but only a prefix reaches storage (a torn write)
``FLIP_BYTES``     one byte of the object is changed, at rest (write) or in flight (read)
``SHORT_READ``     a read returns only a prefix of the object
``DELAY``          the raw operation stalls for ``delay_s`` seconds first
``DROP``           the connection is dropped (``ConnectionResetError``)
=================  =====================================================================

Faults fire by rate (a seeded, per-key deterministic draw) or by explicit schedule
(``keys``, ``after``, ``times``), see :class:`FaultRule`.
"""

from __future__ import annotations

import errno
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

import xxhash

from asynccache.errors import ConfigError
from asynccache.storage.base import (
    EvictionListener,
    StorageBackend,
    StorageLayout,
    listen_for_evictions,
    stop_listening,
)

__all__ = [
    "Fault",
    "FaultHook",
    "FaultInjectingBackend",
    "FaultKind",
    "FaultRule",
    "fault_error",
    "flip_byte",
]


class FaultKind(StrEnum):
    EIO = "eio"
    ENOSPC = "enospc"
    PARTIAL_WRITE = "partial_write"
    FLIP_BYTES = "flip_bytes"
    SHORT_READ = "short_read"
    DELAY = "delay"
    DROP = "drop"


#: Raw operations and the faults that make sense for each.
APPLICABLE: dict[str, frozenset[FaultKind]] = {
    "read": frozenset(
        {FaultKind.EIO, FaultKind.DROP, FaultKind.SHORT_READ, FaultKind.FLIP_BYTES, FaultKind.DELAY}
    ),
    "write": frozenset(
        {
            FaultKind.EIO,
            FaultKind.ENOSPC,
            FaultKind.DROP,
            FaultKind.PARTIAL_WRITE,
            FaultKind.FLIP_BYTES,
            FaultKind.DELAY,
        }
    ),
    "exists": frozenset({FaultKind.EIO, FaultKind.DROP, FaultKind.DELAY}),
    "delete": frozenset({FaultKind.EIO, FaultKind.DROP, FaultKind.DELAY}),
}


@dataclass(frozen=True, slots=True)
class Fault:
    """One decided fault: what, how long (DELAY), and where in the object (flip / cut)."""

    kind: FaultKind
    delay_s: float = 0.0
    position: float = 0.5


@dataclass(frozen=True, slots=True)
class FaultRule:
    """When to inject one kind of fault.

    ``rate``: probability per matching raw operation (a deterministic draw from the seed,
    the op, the key and how often that key was seen). ``ops``: raw operations it applies to
    (default: every one where the kind makes sense). ``keys``: only these page keys.
    ``after``: let that many matching operations pass first. ``times``: inject at most that
    many times. An explicit schedule is ``rate=1.0`` with ``keys`` / ``after`` / ``times``.
    """

    kind: FaultKind
    rate: float = 1.0
    ops: frozenset[str] | None = None
    keys: frozenset[str] | None = None
    after: int = 0
    times: int | None = None
    delay_s: float = 0.05

    def __post_init__(self) -> None:
        if not isinstance(self.kind, FaultKind):
            raise ConfigError(f"FaultRule.kind must be a FaultKind, got {self.kind!r}")
        if not 0.0 <= self.rate <= 1.0:
            raise ConfigError(f"FaultRule.rate must be in [0, 1], got {self.rate!r}")
        if self.ops is not None:
            bad = set(self.ops) - set(APPLICABLE)
            if bad:
                raise ConfigError(f"FaultRule.ops has unknown ops {sorted(bad)}")
            if not any(self.kind in APPLICABLE[op] for op in self.ops):
                raise ConfigError(f"fault {self.kind} applies to none of ops {sorted(self.ops)}")
        if self.after < 0 or (self.times is not None and self.times < 0):
            raise ConfigError(f"FaultRule.after/times must be >= 0, got {self.after}/{self.times}")
        if self.delay_s < 0:
            raise ConfigError(f"FaultRule.delay_s must be >= 0, got {self.delay_s!r}")


class FaultHook(Protocol):
    """What a backend consults at each raw operation (called from any thread)."""

    def decide(self, op: str, key: str) -> Fault | None: ...


def fault_error(kind: FaultKind, what: str) -> OSError:
    """The OSError a real system raises for EIO / ENOSPC / DROP."""
    if kind is FaultKind.ENOSPC:
        return OSError(errno.ENOSPC, f"injected: no space left on device ({what})")
    if kind is FaultKind.DROP:
        return ConnectionResetError(errno.ECONNRESET, f"injected: connection dropped ({what})")
    return OSError(errno.EIO, f"injected: input/output error ({what})")


def flip_byte(view: memoryview | bytearray, position: float) -> None:
    """Change one byte of ``view`` at ``position`` (a fraction of its length)."""
    n = len(view)
    if n:
        i = min(n - 1, int(position * n))
        view[i] ^= 0x5A


class _RuleState:
    __slots__ = ("injected", "seen", "seen_per_key")

    def __init__(self) -> None:
        self.seen = 0
        self.injected = 0
        self.seen_per_key: Counter[tuple[str, str]] = Counter()


class FaultInjectingBackend:
    """A backend that forwards to ``inner`` and injects faults into its raw I/O."""

    def __init__(self, inner: Any, rules: Iterable[FaultRule] = (), *, seed: int = 0) -> None:
        if not callable(getattr(inner, "set_fault_hook", None)):
            raise ConfigError(
                f"{type(inner).__name__} has no set_fault_hook(); FaultInjectingBackend injects "
                "faults below the page format and needs a backend that supports the hook"
            )
        self.inner: StorageBackend = inner
        self.seed = seed
        self._lock = threading.Lock()
        self._rules: list[tuple[FaultRule, _RuleState]] = []
        self.injected: Counter[tuple[str, str]] = Counter()  # (op, kind) -> count
        for rule in rules:
            self.add_rule(rule)
        inner.set_fault_hook(self)

    # -- schedule -----------------------------------------------------------------------------

    def add_rule(self, rule: FaultRule) -> None:
        with self._lock:
            self._rules.append((rule, _RuleState()))

    def clear_rules(self) -> None:
        with self._lock:
            self._rules.clear()

    def decide(self, op: str, key: str) -> Fault | None:
        with self._lock:
            for rule, state in self._rules:
                if rule.kind not in APPLICABLE.get(op, ()):
                    continue
                if rule.ops is not None and op not in rule.ops:
                    continue
                if rule.keys is not None and key not in rule.keys:
                    continue
                state.seen += 1
                nth = state.seen_per_key[(op, key)]
                state.seen_per_key[(op, key)] += 1
                if state.seen <= rule.after:
                    continue
                if rule.times is not None and state.injected >= rule.times:
                    continue
                draw = self._draw(rule, op, key, nth, "rate")
                if rule.rate < 1.0 and draw >= rule.rate:
                    continue
                state.injected += 1
                self.injected[(op, rule.kind.value)] += 1
                return Fault(rule.kind, rule.delay_s, self._draw(rule, op, key, nth, "pos"))
        return None

    def _draw(self, rule: FaultRule, op: str, key: str, nth: int, what: str) -> float:
        h = xxhash.xxh3_64_intdigest(f"{self.seed}:{rule.kind}:{op}:{key}:{nth}:{what}".encode())
        return (h >> 11) / float(1 << 53)

    def injected_total(self) -> int:
        with self._lock:
            return sum(self.injected.values())

    # -- the protocol, forwarded ----------------------------------------------------------------

    @property
    def layout(self) -> StorageLayout:
        return self.inner.layout

    async def exists_prefix(self, keys: Sequence[str]) -> int:
        return await self.inner.exists_prefix(keys)

    async def get_batch(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        return await self.inner.get_batch(keys, buffers)

    async def set_batch(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        return await self.inner.set_batch(keys, buffers)

    async def delete(self, keys: Sequence[str]) -> int:
        return await self.inner.delete(keys)

    async def clear(self) -> int:
        return await self.inner.clear()

    def add_eviction_listener(self, fn: EvictionListener) -> None:
        """Forwarded to the wrapped backend (nothing if it has no listeners)."""
        listen_for_evictions(self.inner, fn)

    def remove_eviction_listener(self, fn: EvictionListener) -> None:
        stop_listening(self.inner, fn)

    def stats(self) -> dict[str, Any]:
        out = dict(self.inner.stats())
        with self._lock:
            out["injected"] = {f"{op}.{kind}": n for (op, kind), n in self.injected.items()}
        return out

    async def aclose(self) -> None:
        self.inner.set_fault_hook(None)  # type: ignore[attr-defined]
        await self.inner.aclose()

    async def __aenter__(self) -> FaultInjectingBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
