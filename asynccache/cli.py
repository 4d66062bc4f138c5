"""The ``asynccache`` command line: ``asynccache replay [TRACE] [options]``.

Building the parser imports nothing heavy (no torch, no numpy): ``--help`` and ``--version``
answer at once. The replay's modules load when a replay runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
from collections.abc import Sequence
from typing import Any

from asynccache import __version__
from asynccache.errors import AsyncCacheError, ConfigError

# The engine's choices, repeated here so that --help needs no engine import
# (tests/test_cli_help.py checks they stay equal).
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
EVICTION_POLICIES = ("lru", "lfu", "fifo", "mru", "filo", "priority", "lru_credit", "arc")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
HOST_MODES = ("cache", "buffer_only")
DTYPES = ("float16", "bfloat16", "float32")
LOG_FORMATS = ("console", "json")
FORMATS = ("auto", "mooncake", "kvtester", "tokens")
ROUTES = ("round_robin", "prefix_hash")
DEFAULT_DEVICE_TOKENS = 32768  # the synthetic workload's L1; file traces: sized from the trace

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}

EPILOG = """\
examples:
  asynccache replay
      the built-in synthetic workload (system prompts, documents, multi-turn chats)
  asynccache replay ../shared/traces/mooncake/conversation_trace.jsonl --page-size 512 \\
      --device-tokens 5000Ki --host-tokens 0 --layers 1 --heads 1 --head-dim 8 --verify none
      Mooncake's conversation trace, L1 only, LRU at 10,000 blocks of 512 tokens
  asynccache replay ../shared/traces/kv-cache-tester/traces.tar.xz --page-size 64 --limit 2000
      the first 2,000 requests of 710 Claude Code conversations, read from the archive;
      L1 sized from the longest prompt, L2 four times L1
  asynccache replay TRACE --instances 10 --storage "file:///dev/shm/l3?capacity=964MB"
      ten caches sharing one L3, then the same without it: pooled vs isolated hit rate

hit rates (over served requests; rejected ones are counted apart):
  tokens   prompt tokens served from a tier / prompt tokens
  blocks   hit blocks / all prompt blocks; a block is a page of --page-size tokens and a
           prompt of n tokens has ceil(n / page) of them, the partial last one included
           (Mooncake's and vLLM's definition); a partial block never hits: the cache keeps
           whole pages only
  bound    the infinite-cache bound: what a cache that never evicts would serve (whole
           pages seen before, same namespace), in both units; n/a when the storage held
           pages of an earlier run
  optimum  the offline optimum at the L1 capacity: Belady's eviction (knowing the future)
           over whole prefix pages, a page hitting only with its prefix; the headroom of
           --eviction-policy (an upper bound of every policy's L1 hits)
  --eagle  EAGLE bigram keys: a prompt of n tokens has n - 1 cacheable positions (position
           i is keyed by tokens i and i + 1); every token figure, rate and block counts
           those (hit rate = served positions / cacheable positions), the bounds hash
           bigram pages

verification (--verify): the KV of every computed token is a function of its page's prefix
  hash and position, checked bit for bit where it is served (loaded: from L2 / L3; all: device
  hits too). --draft-layers N adds a draft model's KV (a sidecar pool riding every copy and
  storage object), written with its own lane bits and checked at the same slots and times;
  the report counts the draft bytes checked

replay model (results depend on the trace and the options, never on this machine's speed):
  requests are admitted at their trace time, in trace order; each step (admit, finish) runs
  alone, and every copy and storage write it starts completes before the next step, so
  another instance reads a page from the next request on (or, with
  --storage-write-bandwidth, once a store writing that many bytes per second would have
  finished it). A request finishes computed/--prefill-rate + output/--decode-rate seconds
  after its admission: with both 0 it finishes before the next request arrives; with a rate,
  requests overlap (up to --max-in-flight per instance), holding their memory.
"""


def parse_size(text: str) -> int:
    """``4096``, ``64k``, ``3M``, ``2GiB``, ``1.5e6`` -> an int (bytes suffixes ``B``/``iB`` allowed)."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgGtT]i?)?[bB]?\s*", text)
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


def parse_rate(text: str) -> int:
    """A bandwidth: a size per second (``2GiB``, ``500MB/s``)."""
    return parse_size(re.sub(r"/s\s*$", "", text))


def _sizes(text: str) -> list[int]:
    return [parse_size(x) for x in text.split(",")]


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default (flags: off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default is argparse.SUPPRESS \
                or isinstance(action, argparse._VersionAction | argparse._HelpAction):
            return text
        if isinstance(action, argparse._StoreTrueAction):
            return f"{text} (default: off)"
        if action.default is None:
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asynccache", formatter_class=_HelpFormatter,
        description="asynccache: an asyncio hierarchical prefix KV cache (device / host / "
                    "storage tiers) for LLM serving.",
        epilog="run 'asynccache replay --help' for the replay's options and examples")
    parser.add_argument("--version", action="version", version=f"asynccache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    rp = sub.add_parser(
        "replay", formatter_class=_HelpFormatter, epilog=EPILOG,
        help="replay a request trace through the real engine and report hit rates",
        description="Replay a request trace (default: the built-in synthetic workload) through "
        "real caches with real pools and copies, verify every KV page served from host memory "
        "or storage, and report per-tier hit rates (tokens and blocks), the infinite-cache "
        "bound, bytes moved and throughput.",
    )
    rp.add_argument("trace", nargs="?", default="synthetic",
                    help="a Mooncake or token .jsonl file (optionally .gz / .xz / .bz2), "
                         "kv-cache-tester .json conversations (a glob of them, or a .tar.xz / "
                         ".tar.gz archive), or 'synthetic'")
    t = rp.add_argument_group("trace")
    t.add_argument("--format", choices=FORMATS, default="auto",
                   help="trace format; auto: from the file name and first record")
    t.add_argument("--limit", type=int, default=None,
                   help="replay only the first N requests (default: all); bounds the time and "
                        "memory of a replay")
    t.add_argument("--skip-bad-lines", action="store_true",
                   help="skip malformed trace records (counted in the report) instead of "
                        "stopping there; without it a malformed record ends the replay and the "
                        "result up to it is reported")
    t.add_argument("--conversation-gap", type=float, default=0.0,
                   help="kv-cache-tester: seconds between conversation starts (0: all start "
                        "at once, and every conversation is parsed before the first request)")
    t.add_argument("--seed", type=int, default=0, help="seed of the synthetic workload")

    c = rp.add_argument_group("cache")
    dev = c.add_mutually_exclusive_group()
    dev.add_argument("--device-tokens", type=parse_size, default=None,
                     help="L1 capacity in tokens (default: 32Ki for the synthetic workload; "
                          "for a trace file, sized from its longest prompt: rounded up to "
                          "pages, plus a quarter)")
    dev.add_argument("--device-bytes", type=parse_size, default=None,
                     help="L1 capacity in bytes of KV, instead of --device-tokens "
                          "(default: none)")
    host = c.add_mutually_exclusive_group()
    host.add_argument("--host-tokens", type=parse_size, default=None,
                      help="L2 capacity in tokens; 0 disables the host tier (default: four "
                           "times the L1 capacity)")
    host.add_argument("--host-bytes", type=parse_size, default=None,
                      help="L2 capacity in bytes of KV, instead of --host-tokens "
                           "(default: none)")
    c.add_argument("--host-mode", choices=HOST_MODES, default="cache",
                   help="cache: host memory is the L2 tier; buffer_only: host memory only "
                        "stages pages between device and --storage")
    c.add_argument("--page-size", type=int, default=16,
                   help="tokens per page (the block of the block hit rate)")
    c.add_argument("--layers", type=int, default=2, help="KV layers (the KV shape changes "
                   "bytes moved and memory, never hit rates)")
    c.add_argument("--heads", type=int, default=2, help="KV heads")
    c.add_argument("--head-dim", type=int, default=16, help="KV head dimension")
    c.add_argument("--dtype", choices=DTYPES, default="float16", help="KV dtype")
    c.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the L1 pool lives (cuda: the current CUDA device)")
    c.add_argument("--write-policy", choices=WRITE_POLICIES, default="write_through_selective",
                   help="when a page is copied to L2: write_through on insert, "
                        "write_through_selective on its second hit, write_back at eviction")
    c.add_argument("--eviction-policy", choices=EVICTION_POLICIES, default="lru",
                   help="which cached pages are evicted first")
    c.add_argument("--eagle", action="store_true",
                   help="EAGLE bigram keys (CacheConfig(eagle=True)): a prompt of n tokens has "
                        "n - 1 cacheable positions; token figures and hit rates count those, "
                        "and the bounds hash bigram pages")
    c.add_argument("--draft-layers", type=int, default=0, metavar="N",
                   help="attach a draft model's KV as a sidecar pool of N layers: the replay "
                        "writes it for every computed token and verifies it wherever it "
                        "verifies the KV (default 0: none)")
    c.add_argument("--draft-heads", type=int, default=None,
                   help="--draft-layers: draft KV heads (default: --heads)")
    c.add_argument("--draft-head-dim", type=int, default=None,
                   help="--draft-layers: draft KV head dimension (default: --head-dim)")
    c.add_argument("--load-back-threshold", type=int, default=10,
                   help="L2 hits shorter than this many tokens are recomputed, not loaded")

    s = rp.add_argument_group("storage (L3)")
    s.add_argument("--storage", metavar="URL", default=None,
                   help="L3 storage: file:///dir[?capacity=10GiB] or "
                        "s3://bucket/prefix?endpoint=http://127.0.0.1:8333 (default: no L3)")
    s.add_argument("--clear-storage", action="store_true",
                   help="empty the store (this layout's pages) before replaying; otherwise a "
                        "store that holds pages of an earlier run is reported as warm and the "
                        "bound as not applicable")
    s.add_argument("--storage-write-bandwidth", metavar="BYTES/S", type=parse_rate, default=None,
                   help="model a store that writes this many bytes per second, one write after "
                        "another: a page becomes readable when it would have been written, in "
                        "trace time (default: every write completes before the next request)")
    s.add_argument("--prefetch-policy", choices=PREFETCH_POLICIES, default="wait_complete",
                   help="when a request stops waiting for its L3 prefetch: wait_complete (all "
                        "of it: deterministic), timeout (1 s + 0.25 s per 1Ki tokens of this "
                        "machine's clock), best_effort (what has arrived)")
    s.add_argument("--prefetch-threshold", type=int, default=256,
                   help="uncached parts shorter than this many tokens are not prefetched")
    s.add_argument("--model-name", default="model", help="names L3 objects")

    m = rp.add_argument_group("replay model")
    m.add_argument("--max-in-flight", type=int, default=32,
                   help="requests admitted and not finished at once, per instance; others wait "
                        "in arrival order (matters only with --prefill-rate / --decode-rate)")
    m.add_argument("--prefill-rate", type=float, default=0.0,
                   help="modelled compute: computed prompt tokens per second (0: compute "
                        "takes no trace time and requests never overlap)")
    m.add_argument("--decode-rate", type=float, default=0.0,
                   help="modelled decode: output tokens per second per request (0: none)")
    m.add_argument("--time-scale", type=float, default=0.0,
                   help="wall-clock pacing only (results do not change): 0 as fast as "
                        "possible, 1 the trace's own clock, 0.01 100x faster")
    m.add_argument("--verify", choices=("loaded", "all", "none"), default="loaded",
                   help="which served KV is checked bit for bit: loaded (from L2 / L3), all "
                        "(device hits too), none")
    m.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op threads for the replay's own tensor work")

    k = rp.add_argument_group("instances")
    k.add_argument("--instances", type=int, default=1,
                   help="replay across N cache instances (each with the L1/L2 above) that "
                        "share the --storage L3; reports local and global hit rates")
    k.add_argument("--route", choices=ROUTES, default="round_robin",
                   help="--instances: how requests are spread over the instances")
    k.add_argument("--route-tokens", type=int, default=1024,
                   help="--route prefix_hash: hash this many leading tokens")
    k.add_argument("--skip-isolated", action="store_true",
                   help="--instances: skip the second replay without the shared L3")

    o = rp.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the report as JSON")
    o.add_argument("--sweep", type=_sizes, default=None, metavar="CAPACITIES",
                   help="comma-separated L1 capacities (tokens, each at least one page) to "
                        "replay in turn, L2 four times each unless --host-tokens / --host-bytes "
                        "fix it; under write_through_selective with an L2, each is also "
                        "replayed under write_through (default: none)")
    o.add_argument("--plot", metavar="PATH", default=None,
                   help="write a chart (.png, .svg, .pdf): hit rate by capacity with --sweep, "
                        "per-tier bars without, per-instance bars with --instances; needs "
                        "matplotlib: pip install 'asynccache[plot]' (default: none)")
    o.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="progress bars on stderr; auto: only on a terminal")
    o.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve the caches' Prometheus metrics at "
                        "http://127.0.0.1:PORT/metrics while replaying (0: a free port, "
                        "logged as metrics_served); several instances: labelled cache=<i> "
                        "(default: not served)")
    o.add_argument("--log-level", type=str.upper, default="WARNING",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   help="log events at this level and above go to stderr")
    o.add_argument("--log-format", choices=LOG_FORMATS, default="console",
                   help="console: one readable line per event; json: one JSON object per line")
    rp.set_defaults(func=_replay)
    return parser


# ---------------------------------------------------------------------------------- checks
def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flag errors that argparse cannot see, before anything runs."""
    if args.max_in_flight < 1:
        parser.error(f"--max-in-flight must be >= 1, got {args.max_in_flight}")
    for flag in ("seed", "limit", "time_scale", "conversation_gap", "prefetch_threshold",
                 "prefill_rate", "decode_rate", "load_back_threshold"):
        value = getattr(args, flag)
        if value is not None and (value < 0 or value != value or value == float("inf")):
            parser.error(f"--{flag.replace('_', '-')} must be >= 0, got {value}")
    if args.draft_layers < 0:
        parser.error(f"--draft-layers must be >= 0, got {args.draft_layers}")
    for flag in ("draft_heads", "draft_head_dim"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
        if value is not None and not args.draft_layers:
            parser.error(f"--{flag.replace('_', '-')} needs --draft-layers N (a draft sidecar)")
    for flag in ("torch_threads", "instances", "route_tokens"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.storage_write_bandwidth is not None and args.storage_write_bandwidth <= 0:
        parser.error(f"--storage-write-bandwidth must be > 0, got {args.storage_write_bandwidth}")
    if args.instances > 1 and args.sweep:
        parser.error("--instances and --sweep cannot be combined")
    if args.sweep is not None and not all(args.sweep):
        parser.error(f"--sweep capacities must be > 0, got {args.sweep}")
    if args.sweep is not None and args.page_size >= 1 and (small := [c for c in args.sweep if c < args.page_size]):
        parser.error(f"--sweep capacities must hold at least one page (--page-size "
                     f"{args.page_size}), got {', '.join(map(str, small))}")
    if args.device_tokens == 0 or args.device_bytes == 0:
        parser.error("the device (L1) capacity must be > 0")
    if args.plot and not _have_matplotlib():
        parser.error("--plot needs matplotlib, which is not installed: "
                     "pip install 'asynccache[plot]'")


def _have_matplotlib() -> bool:
    """Whether ``--plot`` can draw (matplotlib is the optional extra ``asynccache[plot]``)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


def _check_memory(args: argparse.Namespace, device_tokens: int, host_tokens: int) -> None:
    """Refuse pools this machine cannot hold, naming the flag, before allocating anything."""
    per_token = args.layers * 2 * args.heads * args.head_dim * _ITEMSIZE[args.dtype]
    if args.draft_layers:  # the draft sidecar's pools hold as many slots as the KV's
        per_token += args.draft_layers * 2 * (args.draft_heads or args.heads) * (
            args.draft_head_dim or args.head_dim) * _ITEMSIZE[args.dtype]
    # KV bytes plus the allocator's and the tree's per-token bookkeeping (slot indices)
    cost = per_token + 16
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    n = args.instances
    dev_flag = ("--device-bytes", args.device_bytes) if args.device_bytes else \
        ("--device-tokens", device_tokens)
    need_dev = n * device_tokens * cost
    need_host = n * host_tokens * cost
    if args.device == "cpu" and need_dev + need_host > ram:
        raise ConfigError(
            f"the pools need {_gib(need_dev + need_host)} of memory ({dev_flag[0]} "
            f"{dev_flag[1]:,} and --host-tokens {host_tokens:,} x {n} instance(s) x "
            f"{per_token} B of KV per token), more than this machine's {_gib(ram)}")
    if need_host > ram:
        raise ConfigError(
            f"the host pools need {_gib(need_host)} (--host-tokens {host_tokens:,} x {n} "
            f"instance(s) x {per_token} B per token), more than this machine's {_gib(ram)}")
    if args.device == "cuda":
        import torch

        if torch.cuda.is_available():
            total = torch.cuda.mem_get_info()[1]
            if need_dev > total:
                raise ConfigError(
                    f"the device pools need {_gib(need_dev)} ({dev_flag[0]} {dev_flag[1]:,}), "
                    f"more than the GPU's {_gib(total)}")


def _check_metrics_port(port: int) -> None:
    """Refuse a ``--metrics-port`` out of range before replaying (one that cannot be bound is
    refused by the replay when it starts the server, before the first request)."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--metrics-port must be in [0, 65535], got {port}")


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


# ---------------------------------------------------------------------------------- replay
class _Run:
    """One replay command: the trace, sizes, options and output."""

    def __init__(self, args: argparse.Namespace) -> None:
        from asynccache.replay.load import TraceSpec

        self.args = args
        self.spec = TraceSpec(args.trace, args.format, args.conversation_gap, args.seed,
                              args.skip_bad_lines)
        self.progress_on = _progress_wanted(args.progress)
        self.total: int | None = None
        self.auto_note: str | None = None
        self.device_tokens, self.host_tokens = self._size()

    def _size(self) -> tuple[int, int]:
        args = self.args
        need_survey = self.progress_on or (args.device_tokens is None and args.device_bytes is None
                                           and self.spec.path is not None)
        longest = 0
        if need_survey:
            from asynccache.replay.progress import ReplayProgress

            bar = ReplayProgress(self.progress_on, desc="survey")
            try:
                self.total, longest = self.spec.survey(args.limit, on_open=bar.loading)
            finally:
                bar.close()
        device = args.device_tokens
        if device is None and args.device_bytes is None:
            device = DEFAULT_DEVICE_TOKENS
            if self.spec.path is not None and longest:
                from asynccache.replay.driver import suggest_capacity

                auto = parse_size(suggest_capacity(longest, args.page_size))
                if auto > device:
                    device = auto
                self.auto_note = (
                    f"L1 sized from the trace: its longest prompt has {longest:,} tokens, so "
                    f"L1 holds {device:,} tokens (the longest prompt rounded up to pages plus a "
                    f"quarter, at least {DEFAULT_DEVICE_TOKENS:,})"
                    + ("" if args.host_tokens is not None or args.host_bytes is not None
                       else " and L2 four times that") + "; --device-tokens / --host-tokens "
                    "choose")
        dev_tokens = device if device is not None else args.device_bytes // self._per_token()
        host = args.host_tokens
        if host is None and args.host_bytes is None:
            host = 4 * dev_tokens
        host_tokens = host if host is not None else args.host_bytes // self._per_token()
        self.device_arg = device
        self.host_arg = host
        self.host_explicit = args.host_tokens is not None or args.host_bytes is not None
        sweep_host = 0 if self.host_explicit else 4 * max(args.sweep or [0])
        _check_memory(args, max([dev_tokens, *(args.sweep or [])]), max(host_tokens, sweep_host))
        return dev_tokens, host_tokens

    def _per_token(self) -> int:
        a = self.args
        return max(1, int(a.layers * 2 * a.heads * a.head_dim * _ITEMSIZE[a.dtype]))

    def config(self, device_tokens: int | None = None, write_policy: str | None = None) -> Any:
        from asynccache.config import CacheConfig

        a = self.args
        sweep = device_tokens is not None
        host_arg = self.host_arg
        if device_tokens is not None and not self.host_explicit:  # 4x each sweep point's L1
            host_arg = 4 * device_tokens
        return CacheConfig(
            page_size=a.page_size, num_layers=a.layers, num_heads=a.heads, head_dim=a.head_dim,
            dtype=a.dtype,
            device_tokens=device_tokens if sweep else self.device_arg,
            device_bytes=None if sweep or self.device_arg is not None else a.device_bytes,
            host_tokens=host_arg, host_bytes=None if host_arg is not None
            else a.host_bytes,
            write_policy=write_policy or a.write_policy, eviction_policy=a.eviction_policy,
            load_back_threshold=a.load_back_threshold, model_name=a.model_name,
            host_mode=a.host_mode, device=a.device, eagle=a.eagle,
        )

    def options(self, storage: str | None) -> Any:
        from asynccache.l3 import StoragePolicy
        from asynccache.replay.driver import ReplayOptions

        a = self.args
        return ReplayOptions(
            time_scale=a.time_scale, max_in_flight=a.max_in_flight, verify=a.verify,
            limit=a.limit, storage_url=storage,
            storage_policy=StoragePolicy(prefetch_threshold=a.prefetch_threshold,
                                         prefetch_policy=a.prefetch_policy),
            prefill_rate=a.prefill_rate, decode_rate=a.decode_rate,
            write_bandwidth=a.storage_write_bandwidth, clear_storage=a.clear_storage,
            metrics_port=a.metrics_port, draft_layers=a.draft_layers,
            draft_heads=a.draft_heads, draft_head_dim=a.draft_head_dim)

    def replay(self, replayer: Any, desc: str) -> Any:
        """Run ``replayer`` over a fresh pass of the trace with a progress bar; Ctrl-C stops
        admitting requests and returns what was served."""
        import asyncio

        from asynccache.replay.progress import ReplayProgress

        bar = ReplayProgress(self.progress_on, total=self.total, desc=desc,
                             hit_rate=lambda: replayer.running_hit_rate)
        replayer.driver.progress = bar
        trace = self.spec.open(on_open=bar.loading)

        async def main() -> Any:
            loop = asyncio.get_running_loop()
            installed = False

            def on_sigint() -> None:
                replayer.driver.request_stop()
                loop.remove_signal_handler(signal.SIGINT)  # a second Ctrl-C stops at once

            try:
                loop.add_signal_handler(signal.SIGINT, on_sigint)
                installed = True
            except (NotImplementedError, RuntimeError, ValueError):
                pass  # not the main thread
            try:
                return await replayer.run(trace)
            finally:
                if installed:
                    loop.remove_signal_handler(signal.SIGINT)

        try:
            return asyncio.run(main())
        finally:
            bar.close()


def _progress_wanted(mode: str) -> bool:
    return mode == "on" or (mode == "auto" and sys.stderr.isatty())


def _replay(args: argparse.Namespace) -> int:
    from asynccache.logs import configure_logging

    configure_logging(args.log_level, fmt=args.log_format)
    if args.plot:
        from asynccache.replay.plots import check_plot_path

        check_plot_path(args.plot)
    if args.metrics_port:
        _check_metrics_port(args.metrics_port)
    run = _Run(args)
    import torch

    # Small tensor ops on the loop thread next to the copy worker: one intra-op thread avoids
    # two OpenMP teams contending for the cores (measured 2x faster replays on 2 cores).
    torch.set_num_threads(args.torch_threads)
    if args.instances > 1:
        return _replay_cluster(run)
    if args.sweep:
        return _replay_sweep(run)
    report, outcome = _replay_once(run, run.config(), "replay")
    print(json.dumps(report, indent=1) if args.json else _table(report))
    failed = 0
    if args.plot:
        from asynccache.replay.plots import plot_tiers

        failed = _draw(args.plot, lambda: plot_tiers(report, args.plot))
    return _exit_code(outcome) or failed


def _draw(path: str, draw: Any) -> int:
    """Write the chart after the report is printed: a failure (the check before the replay
    cannot foresee all: a disk filling up, a folder removed meanwhile) is an error, exit 2,
    and the report stays."""
    sys.stdout.flush()
    try:
        draw()
    except Exception as exc:  # whatever the backend raises, the report is already out
        print(f"asynccache: error: --plot {path!r}: the chart could not be written "
              f"({type(exc).__name__}: {exc}); the report above is complete", file=sys.stderr)
        return 2
    return 0


def _table(report: dict[str, Any]) -> str:
    from asynccache.replay.report import format_table

    return format_table(report)


def _replay_once(run: _Run, config: Any, desc: str,
                 sweep_point: bool = False) -> tuple[dict[str, Any], Any]:
    from asynccache.replay.driver import Replayer
    from asynccache.replay.report import build_report, pool_capacities

    opts = run.options(run.args.storage)
    rep = Replayer(config, opts)
    stats = run.replay(rep, desc)
    capacities = pool_capacities(rep.driver, config)
    sizing = run.auto_note
    if sweep_point:  # the point's own L1, not the trace's auto-sized one
        sizing = None if run.host_explicit else (
            f"{SWEEP_POINT_NOTE}L1 holds {capacities[0]:,} tokens and L2 four times the L1 "
            f"asked for ({capacities[1]:,} tokens); --host-tokens / --host-bytes fix L2")
    report = build_report(stats, config, run.spec.name, run.args.storage, options=opts,
                          outcome=rep.outcome, skipped_records=run.spec.skipped,
                          auto_device=sizing, capacities=capacities)
    return report, rep.outcome


SWEEP_POINT_NOTE = "sweep point: "


def _replay_sweep(run: _Run) -> int:
    from asynccache.replay.report import format_sweep

    args = run.args
    compare = (args.write_policy == "write_through_selective" and run.host_tokens > 0
               and args.host_mode == "cache")
    points: list[dict[str, Any]] = []
    wt: list[dict[str, Any]] = []
    outcome = None
    for cap in args.sweep:
        report, outcome = _replay_once(run, run.config(cap), f"L1 {cap:,}", sweep_point=True)
        points.append(report)
        if _exit_code(outcome):
            break
        if compare:
            report, outcome = _replay_once(run, run.config(cap, "write_through"),
                                           f"L1 {cap:,} write_through", sweep_point=True)
            wt.append(report)
            if _exit_code(outcome):
                break
    if args.json:
        out: dict[str, Any] = {"sweep": points}
        if compare:
            out["write_through"] = wt
        print(json.dumps(out, indent=1))
    else:
        print(format_sweep(points, wt if len(wt) == len(points) else None))
    failed = 0
    if args.plot and points:
        from asynccache.replay.plots import plot_sweep

        failed = _draw(args.plot, lambda: plot_sweep(
            points, args.plot, wt[: len(points)] if len(wt) == len(points) else None))
    return _exit_code(outcome) or failed


def _replay_cluster(run: _Run) -> int:
    from asynccache.replay.cluster import ClusterReplayer, cluster_report, format_cluster
    from asynccache.replay.report import pool_capacities

    args = run.args
    config = run.config()
    capacities: list[tuple[int, int]] = []

    def once(storage: str | None, desc: str) -> Any:
        rep = ClusterReplayer(config, run.options(storage), instances=args.instances,
                              route=args.route, route_tokens=args.route_tokens)
        stats = run.replay(rep, desc)
        capacities.append(pool_capacities(rep.driver, config))
        return stats

    pooled = once(args.storage, "pooled" if args.storage else "instances")
    isolated = None
    if args.storage and not args.skip_isolated and not _exit_code(pooled.outcome):
        isolated = once(None, "isolated")
    report = cluster_report(pooled, isolated, config, run.spec.name, args.storage,
                            options=run.options(args.storage), capacities=capacities[0],
                            skipped_records=run.spec.skipped, auto_device=run.auto_note)
    print(json.dumps(report, indent=1) if args.json else format_cluster(report))
    failed = 0
    if args.plot:
        from asynccache.replay.plots import plot_cluster

        failed = _draw(args.plot, lambda: plot_cluster(report, args.plot))
    return int(_exit_code(pooled.outcome) or (_exit_code(isolated.outcome) if isolated else 0)
               or failed)


def _exit_code(outcome: Any) -> int:
    """0, 2 after a malformed record (its message goes to stderr), 130 after Ctrl-C."""
    if outcome is None:
        return 0
    if outcome.stopped_by:
        print(f"asynccache: error: the trace has a malformed record: {outcome.stopped_by} "
              "(the report covers the requests before it; --skip-bad-lines skips such records)",
              file=sys.stderr)
        return 2
    if outcome.interrupted:
        print("asynccache: interrupted: the report covers the requests served before it",
              file=sys.stderr)
        return 130
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "replay":
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        _check_args(sub.choices["replay"], args)  # errors show the replay's usage
    try:
        return int(args.func(args))
    except AsyncCacheError as exc:
        print(f"asynccache: error: {exc}", file=sys.stderr)
        return 2
    except MemoryError as exc:
        print(f"asynccache: error: out of memory ({exc or 'allocation failed'}): use smaller "
              "--device-tokens / --host-tokens", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("asynccache: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
