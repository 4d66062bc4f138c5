"""Storage attachment of the cache facade: attach / detach / clear an L3 backend at runtime,
name its objects, and prefetch from it for a request (cache mode: :mod:`asynccache.l3`;
buffer-only host mode: :mod:`asynccache.buffer_mode`)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from asynccache.buffer_mode import BufferModePipeline
from asynccache.errors import ConfigError, InvalidInputError
from asynccache.l3 import PrefetchOp, StoragePolicy, StorageTier
from asynccache.logs import get_logger
from asynccache.tree import MatchResult, RadixKey, as_key

if TYPE_CHECKING:
    from asynccache.cache import HierarchicalCache
    from asynccache.requests import CacheRequest

_log = get_logger("cache")


class StorageAttachmentMixin:
    """Storage calls of :class:`~asynccache.HierarchicalCache`."""

    def storage_layout(self: HierarchicalCache, *, tp_rank: int | None = None, tp_size: int | None = None,
                       kv_replicated: bool | None = None) -> Any:
        """The :class:`storage.StorageLayout` naming this cache's pages in a backend.

        TP / PP rank and size default to the cache's rank group, ``kv_replicated`` to the
        config's (replicated KV, as with MLA: the TP ranks share one object per page).
        """
        from asynccache.storage.base import StorageLayout

        c, r = self.config, self.ranks
        return StorageLayout(
            model=c.model_name, page_size=c.page_size, kv_dtype=str(c.torch_dtype).split(".")[-1],
            kv_layout="page-major", tp_rank=r.tp_rank if tp_rank is None else tp_rank,
            tp_size=r.tp_size if tp_size is None else tp_size,
            kv_replicated=c.kv_replicated if kv_replicated is None else kv_replicated,
            pp_rank=r.pp_rank, pp_size=r.pp_size,
            extra=f"L{c.num_layers}H{c.num_heads}D{c.head_dim}",
        )

    @property
    def storage(self: HierarchicalCache) -> StorageTier | BufferModePipeline | None:
        """The attached L3 tier: a :class:`StorageTier`, or in buffer-only host mode the
        :class:`~asynccache.buffer_mode.BufferModePipeline` (both have ``drain()``)."""
        return self._storage if self._storage is not None else self._buffer

    def attach_storage(self: HierarchicalCache, backend: Any, policy: StoragePolicy | None = None) -> None:
        """Use ``backend`` (a started :class:`storage.StorageBackend`) as the L3 tier.

        Pages backed up to host from now on are written to it; requests can prefetch from it.
        The caller keeps ownership of the backend (close it after the cache).
        """
        self._check_open()
        policy = policy or StoragePolicy()
        if not isinstance(policy, StoragePolicy):
            raise ConfigError(f"policy must be a StoragePolicy, got {policy!r}")
        tier = self.storage
        if tier is not None:
            if tier.backend is not backend:
                raise ConfigError("a different storage backend is already attached; detach it first")
            if self._storage is not None:  # attaching the same backend again: a new policy
                self._storage.set_policy(policy)
            else:
                tier.policy = policy
            return
        layout = getattr(backend, "layout", None)
        if layout is not None and layout.page_size != self.page_size:
            raise ConfigError(
                f"backend layout page_size {layout.page_size} != cache page_size {self.page_size}"
            )
        self.tree.enable_page_hashes()
        if self.config.host_mode == "buffer_only":
            self._buffer = BufferModePipeline(self, backend, policy)
            return
        self._storage = StorageTier(self, backend, policy)

    async def detach_storage(self: HierarchicalCache) -> bool:
        """Stop using storage: abort prefetches, wait for writes, release their pins.

        Never raises for a storage fault: it is logged and ``False`` is returned (the tier is
        detached either way). Requests waiting on the tier see no storage from now on.
        Cancelling the call does not stop the detach: it finishes in the background, and
        ``aclose`` waits for it before freeing anything.
        """
        tier, self._storage = self._storage, None
        buffer, self._buffer = self._buffer, None
        if tier is None and buffer is None:
            return True
        task = asyncio.get_running_loop().create_task(self._close_tiers(tier, buffer))
        self._detaching.add(task)
        task.add_done_callback(self._detaching.discard)
        return await asyncio.shield(task)

    @staticmethod
    async def _close_tiers(tier: StorageTier | None, buffer: BufferModePipeline | None) -> bool:
        try:
            if tier is not None:
                await tier.close()
            if buffer is not None:
                await buffer.close()
        except Exception as exc:
            _log.error("storage_detach_failed", error=repr(exc))
            return False
        return True

    async def clear_storage(self: HierarchicalCache) -> int | None:
        """Remove this cache's pages from the attached backend and forget which pages were
        believed stored; returns how many were removed, or None if the backend failed (logged)."""
        self._check_open()
        tier = self.storage
        if tier is None:
            raise ConfigError("no storage backend is attached")
        if self._buffer is not None:
            self._buffer.clear_beliefs()
        if self._storage is not None:
            self._storage.forget_known()
        try:
            return int(await tier.backend.clear())
        except Exception as exc:
            _log.error("storage_clear_failed", error=repr(exc))
            return None

    def start_prefetch(self: HierarchicalCache, key: RadixKey | Any, match: MatchResult) -> PrefetchOp | None:
        """Start fetching the pages after ``match``'s cached prefix from storage."""
        self._check_open()
        if self._buffer is not None:
            raise InvalidInputError(
                "start_prefetch is not available in buffer_only host mode: use prefetch_request"
            )
        if self._storage is None:
            return None
        return self._storage.start_prefetch(as_key(key), match)

    def begin_prefetch(self: HierarchicalCache, req: CacheRequest) -> bool:
        """Start fetching ``req``'s uncached pages from storage now (when it arrives), so that
        :meth:`prefetch_request` at scheduling time stops the fetch per its policy and takes
        what arrived meanwhile (``best_effort`` then means something). Returns whether a fetch
        is running. Cache host mode on one rank only (else False: use ``prefetch_request``)."""
        self._check_open()
        self._check_request(req)
        if req.prefetch is not None:
            return True
        if (self._storage is None or self._agree is not None or self.config.disable
                or req.finished or req.computed != req.prefix_len or req.pending_loads):
            return False
        req.prefetch = self._storage.start_prefetch(req.key, self._match_of(req))
        return req.prefetch is not None

    def _drop_prefetch(self: HierarchicalCache, req: CacheRequest) -> None:
        """``req`` ends without finishing the fetch it began: release it in the background."""
        op, req.prefetch = req.prefetch, None
        if op is not None and self._storage is not None:
            self._storage.abort_soon(op)

    async def prefetch_request(self: HierarchicalCache, req: CacheRequest, *, policy: str | None = None) -> int:
        """Fetch ``req``'s uncached pages from storage into host memory (before it computes).

        ``policy``: the stop policy (default: the attached :class:`StoragePolicy`'s). Returns
        the tokens fetched; ``req.host_hit_length`` grows by as much (load them back next).
        """
        self._check_open()
        self._check_active(req)
        if (self._storage is None and self._buffer is None) or self.config.disable:
            return 0
        if req.computed != req.prefix_len:
            raise InvalidInputError(
                f"request {req.rid}: prefetch_request must come before it computes tokens"
            )
        if self._buffer is not None:  # buffer-only host: fetch into a bounce parked for req
            self._rematch(req)
            return await self._buffer.prefetch_request(req, policy)
        tier = self._storage
        assert tier is not None
        op, req.prefetch = req.prefetch, None
        if op is not None:  # begun at arrival: stop it now, per the policy
            got = await tier.finish_prefetch(op, policy)
            if got:
                self._rematch(req)
            return got
        if req.pending_loads:
            await self.wait_loads(req.pending_loads)
        self._rematch(req)  # other requests may have cached more of the prompt since admit
        if self._storage is not tier or self._state != "running":
            return 0  # detached (or closing) while it waited
        op = tier.start_prefetch(req.key, self._match_of(req))
        if op is None:
            return 0
        got = await tier.finish_prefetch(op, policy)
        if got:
            self._rematch(req)
        return got
