"""Replay a trace across N cache instances with one shared L3 (``asynccache replay --instances``).

Each instance is a real :class:`~asynccache.HierarchicalCache` with its own L1/L2 (the
capacities of the config); all of them run on one event loop (in-process is exact for hit
rates: the instances share nothing but the L3 backend, as separate servers would). Requests
are routed round-robin or by a hash of their first ``route_tokens`` tokens (a prefix-affinity
router). With a shared L3 every instance backs its pages up to the one backend and prefetches
the pages other instances wrote.

The report gives each instance's *local* hit rate (L1 + L2 of that instance), the *global* hit
rate (local + shared L3), and — from a second replay of the same trace and routing without the
shared L3 — the *isolated* hit rate and the pooled-vs-isolated ratio (Mooncake's comparison of
a pooled KV store with per-node caches).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from asynccache.config import CacheConfig
from asynccache.errors import ConfigError
from asynccache.replay.driver import ReplayOptions, ReplayStats, RunOutcome, TraceDriver
from asynccache.replay.formats import TraceRequest
from asynccache.replay.report import (
    EAGLE_NOTE,
    config_capacities,
    human_tokens,
    ratio,
    run_status,
    skipped_note,
    write_model,
)

ROUTES = ("round_robin", "prefix_hash")


@dataclass
class ClusterStats:
    instances: list[ReplayStats]
    bound: ReplayStats  # over every served request: the pooled infinite-cache bound
    route: str
    wall_s: float = 0.0
    storage: dict[str, Any] = field(default_factory=dict)
    outcome: RunOutcome = field(default_factory=RunOutcome)


def route_of(req: TraceRequest, index: int, instances: int, route: str, route_tokens: int) -> int:
    """The instance that serves ``req`` (the ``index``-th request of the trace)."""
    if route == "round_robin":
        return index % instances
    head = req.tokens[:route_tokens].tobytes() + (req.namespace or "").encode()
    return int.from_bytes(hashlib.blake2b(head, digest_size=8).digest(), "little") % instances


class ClusterReplayer:
    """Replays a trace across ``instances`` caches built from ``config``; ``options.storage_url``
    (if any) is the L3 they share. The replay model is :mod:`asynccache.replay.driver`'s: every
    step runs alone and its copies and storage writes complete before the next one, so the
    result is a function of the trace and the options (an instance's storage writes are
    readable by every instance from the next request on, or at the time a modelled write
    bandwidth gives)."""

    def __init__(self, config: CacheConfig, options: ReplayOptions | None = None, *,
                 instances: int = 2, route: str = "round_robin", route_tokens: int = 1024,
                 progress: Callable[[int], None] | None = None) -> None:
        if isinstance(instances, bool) or not isinstance(instances, int) or instances < 1:
            raise ConfigError(f"instances must be an int >= 1, got {instances!r}")
        if route not in ROUTES:
            raise ConfigError(f"unknown route {route!r}; choose one of {list(ROUTES)}")
        if isinstance(route_tokens, bool) or not isinstance(route_tokens, int) or route_tokens < 1:
            raise ConfigError(f"route_tokens must be an int >= 1, got {route_tokens!r}")
        self.config = config
        self.options = options or ReplayOptions()
        self.instances = instances
        self.route = route
        self.route_tokens = route_tokens
        self.driver = TraceDriver(
            config, self.options, instances,
            lambda tr, i: route_of(tr, i, instances, route, route_tokens), progress)

    @property
    def running_hit_rate(self) -> float:
        return self.driver.running_hit_rate

    async def run(self, trace: Iterable[TraceRequest]) -> ClusterStats:
        stats = await self.driver.run(trace)
        d = self.driver
        storage = d.store.stats() if d.store is not None else {}
        return ClusterStats(stats, d.pooled, self.route, d.pooled.wall_s,
                            storage if isinstance(storage, dict) else {}, d.outcome)


def cluster_report(pooled: ClusterStats, isolated: ClusterStats | None, config: CacheConfig,
                   source: str, storage: str | None, *,
                   options: ReplayOptions | None = None,
                   capacities: tuple[int, int] | None = None, skipped_records: int = 0,
                   auto_device: str | None = None) -> dict[str, Any]:
    """Per-instance local / global hit rates, totals, and pooled vs isolated (token rates over
    served requests; rejected requests are counted apart). ``capacities``: the L1 / L2 tokens
    an instance's pools hold (:func:`~asynccache.replay.report.pool_capacities`; default:
    :func:`~asynccache.replay.report.config_capacities`); ``skipped_records`` and
    ``auto_device`` (the note on L1 sized from the trace) as for
    :func:`~asynccache.replay.report.build_report`."""
    opts = options or ReplayOptions()
    device_tokens, host_tokens = capacities or config_capacities(config)
    out_ = pooled.outcome
    warm = bool(storage) and out_.warm_storage
    per = []
    tot = dict.fromkeys(("prompt", "local", "l3", "served", "bound", "rejected", "read",
                         "verified", "draft"), 0)
    for i, s in enumerate(pooled.instances):
        local = s.device_hit_tokens + s.host_hit_tokens
        per.append({
            "instance": i,
            "requests": s.completed,
            "rejected": s.rejected,
            "prompt_tokens": s.prompt_tokens,
            "local_hit_rate": ratio(local, s.prompt_tokens),
            "global_hit_rate": ratio(local + s.storage_hit_tokens, s.prompt_tokens),
            "local_infinite_bound": ratio(s.bound_hit_tokens, s.prompt_tokens),
            "verified_tokens": s.verified_tokens,
        })
        tot["prompt"] += s.prompt_tokens
        tot["local"] += local
        tot["l3"] += s.storage_hit_tokens
        tot["served"] += s.completed
        tot["bound"] += s.bound_hit_tokens
        tot["rejected"] += s.rejected
        tot["read"] += s.requests
        tot["verified"] += s.verified_tokens
        tot["draft"] += s.verified_draft_bytes
    b = pooled.bound
    out: dict[str, Any] = {
        "trace": source,
        "status": run_status(out_),
        "instances": len(pooled.instances),
        "route": pooled.route,
        "config": {
            "page_size": config.page_size,
            "device_tokens_per_instance": device_tokens,
            "host_tokens_per_instance": host_tokens,
            "shared_storage": storage,
            "write_policy": config.write_policy,
            "eagle": bool(config.eagle),
        },
        "model": {
            "max_in_flight": opts.max_in_flight,
            "prefill_rate": opts.prefill_rate,
            "decode_rate": opts.decode_rate,
            "storage_writes": write_model(opts),
        },
        "requests": tot["served"],
        "requests_read": tot["read"],
        "rejected": tot["rejected"],
        "skipped_records": skipped_records,
        "prompt_tokens": tot["prompt"],
        "local_hit_rate": ratio(tot["local"], tot["prompt"]),
        "storage_hit_rate": ratio(tot["l3"], tot["prompt"]),
        "global_hit_rate": ratio(tot["local"] + tot["l3"], tot["prompt"]),
        "per_node_infinite_bound": None if warm else ratio(tot["bound"], tot["prompt"]),
        "pooled_infinite_bound": None if warm else ratio(b.bound_hit_tokens, b.prompt_tokens),
        "max_in_flight": b.max_in_flight,
        "overlapped_requests": sum(s.overlapped for s in pooled.instances),
        "verified_tokens": tot["verified"],
        "verified_draft_bytes": tot["draft"],
        "per_instance": per,
        "wall_s": round(pooled.wall_s, 3),
    }
    if storage:
        out["storage_state"] = {"pages_at_start": out_.storage_pages_at_start,
                                "pages_from_before": out_.storage_foreign_pages, "warm": warm}
    if isolated is not None:
        iso_prompt = sum(s.prompt_tokens for s in isolated.instances)
        iso_hit = sum(s.reused_tokens for s in isolated.instances)
        out["isolated_hit_rate"] = ratio(iso_hit, iso_prompt)
        out["pooled_vs_isolated"] = ratio(out["global_hit_rate"], out["isolated_hit_rate"])
        out["isolated_wall_s"] = round(isolated.wall_s, 3)
        if isolated.outcome.interrupted or isolated.outcome.stopped_by:
            out["status"] = f"{out['status']}; isolated replay: {run_status(isolated.outcome)}"
    out["notes"] = _cluster_notes(out, auto_device)
    return out


def _cluster_notes(r: dict[str, Any], auto_device: str | None = None) -> list[str]:
    notes: list[str] = []
    if r["status"] != "complete":
        notes.append(f"PARTIAL RESULT: {r['status']}")
    if auto_device:
        notes.append(auto_device)
    if r["config"]["eagle"]:
        notes.append(EAGLE_NOTE)
    if r["rejected"]:
        notes.append(f"{r['rejected']} requests did not fit in an instance's device pool "
                     f"({r['config']['device_tokens_per_instance']:,} tokens) and are left out "
                     "of the hit rates")
    if r["skipped_records"]:
        notes.append(skipped_note(r["skipped_records"]))
    state = r.get("storage_state")
    if state and state["warm"]:
        notes.append("WARNING: the shared storage was not empty at start: hit rates include "
                     "pages of an earlier run and the bounds do not apply (--clear-storage)")
    if r["config"]["shared_storage"]:
        notes.append(f"storage writes: {r['model']['storage_writes']} (trace time)")
    return notes


def format_cluster(report: dict[str, Any]) -> str:
    def pct(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.2%}"

    cfg = report["config"]
    shared = cfg["shared_storage"]
    rows = [
        ("trace", report["trace"]),
        ("status", report["status"]),
        ("instances / route", f"{report['instances']} / {report['route']}"),
        ("capacity L1 / L2 per instance (tokens)",
         f"{human_tokens(cfg['device_tokens_per_instance'])} / "
         f"{human_tokens(cfg['host_tokens_per_instance'] or 0)}"),
        ("requests served / rejected", f"{report['requests']:,} / {report['rejected']:,} "
                                       f"(of {report['requests_read']:,} read)"),
        ("prompt tokens", f"{report['prompt_tokens']:,}"),
        ("local hit rate (L1+L2)", pct(report["local_hit_rate"])),
        ("shared L3 hit rate", pct(report["storage_hit_rate"]) if shared
         else "- (no --storage: the instances share nothing)"),
        ("global hit rate", pct(report["global_hit_rate"])),
    ]
    if "isolated_hit_rate" in report:
        rows.append(("isolated hit rate (no shared L3)", pct(report["isolated_hit_rate"])))
        rows.append(("pooled / isolated", f"x{report['pooled_vs_isolated']:.2f}"))
    rows.append(("infinite bound per node / pooled",
                 f"{pct(report['per_node_infinite_bound'])} / "
                 f"{pct(report['pooled_infinite_bound'])}"))
    rows.append(("requests in flight (max / overlapped)",
                 f"{report['max_in_flight']} / {report['overlapped_requests']:,}"))
    rows.append(("verified KV tokens", f"{report['verified_tokens']:,}"))
    if report["verified_draft_bytes"]:
        rows.append(("verified draft KV bytes", f"{report['verified_draft_bytes']:,}"))
    for p in report["per_instance"]:
        rows.append((f"instance {p['instance']} local / global",
                     f"{pct(p['local_hit_rate'])} / {pct(p['global_hit_rate'])} "
                     f"({p['requests']} requests)"))
    rows.append(("wall time", f"{report['wall_s']} s"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines + [f"note: {n}" for n in report["notes"]])
