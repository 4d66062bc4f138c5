"""Run a function on N spawned rank processes (torch.distributed over gloo on 127.0.0.1).

``run_ranks(path, name, world_size)`` starts ``world_size`` processes with the ``spawn`` start
method; each loads the Python file ``path`` and calls ``name(rank, world_size, init_method,
*args)``. What each returns (picklable) comes back per rank. A rank that raises, dies or does
not answer within ``timeout_s`` is *reported* in its :class:`RankOutcome` — the runner never
hangs on it: after the deadline every process still alive is killed (only the ones it started).
"""

from __future__ import annotations

import importlib.util
import os
import queue as queue_mod
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from asynccache.errors import AsyncCacheError
from asynccache.ranks import free_port
from asynccache.tree.components.layout import QE, QUEUES, WIDTH

__all__ = ["RankFailure", "RankOutcome", "run_ranks"]


class RankFailure(AsyncCacheError):
    """One or more ranks failed, died or timed out (the message says which and how)."""


@dataclass
class RankOutcome:
    rank: int
    ok: bool
    result: Any = None
    error: str | None = None  # the traceback of a raised error, or why there is no answer
    exitcode: int | None = None


def _load(path: str, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"_asynccache_rank_{Path(path).stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path!r}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def _child(path: str, name: str, rank: int, world_size: int, init_method: str,
           args: tuple[Any, ...], out: Any) -> None:
    try:
        fn = _load(path, name)
        result = fn(rank, world_size, init_method, *args)
    except BaseException:
        out.put((rank, False, None, traceback.format_exc()))
        raise SystemExit(1) from None
    out.put((rank, True, result, None))


def run_ranks(path: str | os.PathLike[str], name: str, world_size: int, *,
              args: tuple[Any, ...] = (), timeout_s: float = 60.0) -> list[RankOutcome]:
    """Run ``name`` from file ``path`` on ``world_size`` rank processes; outcomes by rank."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_child, name=f"asynccache-rank-{r}",
                         args=(str(path), name, r, world_size, init, args, out), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    outcomes: dict[int, RankOutcome] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outcomes) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, result, error = out.get(timeout=0.2)
            except queue_mod.Empty:
                for r, p in enumerate(procs):  # died without a word (os._exit, a signal)
                    if r not in outcomes and p.exitcode is not None:
                        # give a message it queued just before exiting a moment to arrive
                        try:
                            rank, ok, result, error = out.get(timeout=0.5)
                        except queue_mod.Empty:
                            outcomes[r] = RankOutcome(
                                r, False, error=f"rank {r} died with exit code {p.exitcode}",
                                exitcode=p.exitcode)
                            continue
                        outcomes[rank] = RankOutcome(rank, ok, result, error)
                continue
            outcomes[rank] = RankOutcome(rank, ok, result, error)
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        out.close()
    for r, p in enumerate(procs):
        if r not in outcomes:
            outcomes[r] = RankOutcome(r, False, error=f"rank {r} did not answer within "
                                      f"{timeout_s:g} s (killed)", exitcode=p.exitcode)
        else:
            outcomes[r].exitcode = p.exitcode
    return [outcomes[r] for r in range(world_size)]


def check_ranks(outcomes: list[RankOutcome]) -> list[Any]:
    """The results by rank, or :class:`RankFailure` naming every rank that failed."""
    bad = [o for o in outcomes if not o.ok]
    if bad:
        raise RankFailure("; ".join(f"rank {o.rank}: {o.error}" for o in bad))
    return [o.result for o in outcomes]


def tree_digest(cache: Any) -> str:
    """SHA-256 over a cache's tree: every node's id, parent, key, namespace, device and host
    slots, locks, hit count and page hashes, its hybrid components' device and host slots,
    pins and LRU stamps, plus the pool usage (hybrid: of the SWA and Mamba pools too, device
    and host). Ranks that took identical decisions have identical digests."""
    import hashlib

    h = hashlib.sha256()
    tree = cache.tree
    for n in sorted(tree.iter_nodes(), key=lambda n: n.id):
        parent = n.parent.id if n.parent is not None else -1
        dev = n.value.tobytes() if n.value is not None else b"-"
        host = n.host_value.tobytes() if n.host_value is not None else b"-"
        hashes = b"".join(n.digests) if n.digests else b"-"
        h.update(repr((n.id, parent, n.key.hex(), repr(n.ns), n.lock_ref, n.host_lock_ref,
                       n.hit_count)).encode())
        for part in (dev, host, hashes):
            h.update(len(part).to_bytes(8, "little") + part)
        # Hybrid components: device and host values, pins, LRU stamps.
        for i, v in enumerate(n.aux[QUEUES:]):
            if isinstance(v, np.ndarray):
                h.update(len(v).to_bytes(8, "little") + v.tobytes())
            elif i % WIDTH != QE:  # a queue entry says nothing the rest does not
                h.update(repr(v).encode())
    h.update(repr((cache.device_pool.allocator.used_size,
                   cache.host_pool.allocator.used_size if cache.host_pool else 0)).encode())
    hy = getattr(cache, "hybrid", None)
    if hy is not None:
        tier = hy.tier
        h.update(repr((
            hy.swa_map.swa.used_size if hy.swa_map is not None else -1,
            hy.mamba_pool.used_size if hy.mamba_pool is not None else -1,
            tier.swa_host.allocator.used_size if tier and tier.swa_host is not None else -1,
            tier.mamba_host.used_size if tier and tier.mamba_host is not None else -1,
            dict(tier.inflight) if tier is not None else None)).encode())
    return h.hexdigest()
