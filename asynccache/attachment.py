"""Storage attachment: attach / detach / clear an L3 backend at runtime, name its objects, and
prefetch from it for a request.

The attached tier is one of three modes, each one class here with the same calls, so nothing
else asks which mode it is in: :class:`NoStorage` (nothing attached), :class:`CacheModeL3` (a
:class:`~asynccache.l3.StorageTier`: host memory is a cache tier, storage sits behind it) and
:class:`BufferModeL3` (a :class:`~asynccache.buffer.BufferModePipeline`: host memory only
stages storage reads and writes). On attach the tier's ports are plugged into the engine (it
hears of backups and write intents through them); on detach they are unplugged.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from asynccache.buffer import BufferModePipeline
from asynccache.engine import NO_STORAGE, LoadBacks, StoragePorts, TaskOwner, Tiering
from asynccache.errors import ConfigError, InvalidInputError
from asynccache.l3 import PrefetchOp, StoragePolicy, StorageTier
from asynccache.logs import get_logger
from asynccache.ranks import RankGroup
from asynccache.request import CacheRequest, rematch
from asynccache.tree import MatchResult, RadixKey, as_key

_log = get_logger("cache")


class NoStorage:
    """Nothing attached: no prefetch, nothing to write."""

    tier: StorageTier | None = None
    public: StorageTier | BufferModePipeline | None = None
    ports: StoragePorts = NO_STORAGE

    def start_prefetch(self, key: RadixKey, match: MatchResult) -> PrefetchOp | None:
        return None

    def begin_prefetch(self, req: CacheRequest) -> bool:
        return False

    def drop_prefetch(self, req: CacheRequest) -> None:
        req.prefetch = None

    def release_request(self, req: CacheRequest) -> None:
        return None

    async def prefetch_request(self, req: CacheRequest, policy: str | None) -> int:
        return 0

    async def load_staged(self, req: CacheRequest, mem_quota: int | None) -> int | None:
        return None

    def flush_writes(self) -> None:
        return None

    def check(self) -> None:
        return None

    def forget_stored(self) -> None:
        return None

    def unplug(self) -> None:
        """Detached: requests waiting on the tier see no storage from now on."""
        return None

    async def close(self) -> None:
        return None


class CacheModeL3(NoStorage):
    """Host memory is a cache tier; storage backs it up and prefetches into it."""

    def __init__(self, tier: StorageTier, tiering: Tiering, loads: LoadBacks) -> None:
        self.tier = self.public = self._tier = tier
        self.ports = tier.ports()
        self._t = tiering
        self._loads = loads

    def start_prefetch(self, key: RadixKey, match: MatchResult) -> PrefetchOp | None:
        assert self.tier is not None
        return self.tier.start_prefetch(key, match)

    def begin_prefetch(self, req: CacheRequest) -> bool:
        if req.prefetch is not None:
            return True
        if (self._t.commits.agreement is not None or self._t.parts.config.disable
                or req.finished or req.computed != req.prefix_len or req.pending_loads):
            return False
        req.prefetch = self.start_prefetch(req.key, req.match())
        return req.prefetch is not None

    def drop_prefetch(self, req: CacheRequest) -> None:
        """``req`` ends without finishing the fetch it began: release it in the background."""
        op, req.prefetch = req.prefetch, None
        if op is not None:
            assert self.tier is not None
            self.tier.abort_soon(op)

    async def prefetch_request(self, req: CacheRequest, policy: str | None) -> int:
        tier, tree = self.tier, self._t.tree
        assert tier is not None
        op, req.prefetch = req.prefetch, None
        if op is None:  # not begun at arrival: start it now
            if req.pending_loads:
                await self._loads.wait_loads(req.pending_loads)
            rematch(tree, req)  # other requests may have cached more of the prompt since admit
            if self.tier is None or not self._t.parts.life.running:
                return 0  # detached (or closing) while it waited
            op = tier.start_prefetch(req.key, req.match())
            if op is None:
                return 0
        got = await tier.finish_prefetch(op, policy)  # stop it per the policy
        # Matched again even when it added nothing: pages it found on host already (others
        # cached them while it ran) are the request's too.
        rematch(tree, req)
        return got

    def forget_stored(self) -> None:
        assert self.tier is not None
        self.tier.forget_known()

    def unplug(self) -> None:
        self.tier = None

    async def close(self) -> None:
        await self._tier.close()


class BufferModeL3(NoStorage):
    """Host memory only stages storage reads and writes (the tree holds nothing on host)."""

    def __init__(self, buffer: BufferModePipeline, tiering: Tiering) -> None:
        self.buffer = self.public = buffer
        self.ports = buffer.ports()
        self._tree = tiering.tree

    def start_prefetch(self, key: RadixKey, match: MatchResult) -> PrefetchOp | None:
        raise InvalidInputError(
            "start_prefetch is not available in buffer_only host mode: use prefetch_request"
        )

    def release_request(self, req: CacheRequest) -> None:
        self.buffer.release_request(req)

    async def prefetch_request(self, req: CacheRequest, policy: str | None) -> int:
        rematch(self._tree, req)  # fetch into a bounce parked for req
        return await self.buffer.prefetch_request(req, policy)

    async def load_staged(self, req: CacheRequest, mem_quota: int | None) -> int | None:
        before = req.prefix_len
        rematch(self._tree, req)
        if await self.buffer.load_staged(req, mem_quota):
            rematch(self._tree, req)
        return req.prefix_len - before

    def flush_writes(self) -> None:
        self.buffer.launch_writes()

    def check(self) -> None:
        self.buffer.check()

    def forget_stored(self) -> None:
        self.buffer.clear_beliefs()

    async def close(self) -> None:
        await self.buffer.close()


_NOTHING = NoStorage()

_REPLICATED_TP = ("tp_rank", "tp_size")


def layout_mismatches(backend: Any, cache: Any) -> list[str]:
    """How the ``backend``'s :class:`~asynccache.storage.base.StorageLayout` disagrees with the
    ``cache``'s own (``storage_layout()``), one message per field; empty: it may attach.

    Every field changes a page's bytes, their meaning or its object name, so every field must
    agree: ``model`` (another model's KV), ``page_size``, ``kv_dtype``, ``kv_layout``,
    ``kv_replicated`` (whole KV or one TP rank's heads), the TP and PP rank and size (another
    rank's heads or layers). Two exceptions: with ``kv_replicated`` on both sides the TP rank
    and size are in neither the bytes nor the name (the ranks share one object per page); and
    ``extra`` (the cache's geometry, ``L<layers>H<heads>D<head_dim>``) may be followed by
    ``-<tag>``, a format tag a caller adds to name its pages apart (the replay does).
    """
    from asynccache.storage.base import StorageLayout

    out = []
    replicated = cache.kv_replicated and getattr(backend, "kv_replicated", None) is True
    skip = _REPLICATED_TP if replicated else ()
    for f in dataclasses.fields(StorageLayout):
        name = f.name
        if name in skip:
            continue
        mine, theirs = getattr(cache, name), getattr(backend, name, None)
        if name == "extra":
            ok = isinstance(theirs, str) and (theirs == mine or theirs.startswith(f"{mine}-"))
            if not ok:
                out.append(f"backend layout extra {theirs!r} != cache extra {mine!r} (the "
                           "cache's geometry, optionally followed by '-<tag>')")
        elif theirs != mine or type(theirs) is not type(mine):
            out.append(f"backend layout {name} {theirs!r} != cache {name} {mine!r}")
    return out


class StorageAttachment:
    """The L3 tier of one cache, if any (see the module docstring)."""

    def __init__(self, tiering: Tiering, loads: LoadBacks, ranks: RankGroup,
                 tasks: TaskOwner) -> None:
        self._t = tiering
        self._p = tiering.parts
        self._loads = loads
        self._ranks = ranks
        self._tasks = tasks
        self.mode: NoStorage = _NOTHING

    @property
    def tier(self) -> StorageTier | None:
        """The cache-mode storage tier (None: none, or buffer-only host mode)."""
        return self.mode.tier

    @property
    def storage(self) -> StorageTier | BufferModePipeline | None:
        return self.mode.public

    def layout(self, *, tp_rank: int | None = None, tp_size: int | None = None,
               kv_replicated: bool | None = None) -> Any:
        from asynccache.storage.base import StorageLayout

        c, r = self._p.config, self._ranks
        return StorageLayout(
            model=c.model_name, page_size=c.page_size, kv_dtype=str(c.torch_dtype).split(".")[-1],
            kv_layout="page-major", tp_rank=r.tp_rank if tp_rank is None else tp_rank,
            tp_size=r.tp_size if tp_size is None else tp_size,
            kv_replicated=c.kv_replicated if kv_replicated is None else kv_replicated,
            pp_rank=r.pp_rank, pp_size=r.pp_size,
            extra=f"L{c.num_layers}H{c.num_heads}D{c.head_dim}",
        )

    def attach(self, backend: Any, policy: StoragePolicy | None) -> None:
        policy = policy or StoragePolicy()
        if not isinstance(policy, StoragePolicy):
            raise ConfigError(f"policy must be a StoragePolicy, got {policy!r}")
        current = self.mode.public
        if current is not None:
            if current.backend is not backend:
                raise ConfigError("a different storage backend is already attached; detach it first")
            if isinstance(current, StorageTier):  # attaching the same backend again: a new policy
                current.set_policy(policy)
            else:
                current.policy = policy
            return
        layout = getattr(backend, "layout", None)
        if layout is not None:
            mismatches = layout_mismatches(layout, self.layout())
            if mismatches:
                raise ConfigError("; ".join(mismatches))
        self._p.tree.enable_page_hashes()
        if self._p.config.host_mode == "buffer_only":
            buffer = BufferModePipeline(self._t, backend, policy, tasks=self._tasks)
            self.mode = BufferModeL3(buffer, self._t)
        else:
            tier = StorageTier(self._t, backend, policy, tasks=self._tasks)
            self.mode = CacheModeL3(tier, self._t, self._loads)
        self._t.effects.ports = self.mode.ports

    async def detach(self) -> bool:
        mode, self.mode = self.mode, _NOTHING
        if mode is _NOTHING:
            return True
        self._t.effects.ports = NO_STORAGE
        mode.unplug()
        task = self._tasks.spawn("detach", self._close(mode))
        return await asyncio.shield(task)

    async def wait_detached(self) -> None:
        """Wait for every detach still closing its tier (a cancelled detach keeps going)."""
        await self._tasks.drain("detach")

    @staticmethod
    async def _close(mode: NoStorage) -> bool:
        try:
            await mode.close()
        except Exception as exc:
            _log.error("storage_detach_failed", error=repr(exc))
            return False
        return True

    async def clear(self) -> int | None:
        current = self.mode.public
        if current is None:
            raise ConfigError("no storage backend is attached")
        self.mode.forget_stored()
        try:
            return int(await current.backend.clear())
        except Exception as exc:
            _log.error("storage_clear_failed", error=repr(exc))
            return None

    # ------------------------------------------------------------------ per mode
    def flush_writes(self) -> None:
        """Buffer-only host mode: start the D->H copies of the queued storage writes."""
        self.mode.flush_writes()

    def check(self) -> None:
        self.mode.check()

    def start_prefetch(self, key: RadixKey | Any, match: MatchResult) -> PrefetchOp | None:
        return self.mode.start_prefetch(as_key(key), match)

    def begin_prefetch(self, req: CacheRequest) -> bool:
        return self.mode.begin_prefetch(req)

    def drop_prefetch(self, req: CacheRequest) -> None:
        self.mode.drop_prefetch(req)

    def release_request(self, req: CacheRequest) -> None:
        """``req`` finished or was retracted: the buffer drops what it staged for it."""
        self.mode.release_request(req)

    async def prefetch_request(self, req: CacheRequest, policy: str | None) -> int:
        if self._p.config.disable:
            return 0
        if self.mode.public is not None and req.computed != req.prefix_len:
            raise InvalidInputError(
                f"request {req.rid}: prefetch_request must come before it computes tokens"
            )
        return await self.mode.prefetch_request(req, policy)

    async def load_staged(self, req: CacheRequest, mem_quota: int | None) -> int | None:
        """Buffer-only host mode: load the bounce parked for ``req``; returns the tokens the
        device prefix grew by (None: not buffer mode, load back from host memory instead)."""
        return await self.mode.load_staged(req, mem_quota)
