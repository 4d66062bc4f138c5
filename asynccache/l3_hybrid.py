"""Storage (L3) objects of hybrid caches: the SWA pages and Mamba states next to the KV pages.

Names: ``<page key>.swa`` for the SWA KV of a page, ``<key of a node's last page>.mamba`` for
the state after that page. A backup writes them with the node's KV pages. A prefetch is all or
nothing (behavior.md §1.16 step 5): once the KV pages have arrived, the SWA pages of the last
window and the state at the end must all be found, or nothing of it is inserted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from asynccache.cache import HierarchicalCache
    from asynccache.hybrid_tier import HybridTier
    from asynccache.l3 import PrefetchOp


class HybridStorage:
    """Component objects of one hybrid cache's storage tier."""

    def __init__(self, cache: HierarchicalCache) -> None:
        assert cache.hybrid is not None and cache.hybrid.tier is not None
        self.cache = cache
        self.tier: HybridTier = cache.hybrid.tier
        self.swa = self.tier.swa_host is not None
        self.mamba = self.tier.mamba_host is not None
        ps = cache.page_size
        self.window_span = -(-cache.config.sliding_window // ps) * ps if self.swa else 0

    # ------------------------------------------------------------------ write
    def node_objects(self, nid: int, keys: list[str]) -> tuple[list[str], list[torch.Tensor]]:
        """Keys and (copied) bytes of ``nid``'s component host copies."""
        tree = self.cache.tree
        out_k: list[str] = []
        out_b: list[torch.Tensor] = []
        ps = self.cache.page_size
        if self.swa:
            host = tree.component_host_slots_of(nid, "swa")
            if host is not None:
                assert self.tier.swa_host is not None
                for i, first in enumerate(host[::ps].tolist()):
                    out_k.append(f"{keys[i]}.swa")
                    out_b.append(self.tier.swa_host.read_page(first))
        if self.mamba:
            state = tree.component_host_slots_of(nid, "mamba")
            if state is not None:
                assert self.tier.mamba_host is not None
                out_k.append(f"{keys[-1]}.mamba")
                row = self.tier.mamba_host.states[int(state[0])].contiguous()
                out_b.append(row.view(torch.uint8).reshape(-1).clone())
        return out_k, out_b

    # ------------------------------------------------------------------ prefetch
    async def fetch(self, op: PrefetchOp, backend: Any) -> bool:
        """Fetch the SWA pages of the last window and the state at the end of ``op``'s arrived
        pages into host slots recorded on ``op`` (freed by :meth:`release` unless inserted)."""
        ps = self.cache.page_size
        done = op.completed_tokens
        if not done:
            return False
        keys = op.keys[: done // ps]
        parts: dict[str, np.ndarray] = {}
        op.parts = parts
        want_k: list[str] = []
        bufs: list[torch.Tensor] = []
        if self.swa:
            w = min(done, self.window_span)
            slots = self.tier.take_host("swa", w, self.cache.evict_host)
            if slots is None:
                return False
            parts["swa"] = slots
            assert self.tier.swa_host is not None
            want_k += [f"{k}.swa" for k in keys[len(keys) - w // ps :]]
            bufs += [torch.empty(self.tier.swa_host.page_bytes, dtype=torch.uint8)
                     for _ in range(w // ps)]
        if self.mamba:
            slots = self.tier.take_host("mamba", 1, self.cache.evict_host)
            if slots is None:
                return False
            parts["mamba"] = slots
            assert self.tier.mamba_host is not None
            row = self.tier.mamba_host.states[0]
            want_k.append(f"{keys[-1]}.mamba")
            bufs.append(torch.empty(row.numel() * row.element_size(), dtype=torch.uint8))
        ok = await backend.get_batch(want_k, bufs)
        if not all(ok):
            return False
        if "swa" in parts:
            assert self.tier.swa_host is not None
            for first, buf in zip(parts["swa"][::ps].tolist(), bufs, strict=False):
                self.tier.swa_host.write_page(first, buf)
        if "mamba" in parts:
            assert self.tier.mamba_host is not None
            dst = self.tier.mamba_host.states[int(parts["mamba"][0])]
            dst.view(-1).view(torch.uint8).copy_(bufs[-1])
        op.parts_ok = True
        return True

    def insert_args(self, op: PrefetchOp, done: int) -> dict[str, Any] | None:
        """``insert_host`` keywords for ``done`` arrived tokens, or None: not all parts came."""
        if not op.parts_ok or done != op.completed_tokens or op.parts is None:
            return None
        out: dict[str, Any] = {}
        swa = op.parts.get("swa")
        if swa is not None:
            full = np.full(done, -1, dtype=np.int64)
            full[done - len(swa) :] = swa
            out["swa_host_slots"] = full
        state = op.parts.get("mamba")
        if state is not None:
            out["mamba_host_slot"] = int(state[0])
        return out

    def release(self, op: PrefetchOp, *, inserted: bool) -> None:
        """The op's component host slots leave flight (kept by the tree if ``inserted``)."""
        for name, slots in (op.parts or {}).items():
            self.tier.give_host(name, slots, free=not inserted)
        op.parts = None
