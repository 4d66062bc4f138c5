"""Prometheus metrics and plain counters of one storage backend instance.

Metric families are created once per CollectorRegistry and shared by every backend that
registers there; the ``backend`` label tells instances apart (``file``, ``s3`` or the
``metrics_label`` a user chose). Without a registry, each backend gets a private one.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PromCounter

__all__ = ["FAULT_REASONS", "StorageMetrics"]

#: Every reason a page can fail with (label values of ``asynccache_storage_faults_total``).
FAULT_REASONS = (
    "io_error",  # EIO and other OS errors
    "no_space",  # ENOSPC / EDQUOT
    "timeout",  # the call's deadline passed
    "corrupt",  # checksum / header / name mismatch
    "partial",  # an object shorter (or longer) than its header says
    "size_mismatch",  # a sound object whose length differs from the caller's buffer
    "permission",  # credentials rejected, EACCES
    "connection",  # connection refused / reset / dropped
    "unavailable",  # too many stuck calls: failing fast until they drain
    "quarantined",  # a read of this page is stuck: an immediate miss until it returns
    "capacity",  # the page does not fit in the capacity bound
    "internal",  # a bug: logged with a traceback
)

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


@dataclass
class _Families:
    pages: PromCounter
    bytes: PromCounter
    faults: PromCounter
    evictions: PromCounter
    no_space_retries: PromCounter
    seconds: Histogram
    used_bytes: Gauge
    objects: Gauge


_families: weakref.WeakKeyDictionary[CollectorRegistry, _Families] = weakref.WeakKeyDictionary()
_families_lock = threading.Lock()


def _families_for(registry: CollectorRegistry) -> _Families:
    with _families_lock:
        fam = _families.get(registry)
        if fam is None:
            fam = _Families(
                pages=PromCounter(
                    "asynccache_storage_pages",
                    "Pages per storage operation and outcome",
                    ["backend", "op", "outcome"],
                    registry=registry,
                ),
                bytes=PromCounter(
                    "asynccache_storage_bytes",
                    "Payload bytes moved to or from storage",
                    ["backend", "direction"],
                    registry=registry,
                ),
                faults=PromCounter(
                    "asynccache_storage_faults",
                    "Pages degraded to a miss or a skipped write, by reason",
                    ["backend", "op", "reason"],
                    registry=registry,
                ),
                evictions=PromCounter(
                    "asynccache_storage_evictions",
                    "Objects evicted by the capacity bound",
                    ["backend"],
                    registry=registry,
                ),
                no_space_retries=PromCounter(
                    "asynccache_storage_no_space_retries",
                    "Pages written again after the filesystem was full (ENOSPC) and least "
                    "recently used objects were evicted to make room",
                    ["backend"],
                    registry=registry,
                ),
                seconds=Histogram(
                    "asynccache_storage_op_seconds",
                    "Wall time of one backend call",
                    ["backend", "op"],
                    buckets=_LATENCY_BUCKETS,
                    registry=registry,
                ),
                used_bytes=Gauge(
                    "asynccache_storage_used_bytes",
                    "Bytes of objects this backend knows of",
                    ["backend"],
                    registry=registry,
                ),
                objects=Gauge(
                    "asynccache_storage_objects",
                    "Objects this backend knows of",
                    ["backend"],
                    registry=registry,
                ),
            )
            _families[registry] = fam
        return fam


class StorageMetrics:
    """Metrics of one backend: Prometheus families plus plain counters for ``stats()``.

    Only the event loop thread updates it.
    """

    def __init__(self, label: str, registry: CollectorRegistry | None = None) -> None:
        self.label = label
        self.registry = registry if registry is not None else CollectorRegistry()
        self._fam = _families_for(self.registry)
        self.pages: Counter[str] = Counter()  # "<op>.<outcome>"
        self.faults: Counter[str] = Counter()  # "<op>.<reason>"
        self.bytes_read = 0
        self.bytes_written = 0
        self.evictions = 0
        self.no_space_retries = 0

    def page(self, op: str, outcome: str, n: int = 1) -> None:
        if n:
            self.pages[f"{op}.{outcome}"] += n
            self._fam.pages.labels(self.label, op, outcome).inc(n)

    def fault(self, op: str, reason: str, n: int = 1) -> None:
        if n:
            self.faults[f"{op}.{reason}"] += n
            self._fam.faults.labels(self.label, op, reason).inc(n)

    def read(self, nbytes: int) -> None:
        if nbytes:
            self.bytes_read += nbytes
            self._fam.bytes.labels(self.label, "read").inc(nbytes)

    def written(self, nbytes: int) -> None:
        if nbytes:
            self.bytes_written += nbytes
            self._fam.bytes.labels(self.label, "write").inc(nbytes)

    def evicted(self, n: int) -> None:
        if n:
            self.evictions += n
            self._fam.evictions.labels(self.label).inc(n)

    def no_space_retry(self, n: int) -> None:
        if n:
            self.no_space_retries += n
            self._fam.no_space_retries.labels(self.label).inc(n)

    def observe(self, op: str, seconds: float) -> None:
        self._fam.seconds.labels(self.label, op).observe(seconds)

    def set_usage(self, used_bytes: int, objects: int) -> None:
        self._fam.used_bytes.labels(self.label).set(used_bytes)
        self._fam.objects.labels(self.label).set(objects)

    def snapshot(self) -> dict[str, Any]:
        return {
            "pages": dict(self.pages),
            "faults": dict(self.faults),
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "evictions": self.evictions,
        }
