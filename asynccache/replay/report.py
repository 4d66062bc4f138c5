"""The replay report: a table for people, JSON for tools (plots: :mod:`.plots`).

Definitions (the same in ``asynccache replay --help`` and the README):

* **token hit rate** — prompt tokens served from a tier / prompt tokens, over served requests;
* **block hit rate** — hit blocks / *all* prompt blocks, a block being a page of
  ``page_size`` tokens and a prompt of ``n`` tokens having ``ceil(n / page_size)`` of them, the
  partial last one included (the published definition of Mooncake and of vLLM-style block
  accounting). The cache keeps whole pages only, so a partial block never hits;
* **infinite-cache bound** — what a cache that never evicts would have served: for each
  prompt, its longest prefix of whole pages seen before (same namespace), in both units. Not
  applicable when storage held pages from before the replay (they can beat it);
* **offline optimum at L1 capacity** — what the best possible eviction (Belady's, knowing the
  future, over whole prefix pages; a page can only hit with its prefix) would have served from
  a device pool of the same size: the headroom of the eviction policy. An upper bound of every
  policy's L1 hits; not applicable with a warm store;
* **rejected** requests (longer than the device pool) are left out of every rate and counted
  apart;
* **EAGLE** (``--eagle``: bigram keys): a prompt of ``n`` tokens has ``n - 1`` positions the
  cache can serve (position ``i`` is keyed by tokens ``i`` and ``i + 1``; the last one, whose
  bigram needs the next token, is computed and never cached). Every token figure and rate
  counts those positions: ``prompt_tokens`` is the sum of ``n - 1``, a prompt has
  ``ceil((n - 1) / page_size)`` blocks, and the token hit rate is served positions / cacheable
  positions; ``computed_tokens`` is cacheable positions not served (each request computes its
  last position besides). The bounds hash bigram pages;
* **verified draft KV bytes** (``--draft-layers``): bytes of a draft model's KV (a sidecar
  pool) checked bit for bit, at the same slots and times as the KV (``verified_tokens`` x the
  draft's bytes per token).
"""

from __future__ import annotations

from typing import Any

from asynccache.config import CacheConfig
from asynccache.replay.driver import ReplayOptions, ReplayStats, RunOutcome, suggest_capacity


def ratio(a: float, b: float) -> float:
    return round(a / b, 4) if b else 0.0


def human_tokens(n: int | float) -> str:
    """``262144`` -> ``256Ki``, ``250000`` -> ``250k``, ``2883584`` -> ``2816Ki``."""
    n = int(n)
    if n and n % 1024 == 0:
        for unit, size in (("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
            if n % size == 0:
                return f"{n // size}{unit}"
    for unit, size in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size:
            return f"{n / size:.4g}{unit}"
    return str(n)


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def write_model(options: ReplayOptions) -> str:
    bw = options.write_bandwidth
    if bw:
        return f"visible {human_bytes(bw)}/s after the write starts (one at a time)"
    return "complete before the next request"


def config_capacities(config: CacheConfig) -> tuple[int, int]:
    """The L1 / L2 tokens pools built from ``config`` hold: whole pages of the tokens or
    bytes asked for (0: no L2). For a report whose pools were never built; otherwise
    :func:`pool_capacities` reads the pools themselves."""
    ps = config.page_size
    per_page = (config.num_layers * 2 * config.num_heads * config.head_dim
                * config.torch_dtype.itemsize * ps)

    def whole(tokens: int | None, nbytes: int | None) -> int:
        if tokens:
            return tokens // ps * ps
        return (nbytes or 0) // per_page * ps

    return whole(config.device_tokens, config.device_bytes), \
        whole(config.host_tokens, config.host_bytes)


def pool_capacities(driver: Any, config: CacheConfig) -> tuple[int, int]:
    """The L1 / L2 tokens the replay's pools hold (one instance's; 0: no host pool): what a
    report gives as the capacities. Falls back to :func:`config_capacities` when the replay
    stopped before building them."""
    instances = getattr(driver, "instances", None) or []
    if not instances:
        return config_capacities(config)
    cache = instances[0].cache
    host = cache.host_pool.num_slots if cache.host_pool is not None else 0
    return int(cache.device_pool.num_slots), int(host)


def build_report(stats: ReplayStats, config: CacheConfig, source: str,
                 source_storage: str | None = None, *, options: ReplayOptions | None = None,
                 outcome: RunOutcome | None = None, skipped_records: int = 0,
                 auto_device: str | None = None,
                 capacities: tuple[int, int] | None = None) -> dict[str, Any]:
    """``capacities``: the L1 / L2 tokens the pools hold (:func:`pool_capacities`; default:
    :func:`config_capacities`)."""
    s = stats
    device_tokens, host_tokens = capacities or config_capacities(config)
    opts = options or ReplayOptions()
    out = outcome or RunOutcome()
    tok, pages = s.prompt_tokens, s.prompt_pages
    warm = bool(source_storage) and out.warm_storage
    bound_tok = None if warm else ratio(s.bound_hit_tokens, tok)
    bound_blk = None if warm else ratio(s.bound_hit_pages, pages)
    opt_tok = None if warm else ratio(s.optimum_hit_tokens, tok)
    opt_blk = None if warm else ratio(s.optimum_hit_pages, pages)
    report: dict[str, Any] = {
        "trace": source,
        "status": run_status(out),
        "config": {
            "page_size": config.page_size,
            "device_tokens": device_tokens,
            "host_tokens": host_tokens,
            "host_mode": config.host_mode,
            "storage": source_storage,
            "write_policy": config.write_policy,
            "eviction_policy": config.eviction_policy,
            "optimum_capacity_blocks": s.optimum_capacity_pages,
            "kv_shape": [config.num_layers, config.num_heads, config.head_dim, config.dtype],
            "eagle": bool(config.eagle),
            "draft_kv_shape": list(d) if (d := opts.draft_shape(config)) else None,
            "device": config.device,
        },
        "model": {
            "max_in_flight": opts.max_in_flight,
            "prefill_rate": opts.prefill_rate,
            "decode_rate": opts.decode_rate,
            "storage_writes": write_model(opts),
            "prefetch_policy": (opts.storage_policy.prefetch_policy
                                if opts.storage_policy is not None else "wait_complete"),
        },
        "requests": s.requests,
        "completed": s.completed,
        "rejected": s.rejected,
        "rejected_tokens": s.rejected_tokens,
        "largest_rejected_tokens": s.largest_rejected,
        "skipped_records": skipped_records,
        "prompt_tokens": tok,
        "prompt_blocks": pages,
        "reused_tokens": s.reused_tokens,
        "computed_tokens": s.computed_tokens,
        "hits": {
            "device_tokens": s.device_hit_tokens,
            "host_tokens": s.host_hit_tokens,
            "storage_tokens": s.storage_hit_tokens,
            "device_blocks": s.device_hit_pages,
            "host_blocks": s.host_hit_pages,
            "storage_blocks": s.storage_hit_pages,
        },
        "hit_rate": {
            "device_tokens": ratio(s.device_hit_tokens, tok),
            "host_tokens": ratio(s.host_hit_tokens, tok),
            "storage_tokens": ratio(s.storage_hit_tokens, tok),
            "total_tokens": ratio(s.reused_tokens, tok),
            "device_blocks": ratio(s.device_hit_pages, pages),
            "host_blocks": ratio(s.host_hit_pages, pages),
            "storage_blocks": ratio(s.storage_hit_pages, pages),
            "total_blocks": ratio(s.reused_pages, pages),
            "infinite_cache_bound_tokens": bound_tok,
            "infinite_cache_bound_blocks": bound_blk,
            "fraction_of_bound": None if warm else ratio(s.reused_tokens, s.bound_hit_tokens),
            "optimum_l1_tokens": opt_tok,
            "optimum_l1_blocks": opt_blk,
        },
        "overlap": {
            "max_in_flight": s.max_in_flight,
            "overlapped_requests": s.overlapped,
            "queued_requests": s.queued,
        },
        "moved": {
            "device_to_host_bytes": int(s.extra.get("backup_bytes", 0)),
            "host_to_device_bytes": int(s.extra.get("load_back_bytes", 0)),
            "host_to_storage_bytes": int(s.extra.get("storage_write_bytes", 0)),
            "storage_to_host_bytes": int(s.extra.get("storage_read_bytes", 0)),
        },
        "evicted_device_tokens": int(s.extra.get("evicted_tokens", 0)),
        "dropped_tokens": int(s.extra.get("dropped_tokens", 0)),
        "verified_tokens": s.verified_tokens,
        "verified_draft_bytes": s.verified_draft_bytes,
        "wall_s": round(s.wall_s, 3),
        "requests_per_s": round(s.completed / s.wall_s, 1) if s.wall_s else 0.0,
        "tokens_per_s": round(tok / s.wall_s) if s.wall_s else 0,
        "timing": timing(s),
    }
    if source_storage:
        report["storage_state"] = {
            "pages_at_start": out.storage_pages_at_start,
            "pages_from_before": out.storage_foreign_pages,
            "warm": warm,
        }
    report["notes"] = notes(report, opts, auto_device=auto_device)
    return report


def timing(s: ReplayStats) -> dict[str, float]:
    """Where the wall time went (:func:`~asynccache.replay.driver.timing_figures`), and
    ``copy_fraction``: the copy engine's seconds / wall seconds."""
    out = {k: round(v, 3) for k, v in s.timing.items()}
    out["copy_fraction"] = ratio(s.timing.get("copy_s", 0.0), s.wall_s)
    return out


def run_status(out: RunOutcome) -> str:
    if out.stopped_by:
        return f"partial: the trace stopped at a malformed record ({out.stopped_by})"
    if out.interrupted:
        return "partial: interrupted"
    return "complete"


EAGLE_NOTE = (
    "EAGLE keys: a prompt of n tokens has n - 1 cacheable bigram positions; token figures, "
    "rates and the bounds count those (hit rate = served positions / cacheable positions); "
    "each request also computes its last position, never cached")


def skipped_note(skipped: int) -> str:
    return f"{skipped} malformed trace records were skipped (--skip-bad-lines)"


def notes(report: dict[str, Any], opts: ReplayOptions, *,
          auto_device: str | None = None) -> list[str]:
    """What a reader needs to read the figures right."""
    out: list[str] = []
    cfg = report["config"]
    if report["status"] != "complete":
        out.append(f"PARTIAL RESULT: {report['status']}; the figures cover the "
                   f"{report['completed']} requests served before it")
    if auto_device:
        out.append(auto_device)
    if cfg.get("eagle"):
        out.append(EAGLE_NOTE)
    if report["rejected"]:
        out.append(
            f"{report['rejected']} requests ({report['rejected_tokens']:,} tokens) did not fit in "
            f"the device pool ({cfg['device_tokens']:,} tokens) and are left out of the hit rates; "
            f"the longest has {report['largest_rejected_tokens']:,} tokens: pass --device-tokens "
            f"{suggest_capacity(report['largest_rejected_tokens'], cfg['page_size'])} or more")
    if report["skipped_records"]:
        out.append(skipped_note(report["skipped_records"]))
    state = report.get("storage_state")
    if state and state["warm"]:
        at_start = state["pages_at_start"]
        held = f"held {at_start:,} pages at start" if at_start else "held pages from before"
        out.append(
            f"WARNING: the storage was not empty: it {held} ({state['pages_from_before']:,} of "
            "them were found during the replay), so the hit rates include pages of an earlier "
            "run and the infinite-cache bound does not apply; --clear-storage starts from an "
            "empty store")
    if cfg["write_policy"] == "write_through_selective" and cfg["host_tokens"] \
            and cfg["host_mode"] == "cache":
        out.append(
            "L2 admission is write_through_selective: a page is copied to host memory once a "
            "second request has used it, so a prefix used once is never in L2 and an evicted "
            "page that was used once is lost (on the Mooncake traces L2 stays far below the "
            "bound); --write-policy write_through copies every page (--sweep shows both)")
    if not opts.prefill_rate and not opts.decode_rate:
        out.append(
            "compute takes no trace time (--prefill-rate / --decode-rate 0): every request "
            "finishes before the next one arrives, so requests never overlap and "
            "--max-in-flight has no effect")
    if report["config"]["storage"] and report["model"]["prefetch_policy"] != "wait_complete":
        out.append(
            f"--prefetch-policy {report['model']['prefetch_policy']} stops prefetches on this "
            "machine's clock or progress: storage hit rates may differ between runs "
            "(wait_complete is deterministic)")
    return out


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2%}"


def format_table(report: dict[str, Any]) -> str:
    hr = report["hit_rate"]
    ov = report["overlap"]
    tm = report.get("timing", {})
    cfg = report["config"]
    storage = cfg["storage"]
    rows = [
        ("trace", report["trace"]),
        ("status", report["status"]),
        ("requests served / rejected", f"{report['completed']:,} / {report['rejected']:,} "
                                       f"(of {report['requests']:,} read)"),
        ("prompt tokens / blocks", f"{report['prompt_tokens']:,} / {report['prompt_blocks']:,} "
                                   f"(blocks of {cfg['page_size']} tokens)"
                                   + (", EAGLE: cacheable bigram positions, n - 1 a prompt"
                                      if cfg.get("eagle") else "")),
        ("reused / computed tokens", f"{report['reused_tokens']:,} / {report['computed_tokens']:,}"),
        ("capacity L1 / L2 (tokens)", f"{human_tokens(cfg['device_tokens'])} / "
                                      f"{human_tokens(cfg['host_tokens'])}"
                                      + (f" ({cfg['host_mode']})" if cfg['host_mode'] != "cache"
                                         else "")),
        ("hit rate L1 device (tokens / blocks)", f"{_pct(hr['device_tokens'])} / "
                                                 f"{_pct(hr['device_blocks'])}"),
        ("hit rate L2 host (tokens / blocks)", f"{_pct(hr['host_tokens'])} / "
                                               f"{_pct(hr['host_blocks'])}"),
        ("hit rate L3 storage (tokens / blocks)",
         f"{_pct(hr['storage_tokens'])} / {_pct(hr['storage_blocks'])}" if storage
         else "- (no --storage)"),
        ("hit rate total (tokens / blocks)", f"{_pct(hr['total_tokens'])} / "
                                             f"{_pct(hr['total_blocks'])}"),
        ("infinite-cache bound (tokens / blocks)",
         f"{_pct(hr['infinite_cache_bound_tokens'])} / {_pct(hr['infinite_cache_bound_blocks'])}"),
        ("fraction of the bound reached", _pct(hr["fraction_of_bound"])),
        ("L1 optimum, Belady (tokens / blocks)",
         f"{_pct(hr.get('optimum_l1_tokens'))} / {_pct(hr.get('optimum_l1_blocks'))}"),
        ("requests in flight (max / overlapped)", f"{ov['max_in_flight']} / "
                                                  f"{ov['overlapped_requests']:,}"),
        ("bytes D->H / H->D", f"{report['moved']['device_to_host_bytes']:,} / "
                              f"{report['moved']['host_to_device_bytes']:,}"),
        ("bytes H->L3 / L3->H", f"{report['moved']['host_to_storage_bytes']:,} / "
                                f"{report['moved']['storage_to_host_bytes']:,}"),
        ("evicted device tokens", f"{report['evicted_device_tokens']:,}"),
        ("verified KV tokens", f"{report['verified_tokens']:,}"),
        *([("verified draft KV bytes",
            f"{report['verified_draft_bytes']:,} (draft layers / heads / head_dim "
            f"{' / '.join(str(v) for v in cfg['draft_kv_shape'])})")]
          if cfg.get("draft_kv_shape") else []),
        ("wall time", f"{report['wall_s']} s"),
        ("time: setup, KV write, verify, copy",
         f"{tm.get('setup_s', 0)}, {tm.get('kv_write_s', 0)}, {tm.get('kv_verify_s', 0)}, "
         f"{tm.get('copy_s', 0)} s (copies {_pct(tm.get('copy_fraction', 0.0))} of the wall)"),
        ("throughput", f"{report['requests_per_s']} req/s, {report['tokens_per_s']:,} tok/s"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)


def format_sweep(points: list[dict[str, Any]],
                 write_through: list[dict[str, Any]] | None = None) -> str:
    """One line per device capacity: L1, L1+L2, all tiers, the bound and the offline optimum
    at the L1 capacity (tokens / blocks)."""
    head = ["L1 / L2 capacity", "L1", "L1+L2", "all tiers", "bound"]
    if write_through:
        head.append("all tiers, write_through")
    head.append("L1 optimum")
    rows = [head]
    for i, p in enumerate(points):
        hr, hits = p["hit_rate"], p["hits"]
        l12 = (ratio(hits["device_tokens"] + hits["host_tokens"], p["prompt_tokens"]),
               ratio(hits["device_blocks"] + hits["host_blocks"], p["prompt_blocks"]))
        row = [f"{human_tokens(p['config']['device_tokens'])} / "
               f"{human_tokens(p['config']['host_tokens'])} tokens",
               f"{_pct(hr['device_tokens'])} / {_pct(hr['device_blocks'])}",
               f"{_pct(l12[0])} / {_pct(l12[1])}",
               f"{_pct(hr['total_tokens'])} / {_pct(hr['total_blocks'])}",
               f"{_pct(hr['infinite_cache_bound_tokens'])} / "
               f"{_pct(hr['infinite_cache_bound_blocks'])}"]
        if write_through:
            w = write_through[i]["hit_rate"]
            row.append(f"{_pct(w['total_tokens'])} / {_pct(w['total_blocks'])}")
        row.append(f"{_pct(hr.get('optimum_l1_tokens'))} / {_pct(hr.get('optimum_l1_blocks'))}")
        rows.append(row)
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
             for r in rows]
    first = points[0] if points else None
    title = f"trace {first['trace']}: hit rate (tokens / blocks) by device capacity" if first else ""
    notes_seen: list[str] = []
    for p in points:
        for n in p["notes"]:
            if n.startswith("sweep point: "):  # each point's own sizing: one line for all
                n = "L2 is four times each point's L1 (--host-tokens / --host-bytes fix L2)"
            if n not in notes_seen and not n.startswith("PARTIAL"):
                notes_seen.append(n)
    return "\n".join([title, *lines, *(f"note: {n}" for n in notes_seen)])
