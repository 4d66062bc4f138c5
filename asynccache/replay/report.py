"""The replay report: a table for people, JSON for tools, a plot for capacity sweeps."""

from __future__ import annotations

from typing import Any

from asynccache.config import CacheConfig
from asynccache.replay.driver import ReplayStats


def _ratio(a: float, b: float) -> float:
    return round(a / b, 4) if b else 0.0


def build_report(stats: ReplayStats, config: CacheConfig, source: str,
                 source_storage: str | None = None) -> dict[str, Any]:
    s = stats
    tok = s.prompt_tokens
    pages = s.prompt_pages
    return {
        "trace": source,
        "config": {
            "page_size": config.page_size,
            "device_tokens": config.device_tokens,
            "host_tokens": config.host_tokens or 0,
            "host_mode": config.host_mode,
            "storage": source_storage,
            "write_policy": config.write_policy,
            "eviction_policy": config.eviction_policy,
            "kv_shape": [config.num_layers, config.num_heads, config.head_dim, config.dtype],
        },
        "requests": s.requests,
        "completed": s.completed,
        "rejected": s.rejected,
        "prompt_tokens": tok,
        "reused_tokens": s.reused_tokens,
        "computed_tokens": s.computed_tokens,
        "hit_rate": {
            "device_tokens": _ratio(s.device_hit_tokens, tok),
            "host_tokens": _ratio(s.host_hit_tokens, tok),
            "storage_tokens": _ratio(s.storage_hit_tokens, tok),
            "total_tokens": _ratio(s.reused_tokens, tok),
            "device_blocks": _ratio(s.device_hit_pages, pages),
            "host_blocks": _ratio(s.host_hit_pages, pages),
            "storage_blocks": _ratio(s.storage_hit_pages, pages),
            "total_blocks": _ratio(s.device_hit_pages + s.host_hit_pages + s.storage_hit_pages,
                                   pages),
            "infinite_cache_bound_tokens": _ratio(s.bound_hit_tokens, tok),
            "fraction_of_bound": _ratio(s.reused_tokens, s.bound_hit_tokens),
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
        "max_in_flight": s.max_in_flight,
        "wall_s": round(s.wall_s, 3),
        "requests_per_s": round(s.completed / s.wall_s, 1) if s.wall_s else 0.0,
        "tokens_per_s": round(tok / s.wall_s) if s.wall_s else 0,
    }


def format_table(report: dict[str, Any]) -> str:
    hr = report["hit_rate"]
    rows = [
        ("trace", report["trace"]),
        ("requests (completed / rejected)",
         f"{report['requests']} ({report['completed']} / {report['rejected']})"),
        ("prompt tokens", f"{report['prompt_tokens']:,}"),
        ("reused / computed tokens", f"{report['reused_tokens']:,} / {report['computed_tokens']:,}"),
        ("hit rate L1 device (tokens / blocks)", f"{hr['device_tokens']:.2%} / {hr['device_blocks']:.2%}"),
        ("hit rate L2 host (tokens / blocks)", f"{hr['host_tokens']:.2%} / {hr['host_blocks']:.2%}"),
        ("hit rate L3 storage (tokens / blocks)",
         f"{hr['storage_tokens']:.2%} / {hr['storage_blocks']:.2%}"),
        ("hit rate total (tokens / blocks)", f"{hr['total_tokens']:.2%} / {hr['total_blocks']:.2%}"),
        ("infinite-cache bound", f"{hr['infinite_cache_bound_tokens']:.2%}"),
        ("fraction of the bound reached", f"{hr['fraction_of_bound']:.2%}"),
        ("bytes D->H / H->D", f"{report['moved']['device_to_host_bytes']:,} / "
                              f"{report['moved']['host_to_device_bytes']:,}"),
        ("bytes H->L3 / L3->H", f"{report['moved']['host_to_storage_bytes']:,} / "
                                f"{report['moved']['storage_to_host_bytes']:,}"),
        ("evicted device tokens", f"{report['evicted_device_tokens']:,}"),
        ("verified KV tokens", f"{report['verified_tokens']:,}"),
        ("wall time", f"{report['wall_s']} s"),
        ("throughput", f"{report['requests_per_s']} req/s, {report['tokens_per_s']:,} tok/s"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def plot_sweep(points: list[dict[str, Any]], path: str) -> None:
    """Hit rate per tier against device capacity (one point per replay of the sweep). Needs
    matplotlib (the ``asynccache[plot]`` extra)."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("plotting needs matplotlib: pip install 'asynccache[plot]'") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = [p["config"]["device_tokens"] for p in points]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in (("device_tokens", "L1 device"), ("total_tokens", "all tiers"),
                       ("infinite_cache_bound_tokens", "infinite cache")):
        ax.plot(caps, [p["hit_rate"][key] for p in points], marker="o", label=label)
    ax.set_xlabel("device capacity (tokens)")
    ax.set_ylabel("token hit rate")
    ax.set_xscale("log")
    ax.set_ylim(0, 1)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(points[0]["trace"] if points else "")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
