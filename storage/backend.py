"""What the built-in backends share: config checks, deadlines, outcomes, metrics and logs.

Each page of a call ends with one *outcome*: ``ok``, ``miss`` (not stored) or a fault reason
from :data:`asynccache.storage.metrics.FAULT_REASONS`. :meth:`BackendBase._account` turns a batch of
outcomes into metrics and one structlog event per batch with faults (corrupt objects get an
event each, they are rare and worth a look).
"""

from __future__ import annotations

import errno
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry

from asynccache.errors import ClosedError, ConfigError
from asynccache.logs import get_logger
from asynccache.storage.base import (
    OBJECT_SUFFIX,
    EvictionListener,
    StorageLayout,
    validate_keys,
)
from asynccache.storage.faults import Fault, FaultHook
from asynccache.storage.metrics import StorageMetrics
from asynccache.storage.pageformat import PageMac

__all__ = ["MISS", "OK", "PRESENT", "BackendBase", "EvictionListener", "os_error_reason"]

#: Why a backend dropped pages (``stats()["removed"]``).
REMOVAL_CAUSES = ("capacity", "no_space", "corrupt", "missing", "delete", "clear")

OK = "ok"
MISS = "miss"
PRESENT = "present"  # set of a page already stored: recency refreshed, nothing written

_GIB = float(1 << 30)


def os_error_reason(err: BaseException) -> str:
    """Map an exception raised by raw I/O to a fault reason."""
    if isinstance(err, TimeoutError):
        return "timeout"
    if isinstance(err, ConnectionError):
        return "connection"
    if isinstance(err, PermissionError):
        return "permission"
    if isinstance(err, OSError):
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            return "no_space"
        if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return "permission"
        if err.errno in (errno.ETIMEDOUT,):
            return "timeout"
        return "io_error"
    return "internal"


def positive(name: str, value: float, *, allow_zero: bool = False) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    ok = ok and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name} must be a number {bound}, got {value!r}")
    return float(value)


class BackendBase:
    """Shared machinery of FileBackend and S3Backend (not part of the protocol)."""

    kind: ClassVar[str] = "base"
    #: Whether get_batch / set_batch take a page as ``base.Pieces`` (its bytes apart in the
    #: caller's memory, read and written in place).
    takes_pieces: ClassVar[bool] = False

    def __init__(
        self,
        layout: StorageLayout,
        *,
        timeout_s: float,
        timeout_per_gib_s: float,
        registry: CollectorRegistry | None,
        metrics_label: str | None,
        mac_key: bytes | str | None = None,
    ) -> None:
        if not isinstance(layout, StorageLayout):
            raise ConfigError(f"layout must be a StorageLayout, got {layout!r}")
        self._layout = layout
        #: With a key, pages carry a MAC and live under names tagged with the key's id.
        self._mac = PageMac(mac_key) if mac_key is not None else None
        self._suffix = layout.object_suffix
        if self._mac is not None:
            self._suffix = f".{layout.tag}.mac-{self._mac.key_id}{OBJECT_SUFFIX}"
        self.timeout_s = positive("timeout_s", timeout_s)
        self.timeout_per_gib_s = positive("timeout_per_gib_s", timeout_per_gib_s, allow_zero=True)
        label = metrics_label if metrics_label is not None else self.kind
        if not isinstance(label, str) or not label:
            raise ConfigError(f"metrics_label must be a non-empty string, got {metrics_label!r}")
        self.metrics = StorageMetrics(label, registry)
        self._log = get_logger(f"asynccache.storage.{self.kind}").bind(backend=label)
        self._hook: FaultHook | None = None
        self._closed = False
        self._listeners: list[EvictionListener] = []
        self._removed: Counter[str] = Counter()
        self._listener_errors = 0

    # -- small helpers --------------------------------------------------------------------------

    @property
    def layout(self) -> StorageLayout:
        return self._layout

    def object_name(self, key: str) -> str:
        """The name of page ``key``'s object (file name, or S3 key under the prefix)."""
        return validate_keys([key])[0] + self._suffix

    @property
    def mac_key_id(self) -> str | None:
        """The id of the MAC key (in object names), or None without one."""
        return self._mac.key_id if self._mac is not None else None

    @property
    def registry(self) -> CollectorRegistry:
        return self.metrics.registry

    def set_fault_hook(self, hook: FaultHook | None) -> None:
        """Install (or remove, with None) a fault injector consulted at every raw I/O."""
        self._hook = hook

    def _fault(self, op: str, key: str) -> Fault | None:
        hook = self._hook
        return hook.decide(op, key) if hook is not None else None

    # -- eviction listeners ---------------------------------------------------------------------

    def add_eviction_listener(self, fn: EvictionListener) -> None:
        """Call ``fn(keys)`` whenever pages this backend had are gone.

        ``keys`` is a non-empty list of page keys (as passed to ``set_batch``). It is called on
        the event loop thread, synchronously, before the backend call that found out returns:
        pages evicted for capacity (at ``set_batch``, or when ``start`` trims to the capacity),
        evicted because the filesystem was full, removed as corrupt by ``get_batch``, found
        missing by ``get_batch`` although the backend knew of them (another writer or an
        operator deleted them), removed by ``delete`` or ``clear``. ``fn`` must not block;
        an exception it raises is logged (``storage_listener_error``) and counted, never
        raised. A listener added twice is called twice.
        """
        if not callable(fn):
            raise ConfigError(f"an eviction listener must be callable, got {fn!r}")
        self._listeners.append(fn)

    def remove_eviction_listener(self, fn: EvictionListener) -> None:
        """Stop calling ``fn`` (one registration of it; nothing if it was not added)."""
        for i, listener in enumerate(self._listeners):
            if listener == fn:
                del self._listeners[i]
                return

    def _gone(self, keys: Sequence[str], cause: str) -> None:
        """Tell the listeners that ``keys`` are gone (on the loop thread)."""
        if not keys:
            return
        self._removed[cause] += len(keys)
        for fn in list(self._listeners):
            try:
                fn(list(keys))
            except Exception as exc:
                self._listener_errors += 1
                self._log.exception("storage_listener_error", cause=cause, error=repr(exc))

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{type(self).__name__} is closed")

    def _deadline(self, nbytes: int = 0) -> float:
        """Seconds a call moving ``nbytes`` may take: base + per-GiB allowance."""
        return self.timeout_s + nbytes / _GIB * self.timeout_per_gib_s

    # -- accounting -----------------------------------------------------------------------------

    def _account(
        self,
        op: str,
        keys: Sequence[str],
        outcomes: Sequence[str],
        details: Sequence[str | None],
        sizes: Sequence[int],
        started: float,
    ) -> list[bool]:
        """Record a batch's outcomes; return the per-page booleans."""
        results = [o in (OK, PRESENT) for o in outcomes]
        m = self.metrics
        ok_bytes = sum(s for s, o in zip(sizes, outcomes, strict=True) if o == OK)
        if op == "get":
            m.page(op, "hit", sum(results))
            m.page(op, "miss", len(results) - sum(results))
            m.read(ok_bytes)
        else:
            written = sum(o == OK for o in outcomes)
            m.page(op, "written" if op == "set" else OK, written)
            m.page(op, PRESENT, sum(o == PRESENT for o in outcomes))
            m.page(op, "skipped", len(results) - sum(results))
            if op == "set":
                m.written(ok_bytes)
        faults: Counter[str] = Counter()
        first: dict[str, tuple[str, str | None]] = {}
        for key, outcome, detail in zip(keys, outcomes, details, strict=True):
            if outcome in (OK, MISS, PRESENT):
                continue
            faults[outcome] += 1
            first.setdefault(outcome, (key, detail))
            if outcome in ("corrupt", "partial"):
                self._log.warning(
                    "storage_corrupt_object", op=op, key=key, reason=outcome, detail=detail
                )
        for reason, n in faults.items():
            m.fault(op, reason, n)
        if faults:
            self._log.warning(
                "storage_faults",
                op=op,
                pages=len(outcomes),
                faults=dict(faults),
                first_key={r: k for r, (k, _) in first.items()},
                detail={r: d for r, (_, d) in first.items() if d},
            )
        m.observe(op, time.perf_counter() - started)
        return results

    def _base_stats(self) -> dict[str, Any]:
        return {
            "backend": self.kind,
            "label": self.metrics.label,
            "layout_tag": self._layout.tag,
            "mac_key_id": self.mac_key_id,
            "closed": self._closed,
            **self.metrics.snapshot(),
            "removed": dict(self._removed),
            "listener_errors": self._listener_errors,
        }

    async def __aenter__(self) -> BackendBase:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()  # type: ignore[attr-defined]
