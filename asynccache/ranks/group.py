"""Rank groups: the one interface through which tensor/pipeline-parallel ranks agree.

Every rank of a serving instance runs its own cache over its own shard of the KV (a TP rank
holds some heads, a PP rank some layers) but all ranks must take *identical* tree decisions.
The decisions that depend on rank-local timing (how many finished copies to retire, how many
prefetched tokens to keep, whether a prefetch may stop, how many pages storage holds) are
reduced across ranks through a :class:`RankGroup`:

* :class:`SingleRank` is the identity (one process); the cache then keeps its immediate paths.
* :class:`TorchRankGroup` uses ``torch.distributed``. The cache's collectives (its *control
  plane*) run on process groups of their own, gloo by default even when the model's default
  group is NCCL: they carry a few hundred ints per tick, never pair up with the model's
  collectives, need no CUDA device, and a gloo timeout raises (NCCL's watchdog would tear
  the process down). They run on one dedicated thread (which sets the rank's CUDA device when
  there is one), in submission order (FIFO), and are awaited through the loop, so the loop
  never blocks and every rank issues them in the order its loop submitted them. A peer that
  dies or stops answering raises :class:`RankGroupError` after ``timeout_s`` instead of
  hanging.

Values are lists of ints; ``all_reduce_min`` reduces element-wise (a MAX is the MIN of the
negated values, so one collective carries both kinds, see :meth:`RankGroup.all_reduce_min_max`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
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
    ``r % tp_size`` of pipeline stage ``r // tp_size``; the world, TP and PP groups of the
    control plane are created on every rank (``torch.distributed.new_group`` must see every
    group on every rank, in the same order).

    ``control_backend``: ``"gloo"`` (default: dedicated gloo groups on CPU tensors, whatever
    the default group's backend) or ``"default"`` (dedicated groups of the default group's
    backend; with NCCL the collectives run on the rank's CUDA device and a timeout is NCCL's
    watchdog's to enforce -- it aborts the process -- so this is not recommended). ``device``
    is the rank's device (``cuda:<local rank>`` with NCCL), which the collective thread sets.
    """

    def __init__(self, *, tp_size: int = 1, device: str = "cpu", owns_default: bool = False,
                 timeout_s: float = 60.0, control_backend: str = "gloo") -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialised; use TorchRankGroup.create()")
        _check_control_backend(control_backend)
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
        self.backend = dist.get_backend()  # the default (the model's) group's
        self.control_backend = "gloo" if control_backend == "gloo" else self.backend
        self.device = device
        # Tensors of the control plane live where its backend wants them.
        self._tensor_device = device if self.control_backend == "nccl" else "cpu"
        self.timeout_s = timeout_s
        self._owns_default = owns_default
        timeout = timedelta(seconds=timeout_s)

        def new_group(ranks: list[int]) -> Any:
            try:
                return dist.new_group(ranks, timeout=timeout, backend=self.control_backend)
            except Exception as exc:
                raise RankGroupError(
                    f"rank {self.rank}/{self.size}: could not create the cache's "
                    f"{self.control_backend} group of ranks {ranks}: {exc}") from exc

        # Every rank creates every group, in the same order: world, TP groups, PP groups.
        self._groups: dict[str, Any] = {"world": new_group(list(range(self.size)))}
        tp_groups = [new_group(list(range(p * tp_size, (p + 1) * tp_size)))
                     for p in range(self.pp_size)]
        pp_groups = [new_group(list(range(t, self.size, tp_size))) for t in range(tp_size)]
        self._all_groups = [self._groups["world"], *tp_groups, *pp_groups]
        self._groups["tp"] = tp_groups[self.pp_rank]
        self._groups["pp"] = pp_groups[self.tp_rank]
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"asynccache-ranks-{self.rank}",
            initializer=self._thread_init)
        self._lock = threading.Lock()
        self._closed = False
        self._failed: BaseException | None = None
        self.calls = 0

    def _thread_init(self) -> None:
        """The collective thread runs on the rank's CUDA device (a new thread starts on
        cuda:0, where an NCCL collective would land)."""
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.set_device(torch.device(self.device))

    @classmethod
    def create(cls, rank: int, world_size: int, init_method: str, *, tp_size: int = 1,
               backend: str = "gloo", timeout_s: float = 60.0,
               device: str | None = None, control_backend: str = "gloo") -> TorchRankGroup:
        """Join (and create) the default process group, then build the control plane's world,
        TP and PP groups (gloo unless ``control_backend="default"``).

        ``init_method``: e.g. ``tcp://127.0.0.1:29500`` (every rank the same). ``backend``:
        the default group's (``"nccl"`` for a model on GPUs). ``timeout_s`` bounds every
        collective: a peer that died or hangs makes them fail after it.
        """
        import torch.distributed as dist

        _check_control_backend(control_backend)

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
                   timeout_s=timeout_s, control_backend=control_backend)

    @classmethod
    def from_initialized(cls, *, tp_size: int = 1, timeout_s: float = 60.0,
                         control_backend: str = "gloo") -> TorchRankGroup:
        """Wrap the already initialised default process group (the caller destroys it; the
        control plane's own groups are destroyed by :meth:`close`)."""
        import torch

        device = "cpu"
        if torch.distributed.get_backend() == "nccl":
            device = f"cuda:{torch.cuda.current_device()}"
        return cls(tp_size=tp_size, device=device, timeout_s=timeout_s,
                   control_backend=control_backend)

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
            t = torch.tensor(vals, dtype=torch.int64, device=self._tensor_device)
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
        # After a failed collective the groups are unusable (destroying them may wait on the
        # dead peer): leave them to process exit.
        if self._failed is not None or not self._dist.is_initialized():
            return
        if self._owns_default:
            self._dist.destroy_process_group()  # every group
            return
        for g in self._all_groups:
            with contextlib.suppress(Exception):
                self._dist.destroy_process_group(g)

    def __repr__(self) -> str:
        return (f"TorchRankGroup(rank={self.rank}/{self.size}, tp={self.tp_rank}/{self.tp_size}, "
                f"pp={self.pp_rank}/{self.pp_size}, backend={self.backend}, "
                f"control={self.control_backend})")


def _check_control_backend(control_backend: str) -> None:
    if control_backend not in ("gloo", "default"):
        raise ConfigError(
            f"control_backend must be 'gloo' or 'default', got {control_backend!r}")
