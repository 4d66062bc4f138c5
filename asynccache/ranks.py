"""Rank groups: the one interface through which tensor/pipeline-parallel ranks agree.

Every rank of a serving instance runs its own cache over its own shard of the KV (a TP rank
holds some heads, a PP rank some layers) but all ranks must take *identical* tree decisions.
The decisions that depend on rank-local timing (how many finished copies to retire, how many
prefetched tokens to keep, whether a prefetch may stop, how many pages storage holds) are
reduced across ranks through a :class:`RankGroup`:

* :class:`SingleRank` is the identity (one process); the cache then keeps its immediate paths.
* :class:`TorchRankGroup` uses ``torch.distributed`` (gloo on CPU, NCCL on GPU). Its collectives
  run on one dedicated thread, in submission order (FIFO), and are awaited through the loop,
  so the loop never blocks and every rank issues them in the order its loop submitted them.
  A peer that dies or stops answering raises :class:`RankGroupError` after ``timeout_s``
  (the process group's own timeout) instead of hanging.

Values are lists of ints; ``all_reduce_min`` reduces element-wise (a MAX is the MIN of the
negated values, so one collective carries both kinds, see :meth:`RankGroup.all_reduce_min_max`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

from asynccache.errors import ConfigError, InvalidInputError, RankGroupError
from asynccache.logs import get_logger

__all__ = ["SCOPES", "RankGroup", "SingleRank", "TorchRankGroup", "free_port"]

_log = get_logger("ranks")

#: ``world``: every rank of the instance; ``tp`` / ``pp``: this rank's tensor / pipeline group.
SCOPES = ("world", "tp", "pp")


def _ints(values: Sequence[int], what: str) -> list[int]:
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise InvalidInputError(f"{what}: values must be ints, got {v!r}")
        out.append(int(v))
    return out


@runtime_checkable
class RankGroup(Protocol):
    """What the cache needs from a group of ranks."""

    rank: int
    size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int

    @property
    def is_single(self) -> bool: ...

    async def all_reduce_min(self, values: Sequence[int], scope: str = "world") -> list[int]: ...

    async def all_reduce_min_max(self, mins: Sequence[int], maxs: Sequence[int],
                                 scope: str = "world") -> tuple[list[int], list[int]]: ...

    async def all_gather_bytes(self, data: bytes, scope: str = "world") -> list[bytes]: ...

    async def barrier(self, scope: str = "world") -> None: ...

    def close(self) -> None: ...


class SingleRank:
    """The identity group of one process: every reduction returns its input."""

    rank = 0
    size = 1
    tp_rank = 0
    tp_size = 1
    pp_rank = 0
    pp_size = 1

    @property
    def is_single(self) -> bool:
        return True

    async def all_reduce_min(self, values: Sequence[int], scope: str = "world") -> list[int]:
        _check_scope(scope)
        return _ints(values, "all_reduce_min")

    async def all_reduce_min_max(self, mins: Sequence[int], maxs: Sequence[int],
                                 scope: str = "world") -> tuple[list[int], list[int]]:
        _check_scope(scope)
        return _ints(mins, "all_reduce_min_max"), _ints(maxs, "all_reduce_min_max")

    async def all_gather_bytes(self, data: bytes, scope: str = "world") -> list[bytes]:
        _check_scope(scope)
        return [bytes(data)]

    async def barrier(self, scope: str = "world") -> None:
        _check_scope(scope)

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return "SingleRank()"


def _check_scope(scope: str) -> None:
    if scope not in SCOPES:
        raise InvalidInputError(f"unknown rank scope {scope!r}; choose one of {list(SCOPES)}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for a rendezvous)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TorchRankGroup:
    """A ``torch.distributed`` group; collectives on one dedicated thread, awaited on the loop.

    Build it with :meth:`create` (initialises the default process group: every rank calls it
    with the same ``init_method``, ``world_size`` and ``tp_size``) or wrap an already
    initialised default group with :meth:`from_initialized`. Rank ``r`` is TP rank
    ``r % tp_size`` of pipeline stage ``r // tp_size``; the TP and PP sub-groups are created on
    every rank (``torch.distributed.new_group`` must see every group on every rank).
    """

    def __init__(self, *, tp_size: int = 1, device: str = "cpu", owns_default: bool = False,
                 timeout_s: float = 60.0) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialised; use TorchRankGroup.create()")
        self._dist = dist
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1 \
                or self.size % tp_size:
            raise ConfigError(f"tp_size must divide the world size {self.size}, got {tp_size!r}")
        self.tp_size = tp_size
        self.pp_size = self.size // tp_size
        self.tp_rank = self.rank % tp_size
        self.pp_rank = self.rank // tp_size
        self.backend = dist.get_backend()
        self.device = device
        self.timeout_s = timeout_s
        self._owns_default = owns_default
        self._groups: dict[str, Any] = {"world": None}
        tp_groups = [dist.new_group(list(range(p * tp_size, (p + 1) * tp_size)))
                     for p in range(self.pp_size)]
        pp_groups = [dist.new_group(list(range(t, self.size, tp_size))) for t in range(tp_size)]
        self._groups["tp"] = tp_groups[self.pp_rank]
        self._groups["pp"] = pp_groups[self.tp_rank]
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"asynccache-ranks-{self.rank}")
        self._lock = threading.Lock()
        self._closed = False
        self._failed: BaseException | None = None
        self.calls = 0

    @classmethod
    def create(cls, rank: int, world_size: int, init_method: str, *, tp_size: int = 1,
               backend: str = "gloo", timeout_s: float = 60.0,
               device: str | None = None) -> TorchRankGroup:
        """Join (and create) the default process group, then build the TP / PP groups.

        ``init_method``: e.g. ``tcp://127.0.0.1:29500`` (every rank the same). ``timeout_s``
        bounds every collective: a peer that died or hangs makes them fail after it.
        """
        import torch.distributed as dist

        for name, value in (("rank", rank), ("world_size", world_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
        if world_size < 1 or rank >= world_size:
            raise ConfigError(f"rank {rank} is not in a world of size {world_size}")
        if backend not in ("gloo", "nccl"):
            raise ConfigError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0, got {timeout_s!r}")
        if backend == "nccl":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError("backend 'nccl' needs CUDA, which is not available")
            local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
            device = device or f"cuda:{local}"
            torch.cuda.set_device(torch.device(device))
        try:
            dist.init_process_group(backend, init_method=init_method, rank=rank,
                                    world_size=world_size, timeout=timedelta(seconds=timeout_s))
        except Exception as exc:  # rendezvous timeout, refused connection, bad URL
            raise RankGroupError(
                f"rank {rank}/{world_size} could not join {init_method!r} ({backend}): {exc}"
            ) from exc
        return cls(tp_size=tp_size, device=device or "cpu", owns_default=True,
                   timeout_s=timeout_s)

    @classmethod
    def from_initialized(cls, *, tp_size: int = 1, timeout_s: float = 60.0) -> TorchRankGroup:
        """Wrap the already initialised default process group (the caller destroys it)."""
        import torch

        device = "cpu"
        if torch.distributed.get_backend() == "nccl":
            device = f"cuda:{torch.cuda.current_device()}"
        return cls(tp_size=tp_size, device=device, timeout_s=timeout_s)

    @property
    def is_single(self) -> bool:
        return False

    # -- the collective thread ----------------------------------------------------------------
    def _submit(self, what: str, fn: Any) -> asyncio.Future[Any]:
        """Queue ``fn`` on the collective thread now (FIFO); returns a loop future of it."""
        with self._lock:
            if self._closed:
                raise RankGroupError(f"rank {self.rank}: {what} on a closed rank group")
            if self._failed is not None:
                raise RankGroupError(
                    f"rank {self.rank}: {what} after an earlier collective failed "
                    f"({self._failed})") from self._failed
            self.calls += 1
            seq = self.calls

            def run() -> Any:
                try:
                    return fn()
                except Exception as exc:
                    self._failed = exc
                    _log.error("collective_failed", rank=self.rank, op=what, seq=seq,
                               error=repr(exc))
                    raise RankGroupError(
                        f"rank {self.rank}/{self.size}: collective #{seq} ({what}) failed — a "
                        f"peer died, timed out after {self.timeout_s:g} s or called "
                        f"collectives in a different order: {exc}"
                    ) from exc

            cf = self._pool.submit(run)
        return asyncio.wrap_future(cf)

    async def _call(self, what: str, fn: Any) -> Any:
        # Once submitted a collective must run (the peers are in it too): a cancelled awaiter
        # stops waiting, the collective still completes on the thread.
        return await asyncio.shield(self._submit(what, fn))

    def submit_min(self, values: Sequence[int], scope: str = "world") -> asyncio.Future[list[int]]:
        """Queue an element-wise MIN now; the future resolves on the loop with the result."""
        _check_scope(scope)
        vals = _ints(values, "all_reduce_min")
        group = self._groups[scope]
        dist = self._dist

        def run() -> list[int]:
            import torch

            if not vals:
                return []
            t = torch.tensor(vals, dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
            return [int(x) for x in t.cpu().tolist()]

        return self._submit(f"all_reduce_min[{len(vals)}]@{scope}", run)

    async def all_reduce_min(self, values: Sequence[int], scope: str = "world") -> list[int]:
        return await asyncio.shield(self.submit_min(values, scope))

    async def all_reduce_min_max(self, mins: Sequence[int], maxs: Sequence[int],
                                 scope: str = "world") -> tuple[list[int], list[int]]:
        a = _ints(mins, "all_reduce_min_max")
        b = _ints(maxs, "all_reduce_min_max")
        out = await self.all_reduce_min(a + [-x for x in b], scope)
        return out[: len(a)], [-x for x in out[len(a):]]

    async def all_gather_bytes(self, data: bytes, scope: str = "world") -> list[bytes]:
        _check_scope(scope)
        group = self._groups[scope]
        dist = self._dist
        payload = bytes(data)

        def run() -> list[bytes]:
            n = dist.get_world_size(group)
            out: list[Any] = [None] * n
            dist.all_gather_object(out, payload, group=group)
            return [bytes(x) for x in out]

        return list(await self._call(f"all_gather_bytes@{scope}", run))

    async def barrier(self, scope: str = "world") -> None:
        await self.all_reduce_min([0], scope)

    def close(self) -> None:
        """Stop the collective thread; destroy the process group if :meth:`create` made it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        # After a failed collective the group is unusable (destroying it may wait on the dead
        # peer): leave it to process exit.
        if self._owns_default and self._failed is None and self._dist.is_initialized():
            self._dist.destroy_process_group()

    def __repr__(self) -> str:
        return (f"TorchRankGroup(rank={self.rank}/{self.size}, tp={self.tp_rank}/{self.tp_size}, "
                f"pp={self.pp_rank}/{self.pp_size}, backend={self.backend})")
