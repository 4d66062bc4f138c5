"""Charts of replay reports (``asynccache replay --plot``). Needs matplotlib, the optional
extra ``asynccache[plot]``; :func:`check_plot_path` validates a path before a replay starts."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from asynccache.errors import ConfigError
from asynccache.replay.report import human_tokens


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("plotting needs matplotlib: pip install 'asynccache[plot]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _render_error(plt: Any, ext: str) -> str | None:
    """Why matplotlib cannot write a tiny titled chart as ``ext`` here (None: it can); the
    chart goes to memory, never to a file."""
    fig, ax = plt.subplots(figsize=(1, 1))
    try:
        ax.set_title("x")
        fig.savefig(io.BytesIO(), format=ext)
    except Exception as exc:  # any backend failure: a missing LaTeX, a missing codec
        return f"{type(exc).__name__}: {exc}"
    finally:
        plt.close(fig)
    return None


def _listed_formats(plt: Any) -> dict[str, str]:
    """Image formats matplotlib's backends list (extension -> description)."""
    fig = plt.figure()
    try:
        return dict(fig.canvas.get_supported_filetypes())
    finally:
        plt.close(fig)


def supported_formats() -> dict[str, str]:
    """Image formats matplotlib can write here (extension -> description): those its backends
    list, less those that cannot render on this machine (.pgf without LaTeX)."""
    plt = _pyplot()
    listed = _listed_formats(plt)
    return {ext: desc for ext, desc in listed.items() if _render_error(plt, ext) is None}


def check_plot_path(path: str) -> None:
    """Refuse, before anything runs, a plot path that cannot be written: a known image
    extension whose backend renders here, an existing folder, a file that can be created
    (tried, and removed again when it did not exist), not a folder itself."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"--plot {path!r} is a folder; give a file name such as hit.png")
    ext = p.suffix.lower().lstrip(".")
    plt = _pyplot()
    if ext not in _listed_formats(plt):
        raise ConfigError(
            f"--plot {path!r}: unknown image extension {p.suffix or '(none)'!r}; use one of "
            f"{', '.join('.' + f for f in sorted(supported_formats()))}")
    why = _render_error(plt, ext)
    if why is not None:
        raise ConfigError(
            f"--plot {path!r}: this machine cannot write .{ext} charts ({why}); use .png, "
            ".svg or .pdf")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(f"--plot {path!r}: folder {str(parent)!r} does not exist")
    existed = p.exists()
    try:
        with open(p, "ab"):
            pass
    except OSError as exc:
        raise ConfigError(f"--plot {path!r}: not writable ({exc.strerror or exc})") from None
    if not existed:
        p.unlink(missing_ok=True)


def trace_title(source: str) -> str:
    """A trace's name for a title: the file name, not its path."""
    return source if source == "synthetic" else Path(source.split(":")[0]).name


def plot_sweep(points: list[dict[str, Any]], path: str,
               write_through: list[dict[str, Any]] | None = None) -> None:
    """Token hit rate against device capacity: L1, L1+L2, all tiers and the bound (and all
    tiers under write_through, when given)."""
    plt = _pyplot()
    caps = [p["config"]["device_tokens"] for p in points]

    def line(key: str) -> list[float]:
        return [p["hit_rate"][key] or 0.0 for p in points]

    l12 = [(p["hits"]["device_tokens"] + p["hits"]["host_tokens"]) / max(1, p["prompt_tokens"])
           for p in points]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ax.plot(caps, line("device_tokens"), marker="o", label="L1 device")
    storage = any(p["config"]["storage"] for p in points)
    if any(p["config"]["host_tokens"] for p in points):
        ax.plot(caps, l12, marker="s", label="L1 + L2 host" if storage else "L1 + L2 = all tiers")
    if storage:
        ax.plot(caps, line("total_tokens"), marker="^", label="all tiers")
    if write_through:
        ax.plot(caps, [p["hit_rate"]["total_tokens"] for p in write_through], marker="^",
                linestyle="--", label="all tiers, write_through")
    bounds = [p["hit_rate"]["infinite_cache_bound_tokens"] for p in points]
    if all(b is not None for b in bounds):
        ax.plot(caps, bounds, color="black", linestyle=":", label="infinite cache")
    ax.set_xscale("log")
    ax.set_xticks(caps)
    ax.set_xticklabels([human_tokens(c) for c in caps])
    ax.minorticks_off()
    ax.set_xlabel("device (L1) capacity, tokens")
    ax.set_ylabel("token hit rate")
    ax.set_ylim(0, 1)
    ax.grid(True, alpha=0.3)
    ax.legend()
    if points:
        cfg = points[0]["config"]
        hosts = {p["config"]["host_tokens"] for p in points}
        l2 = f"L2 {human_tokens(cfg['host_tokens'])}" if len(hosts) == 1 else "L2 4x L1"
        ax.set_title(f"{trace_title(points[0]['trace'])}: hit rate by capacity "
                     f"({l2}, {cfg['write_policy']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_tiers(report: dict[str, Any], path: str) -> None:
    """One replay: a bar per tier (tokens and blocks side by side) and the bound."""
    plt = _pyplot()
    hr = report["hit_rate"]
    labels = ["L1 device", "L2 host", "L3 storage", "total", "infinite cache"]
    tok = [hr["device_tokens"], hr["host_tokens"], hr["storage_tokens"], hr["total_tokens"],
           hr["infinite_cache_bound_tokens"] or 0.0]
    blk = [hr["device_blocks"], hr["host_blocks"], hr["storage_blocks"], hr["total_blocks"],
           hr["infinite_cache_bound_blocks"] or 0.0]
    if not report["config"]["storage"]:  # no L3 bar without an L3
        labels, tok, blk = (x[:2] + x[3:] for x in (labels, tok, blk))
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], tok, width=0.4, label="tokens")
    ax.bar([x + 0.2 for x in xs], blk, width=0.4, label="blocks")
    for x, v in zip(xs, tok, strict=True):
        ax.annotate(f"{v:.1%}", (x - 0.2, v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels)
    ax.set_ylim(0, 1)
    ax.set_ylabel("hit rate")
    ax.legend()
    cfg = report["config"]
    ax.set_title(f"{trace_title(report['trace'])}: L1 {human_tokens(cfg['device_tokens'])}, "
                 f"L2 {human_tokens(cfg['host_tokens'])} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_cluster(report: dict[str, Any], path: str) -> None:
    """``--instances``: each instance's local and global hit rate, the totals and bounds."""
    plt = _pyplot()
    per = report["per_instance"]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(per) + 3), 4.5))
    xs = list(range(len(per)))
    ax.bar([x - 0.2 for x in xs], [p["local_hit_rate"] for p in per], width=0.4,
           label="local (L1 + L2)")
    ax.bar([x + 0.2 for x in xs], [p["global_hit_rate"] for p in per], width=0.4,
           label="global (+ shared L3)")
    ax.axhline(report["global_hit_rate"], color="C1", linestyle="--", label="global, all")
    if report.get("isolated_hit_rate") is not None:
        ax.axhline(report["isolated_hit_rate"], color="C0", linestyle="--",
                   label="isolated (no shared L3)")
    if report.get("pooled_infinite_bound") is not None:
        ax.axhline(report["pooled_infinite_bound"], color="black", linestyle=":",
                   label="infinite cache, pooled")
    ax.set_xticks(xs)
    ax.set_xticklabels([str(p["instance"]) for p in per])
    ax.set_xlabel("instance")
    ax.set_ylabel("token hit rate")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title(f"{trace_title(report['trace'])}: {report['instances']} instances, "
                 f"{report['route']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
