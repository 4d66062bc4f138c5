"""The ``asynccache`` command line: ``asynccache replay [TRACE] [options]``."""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from asynccache.config import HOST_MODES, CacheConfig
from asynccache.errors import AsyncCacheError, ConfigError
from asynccache.l3 import PREFETCH_POLICIES, StoragePolicy
from asynccache.logs import LOG_FORMATS, configure_logging
from asynccache.replay.driver import Replayer, ReplayOptions
from asynccache.replay.formats import (
    TraceRequest,
    detect_format,
    read_kvtester,
    read_mooncake,
    read_tokens,
)
from asynccache.replay.report import build_report, format_table, plot_sweep
from asynccache.replay.synthetic import SyntheticSpec, synthetic_trace

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def parse_size(text: str) -> int:
    """``4096``, ``64k``, ``3M``, ``2GiB``, ``1.5e6`` -> an int (bytes suffixes ``B``/``iB`` allowed)."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgG]i?)?[bB]?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (examples: 4096, 64k, 3M, 2GiB)")
    try:
        value = float(m.group(1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}") from None
    unit = (m.group(2) or "").lower()
    try:
        out = int(value * _UNITS[unit])
    except (OverflowError, ValueError):
        raise argparse.ArgumentTypeError(f"size {text!r} is out of range") from None
    if out < 0:
        raise argparse.ArgumentTypeError(f"size must be >= 0, got {text!r}")
    return out


def load_trace(args: argparse.Namespace) -> tuple[str, Iterator[TraceRequest]]:
    if args.trace in (None, "synthetic"):
        return "synthetic", synthetic_trace(SyntheticSpec(seed=args.seed))
    paths = sorted(glob.glob(args.trace)) or [args.trace]
    fmt = args.format if args.format != "auto" else detect_format(paths[0])
    if fmt == "kvtester":
        return args.trace, read_kvtester(paths, gap_s=args.conversation_gap)
    if len(paths) != 1:
        raise ConfigError(f"{fmt} traces are one file; {args.trace!r} matches {len(paths)}")
    reader = read_mooncake if fmt == "mooncake" else read_tokens
    return args.trace, reader(paths[0])


def _config(args: argparse.Namespace, device_tokens: int | None = None) -> CacheConfig:
    return CacheConfig(
        page_size=args.page_size,
        num_layers=args.layers,
        num_heads=args.heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        device_tokens=device_tokens if device_tokens is not None else (
            None if args.device_bytes else args.device_tokens),
        device_bytes=None if device_tokens is not None else args.device_bytes,
        host_tokens=None if args.host_bytes else args.host_tokens,
        host_bytes=args.host_bytes,
        write_policy=args.write_policy,
        eviction_policy=args.eviction_policy,
        load_back_threshold=args.load_back_threshold,
        model_name=args.model_name,
        host_mode=args.host_mode,
    )


class _Progress:
    """A one-line progress counter on a terminal (nothing when stderr is not a terminal)."""

    def __init__(self) -> None:
        self.done = 0
        self.enabled = sys.stderr.isatty()

    def __call__(self, n: int) -> None:
        self.done += n
        if self.enabled and self.done % 50 == 0:
            print(f"\rreplayed {self.done} requests", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.done:
            print(file=sys.stderr)


def _replay_once(args: argparse.Namespace, config: CacheConfig) -> dict[str, Any]:
    source, trace = load_trace(args)
    policy = StoragePolicy(prefetch_threshold=args.prefetch_threshold,
                           prefetch_policy=args.prefetch_policy)
    opts = ReplayOptions(time_scale=args.time_scale, max_in_flight=args.max_in_flight,
                         verify=args.verify, limit=args.limit, storage_url=args.storage,
                         storage_policy=policy)
    progress = _Progress()
    try:
        stats = asyncio.run(Replayer(config, opts, progress).run(trace))
    finally:
        progress.close()
    return build_report(stats, config, source, args.storage)


def _replay_cluster(args: argparse.Namespace, config: CacheConfig) -> dict[str, Any]:
    """``--instances N``: N caches with one shared L3 (``--storage``), then (unless
    ``--skip-isolated``) the same replay without it, for the pooled-vs-isolated ratio."""
    from asynccache.replay.cluster import ClusterReplayer, cluster_report

    policy = StoragePolicy(prefetch_threshold=args.prefetch_threshold,
                           prefetch_policy=args.prefetch_policy)

    def once(storage: str | None) -> Any:
        source, trace = load_trace(args)
        opts = ReplayOptions(time_scale=args.time_scale, max_in_flight=args.max_in_flight,
                             verify=args.verify, limit=args.limit, storage_url=storage,
                             storage_policy=policy)
        progress = _Progress()
        try:
            rep = ClusterReplayer(config, opts, instances=args.instances, route=args.route,
                                  route_tokens=args.route_tokens, progress=progress)
            return source, asyncio.run(rep.run(trace))
        finally:
            progress.close()

    source, pooled = once(args.storage)
    isolated = None
    if args.storage and not args.skip_isolated:
        _, isolated = once(None)
    return cluster_report(pooled, isolated, config, source, args.storage)


def _replay(args: argparse.Namespace) -> int:
    import torch

    # Small tensor ops on the loop thread next to the copy worker: one intra-op thread avoids
    # two OpenMP teams contending for the cores (measured 2x faster replays on 2 cores).
    torch.set_num_threads(args.torch_threads)
    if args.instances > 1:
        from asynccache.replay.cluster import format_cluster

        report = _replay_cluster(args, _config(args))
        print(json.dumps(report, indent=1) if args.json else format_cluster(report))
        return 0
    if args.sweep:
        points = [_replay_once(args, _config(args, device_tokens=c)) for c in args.sweep]
        if args.plot:
            plot_sweep(points, args.plot)
        if args.json:
            print(json.dumps({"sweep": points}, indent=1))
        else:
            for p in points:
                print(format_table(p), end="\n\n")
        return 0
    report = _replay_once(args, _config(args))
    if args.plot:
        plot_sweep([report], args.plot)
    print(json.dumps(report, indent=1) if args.json else format_table(report))
    return 0


def _have_matplotlib() -> bool:
    """Whether ``--plot`` can draw (matplotlib is the optional extra ``asynccache[plot]``)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asynccache", description="Hierarchical prefix KV cache.")
    sub = parser.add_subparsers(dest="command", required=True)
    rp = sub.add_parser(
        "replay",
        help="replay a request trace through the real engine and report hit rates",
        description="Replay a request trace (default: the built-in synthetic workload) through "
        "a real cache with real pools and copies, verify every KV page served from host memory, "
        "and report per-tier hit rates, bytes moved and throughput.",
    )
    rp.add_argument("trace", nargs="?", default=None,
                    help="trace file (Mooncake .jsonl, token .jsonl, kv-cache-tester .json or a "
                         "glob of them); default: synthetic")
    rp.add_argument("--format", choices=["auto", "mooncake", "kvtester", "tokens"], default="auto")
    rp.add_argument("--device-tokens", type=parse_size, default=32768)
    rp.add_argument("--device-bytes", type=parse_size, default=None)
    rp.add_argument("--host-tokens", type=parse_size, default=131072,
                    help="L2 capacity in tokens (0 disables the host tier)")
    rp.add_argument("--host-bytes", type=parse_size, default=None)
    rp.add_argument("--host-mode", choices=HOST_MODES, default="cache",
                    help="cache: host memory is the L2 tier; buffer_only: host memory only "
                         "stages pages between device and --storage")
    rp.add_argument("--page-size", type=int, default=16)
    rp.add_argument("--layers", type=int, default=2)
    rp.add_argument("--heads", type=int, default=2)
    rp.add_argument("--head-dim", type=int, default=16)
    rp.add_argument("--dtype", default="float16")
    rp.add_argument("--write-policy", default="write_through_selective")
    rp.add_argument("--eviction-policy", default="lru")
    rp.add_argument("--load-back-threshold", type=int, default=10)
    rp.add_argument("--storage", metavar="URL",
                    help="L3 storage: file:///dir[?capacity=10GiB] or "
                         "s3://bucket/prefix?endpoint=http://127.0.0.1:8333")
    rp.add_argument("--prefetch-policy", choices=PREFETCH_POLICIES, default="timeout",
                    help="best_effort takes what arrived (nothing, when awaited at once); "
                         "timeout waits up to 1 s + 0.25 s per 1Ki tokens")
    rp.add_argument("--prefetch-threshold", type=int, default=256)
    rp.add_argument("--model-name", default="model", help="names L3 objects")
    rp.add_argument("--time-scale", type=float, default=0.0,
                    help="0: as fast as possible; 1: the trace's own clock; 0.01: 100x faster")
    rp.add_argument("--max-in-flight", type=int, default=32)
    rp.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    rp.add_argument("--verify", choices=["loaded", "all", "none"], default="loaded")
    rp.add_argument("--conversation-gap", type=float, default=0.0,
                    help="kv-cache-tester: seconds between conversation starts")
    rp.add_argument("--sweep", type=lambda s: [parse_size(x) for x in s.split(",")], default=None,
                    help="comma-separated device capacities (tokens) to replay in turn")
    rp.add_argument("--seed", type=int, default=0, help="seed of the synthetic workload")
    rp.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads for the replay's own tensor work")
    rp.add_argument("--instances", type=int, default=1,
                    help="replay across N cache instances (each with the L1/L2 above) that "
                         "share the --storage L3; reports local and global hit rates")
    rp.add_argument("--route", choices=["round_robin", "prefix_hash"], default="round_robin",
                    help="--instances: how requests are spread over the instances")
    rp.add_argument("--route-tokens", type=int, default=1024,
                    help="--route prefix_hash: hash this many leading tokens")
    rp.add_argument("--skip-isolated", action="store_true",
                    help="--instances: skip the second replay without the shared L3")
    rp.add_argument("--json", action="store_true", help="print the report as JSON")
    rp.add_argument("--plot", help="write a hit-rate plot (PNG) to this path (needs "
                    "matplotlib: pip install 'asynccache[plot]')")
    rp.add_argument("--log-level", type=str.upper, default="WARNING",
                    choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                    help="log events at this level and above go to stderr (default: WARNING)")
    rp.add_argument("--log-format", choices=LOG_FORMATS, default="console",
                    help="console: one readable line per event; json: one JSON object per line")
    rp.set_defaults(func=_replay)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "replay":
        if args.max_in_flight < 1:
            parser.error(f"--max-in-flight must be >= 1, got {args.max_in_flight}")
        for flag in ("seed", "limit", "time_scale", "conversation_gap", "prefetch_threshold"):
            value = getattr(args, flag)
            if value is not None and (value < 0 or value != value):
                parser.error(f"--{flag.replace('_', '-')} must be >= 0, got {value}")
        if args.torch_threads < 1:
            parser.error(f"--torch-threads must be >= 1, got {args.torch_threads}")
        if args.instances < 1:
            parser.error(f"--instances must be >= 1, got {args.instances}")
        if args.route_tokens < 1:
            parser.error(f"--route-tokens must be >= 1, got {args.route_tokens}")
        if args.instances > 1 and args.sweep:
            parser.error("--instances and --sweep cannot be combined")
        if args.plot and not _have_matplotlib():
            parser.error("--plot needs matplotlib, which is not installed: "
                         "pip install 'asynccache[plot]'")
        configure_logging(args.log_level, fmt=args.log_format)
    try:
        return int(args.func(args))
    except AsyncCacheError as exc:
        print(f"asynccache: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
