"""Prometheus metrics of one cache (a registry per cache, so several caches can coexist)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

_DURATION_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0, 5.0)


class CacheMetrics:
    """Counters, histograms and gauges named like the reference's, prefixed ``asynccache_``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.evicted_tokens = Counter("asynccache_evicted_tokens", "Device tokens evicted", registry=r)
        self.eviction_duration = Histogram(
            "asynccache_eviction_duration_seconds", "Duration of one evict call",
            buckets=_DURATION_BUCKETS, registry=r,
        )
        self.load_back_tokens = Counter("asynccache_load_back_tokens", "Tokens loaded H->D", registry=r)
        self.load_back_bytes = Counter("asynccache_load_back_bytes", "Bytes loaded H->D", registry=r)
        self.load_back_duration = Histogram(
            "asynccache_load_back_duration_seconds", "H->D copy duration",
            buckets=_DURATION_BUCKETS, registry=r,
        )
        self.backup_tokens = Counter("asynccache_backup_tokens", "Tokens backed up D->H", registry=r)
        self.backup_bytes = Counter("asynccache_backup_bytes", "Bytes backed up D->H", registry=r)
        self.backup_duration = Histogram(
            "asynccache_backup_duration_seconds", "D->H copy duration",
            buckets=_DURATION_BUCKETS, registry=r,
        )
        self.dropped_tokens = Counter(
            "asynccache_dropped_tokens", "Tokens dropped without a host copy", ["reason"], registry=r
        )
        for reason in ("host_pressure", "backup_failed"):
            self.dropped_tokens.labels(reason=reason)
        self.hybrid_skipped = Counter(
            "asynccache_hybrid_skipped", "Hybrid backups / load-backs skipped as a whole because "
            "a component pool (SWA, Mamba) fell short; swa_window: a buffer-only prefetch fell "
            "back to a shorter prefix because an SWA page of its window was missing", ["op"],
            registry=r
        )
        for op in ("backup", "load_back", "swa_window"):
            self.hybrid_skipped.labels(op=op)
        self.prefetch_component_fallback_tokens = Counter(
            "asynccache_prefetch_component_fallback_tokens",
            "KV tokens a hybrid prefetch gave up because the SWA pages / Mamba state to restore "
            "them were not stored, did not arrive or had no host memory (asynccache/l3/hybrid.py)",
            ["reason"], registry=r,
        )
        for reason in ("not_stored", "host_memory", "stopped", "fault"):
            self.prefetch_component_fallback_tokens.labels(reason=reason)
        self.matched_tokens = Counter("asynccache_matched_tokens", "Tokens asked in match_prefix", registry=r)
        self.hit_tokens = Counter("asynccache_hit_tokens", "Tokens found on device or host", registry=r)
        self.hit_rate = Gauge("asynccache_cache_hit_rate", "Hit tokens / matched tokens", registry=r)
        self.evictable_tokens = Gauge("asynccache_evictable_tokens", "Evictable device tokens", registry=r)
        self.protected_tokens = Gauge("asynccache_protected_tokens", "Locked device tokens", registry=r)
        self.host_used_tokens = Gauge("asynccache_host_used_tokens", "Host tokens in use", registry=r)
        self.host_total_tokens = Gauge("asynccache_host_total_tokens", "Host capacity", registry=r)
        # L3 storage
        self.prefetched_tokens = Counter(
            "asynccache_prefetched_tokens", "Tokens read from storage into host", registry=r)
        self.storage_backup_tokens = Counter(
            "asynccache_storage_backup_tokens", "Tokens written host -> storage", registry=r)
        self.storage_backup_skipped_tokens = Counter(
            "asynccache_storage_backup_skipped_tokens",
            "Tokens not written to storage (reason: exists, failed, circuit_open)",
            ["reason"], registry=r)
        self.storage_write_circuit_opened = Counter(
            "asynccache_storage_write_circuit_opened",
            "Times storage writes were suspended after consecutive failures", registry=r)
        self.storage_hit_tokens = Counter(
            "asynccache_storage_prefetch_hit_tokens", "Tokens found in storage by prefetch queries",
            registry=r)
        self.storage_miss_tokens = Counter(
            "asynccache_storage_prefetch_miss_tokens", "Tokens asked of storage and not found",
            registry=r)
        self.prefetch_outcomes = Counter(
            "asynccache_prefetch_outcomes", "Prefetch attempts by outcome", ["outcome"], registry=r)
        for outcome in ("issued", "declined_too_short", "declined_rate_limited",
                        "declined_unbacked", "revoked_insufficient", "revoked_rate_limited",
                        "revoked_no_host_memory", "completed", "partial", "aborted"):
            self.prefetch_outcomes.labels(outcome=outcome)
        self.prefetch_bandwidth = Histogram(
            "asynccache_prefetch_bandwidth_bytes_per_second", "Storage read bandwidth per prefetch",
            buckets=(1e6, 1e7, 1e8, 5e8, 1e9, 2e9, 5e9, 1e10), registry=r)
        self.storage_backup_bandwidth = Histogram(
            "asynccache_storage_backup_bandwidth_bytes_per_second",
            "Storage write bandwidth per backup batch",
            buckets=(1e6, 1e7, 1e8, 5e8, 1e9, 2e9, 5e9, 1e10), registry=r)

        # buffer-only host mode
        self.buffer_intents = Counter(
            "asynccache_buffer_write_intents",
            "Buffer-only write intents by outcome (queued, staged, covered, stale, backlog, dropped)",
            ["outcome"], registry=r)
        self.buffer_parked_prefetches = Counter(
            "asynccache_buffer_parked_prefetches",
            "Buffer-only prefetches that waited for host staging", registry=r)

    def exposition(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)


class _Labelled(Collector):
    """Several caches' registries as one, each sample labelled ``cache=<name>``."""

    def __init__(self, named: dict[str, CollectorRegistry]) -> None:
        self._named = named

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for name, registry in self._named.items():
            for metric in registry.collect():
                out = merged.get(metric.name)
                if out is None:
                    out = merged[metric.name] = Metric(metric.name, metric.documentation,
                                                       metric.type, metric.unit)
                for sample in metric.samples:
                    out.samples.append(sample._replace(labels={**sample.labels, "cache": name}))
        yield from merged.values()


class MetricsServer:
    """Prometheus metrics served over HTTP (``GET /metrics``) from a background thread; see
    :func:`serve_metrics`."""

    def __init__(self, registry: Collector, port: int, addr: str) -> None:
        self._server, self._thread = start_http_server(port, addr=addr, registry=registry)
        self.addr = addr
        self.port: int = self._server.server_port

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def serve_metrics(metrics: CacheMetrics | Iterable[CacheMetrics], *, port: int = 0,
                  addr: str = "127.0.0.1") -> MetricsServer:
    """Serve one cache's metrics (or several caches', each sample labelled ``cache="<i>"``)
    at ``http://addr:port/metrics`` until ``close()``; ``port=0`` picks a free port
    (``server.port``). Binds loopback unless told otherwise."""
    if isinstance(metrics, CacheMetrics):
        return MetricsServer(metrics.registry, port, addr)
    registry = CollectorRegistry()
    registry.register(_Labelled({str(i): m.registry for i, m in enumerate(metrics)}))
    return MetricsServer(registry, port, addr)
