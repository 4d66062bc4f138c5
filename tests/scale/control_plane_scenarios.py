"""Rank-process code for tests/scale/test_control_plane.py (loaded by file path).

The cache's collectives run on a group of their own, so they never pair up with collectives
the model (the serving engine) issues on the default process group at the same time.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any


def joined(rank: int, world_size: int, init_method: str, timeout_s: float) -> Any:
    """A control plane whose collectives time out after ``timeout_s``, over a default group
    joined with a roomy rendezvous: on a loaded machine the ranks start seconds apart, which
    a short timeout takes for a dead peer. The caller destroys the default group."""
    from datetime import timedelta

    import torch.distributed as dist

    from asynccache.ranks import TorchRankGroup

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    return TorchRankGroup.from_initialized(timeout_s=timeout_s)


def _model_all_reduce(dist: Any, value: int, delay_s: float, out: list[Any]) -> None:
    """What a model's tensor-parallel all-reduce does: a SUM on the default group."""
    import torch

    time.sleep(delay_s)
    t = torch.tensor([value], dtype=torch.int64)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        out.append(int(t.item()))
    except Exception as exc:  # a wrong pairing can also fail
        out.append(repr(exc))


def interleaved(rank: int, world_size: int, init_method: str,
                control_backend: str = "gloo") -> dict[str, Any]:
    """The model and the cache issue collectives concurrently, in opposite orders on the two
    ranks: rank 0's model all-reduce starts first, rank 1's cache all-reduce starts first.
    On one shared group the first collective of each rank pairs with the other's (a SUM with
    a MIN: wrong values, an error or a hang); on separate groups each gets its own answer."""
    import torch.distributed as dist

    from asynccache.errors import RankGroupError
    from asynccache.ranks import TorchRankGroup

    group = TorchRankGroup.create(rank, world_size, init_method, timeout_s=5.0,
                                  control_backend=control_backend)
    out: dict[str, Any] = {"control_backend": group.control_backend,
                           "backend": group.backend, "device": group.device}
    try:
        model: list[Any] = []
        t = threading.Thread(target=_model_all_reduce,
                             args=(dist, 1000 * (rank + 1), 0.0 if rank == 0 else 0.4, model))
        t.start()

        async def cache_side() -> Any:
            await asyncio.sleep(0.4 if rank == 0 else 0.0)
            try:
                return await group.all_reduce_min_max([10 + rank], [10 + rank])
            except RankGroupError as exc:
                return str(exc)

        out["cache"] = asyncio.run(cache_side())
        t.join(20)
        out["model"] = model[0] if model else "no answer"
        asyncio.run(group.barrier())
    finally:
        group.close()
    return out


def timeout_is_an_error(rank: int, world_size: int, init_method: str) -> str:
    """Rank 1 never joins: rank 0's collective raises RankGroupError after the group timeout
    and the process lives on (it can still answer)."""
    import torch.distributed as dist

    from asynccache.errors import RankGroupError

    group = joined(rank, world_size, init_method, timeout_s=1.0)
    try:
        if rank == 1:
            time.sleep(3.0)
            return "slept"
        try:
            asyncio.run(group.all_reduce_min([1]))
        except RankGroupError as exc:
            with_default = dist.is_initialized()
            return f"raised (default group alive: {with_default}): {exc}"
        return "no error"
    finally:
        group.close()
        dist.destroy_process_group()
