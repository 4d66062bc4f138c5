"""Drivers that run one write-back workload on SGLang's real *hybrid* tree and on ours.

The hybrid counterparts of ``tests/tree/sglang_write_back.py``: ``SGLangHybridWriteBack``
drives SGLang 0.5.23's own ``UnifiedTreeCore`` (its Python core) with a sliding-window (SWA)
and / or a Mamba component next to FULL attention, the way its ``UnifiedRadixCache`` does under
``--hicache-write-policy write_back`` in host-cache mode: an eviction backs each un-backed victim
up (FULL KV and the component data its ``build_backup_spec`` names), retires the copy's
acknowledgement and demotes the victim before the walk picks the next one.

What the cache would do outside the tree is reduced to bookkeeping: the SWA allocator is a
stand-in whose full->SWA translation is the identity (our tree names SWA data by FULL slots
too), and frees go nowhere; component actions the tree emits (``SWARebuild`` and the other SWA
recoveries) are applied by the component itself, as the cache routes them. The Mamba component
is built without the server arguments its constructor reads (checkpoint grid = page size, no
per-path state cap).

``OursHybridWriteBack`` runs the same operations on asynccache's hybrid ``RadixTree``, as
``OursWriteBack`` does (the component host slots of each backup are fresh numbers). Both report
device removals through the trees' KV events, pages named by their token paths.

Not driven: load-backs (the reference's SWA load-back allocates through the cache's SWA pool
in its prepare step) and host eviction.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from tests.tree.sglang_write_back import SGLANG_PROBLEM, OursWriteBack, SGLangWriteBack

if SGLANG_PROBLEM is None:
    from asynccache.integrations.sglang_import_guard import missing_package_stand_in

    with missing_package_stand_in():
        import torch
        from sglang.srt.environ import envs
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.cache_action import ComponentAction
        from sglang.srt.mem_cache.unified_cache.components.base import (
            ComponentType,
            TreeComponent,
        )
        from sglang.srt.mem_cache.unified_cache.components.full import FullComponent
        from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent
        from sglang.srt.mem_cache.unified_cache.components.swa import SWAComponent
        from sglang.srt.mem_cache.unified_cache.tree_core_registry import create_tree_core

    class _SWAAllocator(SWATokenToKVPoolAllocator):
        """The SWA allocator the component insists on, reduced to what the tree paths driven
        here call: the full->SWA translation is the identity, mappings and frees are no-ops."""

        def __init__(self) -> None:  # (the real one sizes device pools)
            self.device = "cpu"

        def translate_swa_indices_for_transfer(self, full: Any) -> Any:
            return full.clone()

        def set_full_to_swa_mapping(self, *args: Any) -> None:
            pass

        def clear_full_to_swa_mapping(self, *args: Any) -> None:
            pass

        def free_full_segment(self, *args: Any, **kw: Any) -> None:
            pass

        def free_swa_segment(self, *args: Any, **kw: Any) -> None:
            pass

    class _Mamba(MambaComponent):
        """SGLang's Mamba component without the server arguments its constructor reads."""

        def __init__(self, cache: Any, params: Any) -> None:
            TreeComponent.__init__(self, cache, params)
            self.mamba_cache_chunk_size = params.page_size
            self.mamba_checkpoint_grid = params.page_size
            self.mamba_max_states_per_path = -1  # (no per-path cap)
            self._mamba_pool_host = None


class SGLangHybridWriteBack(SGLangWriteBack):
    """SGLang's Python ``UnifiedTreeCore`` with FULL plus SWA (``window`` > 0) and / or Mamba
    components under write-back (host-cache mode)."""

    def __init__(self, page_size: int = 1, policy: str = "lru", window: int = 0,
                 mamba: bool = False) -> None:
        assert SGLANG_PROBLEM is None, SGLANG_PROBLEM
        assert window > 0 or mamba
        full, swa, mam = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA
        self.ps = page_size
        kinds = (full,) + ((swa,) if window else ()) + ((mam,) if mamba else ())
        alloc: Any = _SWAAllocator() if window else SimpleNamespace(device="cpu")
        pool = HybridReqToTokenPool.__new__(HybridReqToTokenPool) if mamba else None
        params = CacheInitParams(
            req_to_token_pool=pool, token_to_kv_pool_allocator=alloc, page_size=page_size,
            disable=False, tree_components=kinds, eviction_policy=policy,
            enable_kv_cache_events=True, tree_core_backend="python",
            sliding_window_size=window or None)
        # (the components read only these of their cache on the paths driven here)
        owner = SimpleNamespace(
            enable_session_radix_cache=False, page_size=page_size, is_swa_enabled=bool(window),
            is_mamba_enabled=mamba, token_to_kv_pool_allocator=alloc, req_to_token_pool=pool,
            tree_components=kinds, enable_mamba_extra_buffer=False)
        comps: dict[Any, Any] = {full: FullComponent(owner, params)}
        if window:
            comps[swa] = SWAComponent(owner, params)
        if mamba:
            comps[mam] = _Mamba(owner, params)
        with envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.override("python"):
            core = create_tree_core("python", params, comps)
        self._adopt(core, kinds)
        self.core.has_swa_host_pool = bool(window)  # (a host SWA pool: host-cache mode)
        self.mamba = mamba
        self.next_state = 0

    def _actions(self, actions: list[Any]) -> None:
        """Route the component actions to their component (as the cache does); the cache's
        own actions are frees here. Under write-back nothing asks for a backup."""
        super()._actions(actions)
        for a in actions:
            if isinstance(a, ComponentAction):
                self.core.components_by_type[a.component_type].apply_component_action(a)

    def insert(self, tokens: list[int], state: int | None = None) -> None:
        """Insert ``tokens``; ``state``: a Mamba state slot for its end (Mamba trees)."""
        if state is None:
            super().insert(tokens)
        else:
            super().insert(tokens, mamba_value=torch.tensor([state], dtype=torch.int64))

    def _place_components(self, comp: Any) -> None:
        """The component data of a backup gets fresh host slot numbers."""
        for xfers in comp.values():
            for x in xfers:
                x.host_indices = self._slots(len(x.device_indices)) + 2 * 10**6

    def load(self, tokens: list[int]) -> int:
        raise NotImplementedError("hybrid load-backs are not driven (module docstring)")

    def evict_host(self, num_tokens: int) -> tuple[int, list[tuple[int, ...]]]:
        raise NotImplementedError("hybrid host eviction is not driven (module docstring)")


class OursHybridWriteBack(OursWriteBack):
    """asynccache's hybrid ``RadixTree`` under write-back, driven like
    :class:`SGLangHybridWriteBack`."""

    def __init__(self, page_size: int = 1, policy: str = "lru", window: int = 0,
                 mamba: bool = False) -> None:
        assert window > 0 or mamba
        super().__init__(page_size, policy, sliding_window=window, mamba=mamba)

    def insert(self, tokens: list[int], state: int | None = None) -> None:
        kw: dict[str, Any] = {} if state is None else {"mamba_value": state}
        res = self.tree.insert(tokens, self._slots(len(tokens)), **kw)
        assert not res.backups
        self.tree.sanity_check()

    def _commit(self, req: Any) -> list[int]:
        parts = {name: self._slots(len(v)) + 2 * 10**6
                 for name, v in (req.component_slots or {}).items()}
        return self.tree.commit_backup(req.op_id, self._slots(req.num_tokens) + 10**6,
                                       parts or None)

    def match(self, tokens: list[int]) -> tuple[int, int, Any]:
        """Ours, with the host hit measured as the reference measures it: the host copies
        between ``best_node`` and ``last_device_node``. Ours counts every token a load-back
        adds to the device prefix, which in a hybrid tree includes nodes whose FULL KV is on
        device but whose state or window is not (docs/differences.md)."""
        dev, _, m = super().match(tokens)
        nodes = {n.id: n for n in self.tree.iter_nodes()}
        copied = 0
        node = nodes.get(m.best_node)
        while node is not None and node.id != m.last_device_node:
            copied += node.ntok if node.host_value is not None else 0
            node = node.parent
        return dev, copied, m

    def load(self, tokens: list[int]) -> int:
        raise NotImplementedError("hybrid load-backs are not driven (module docstring)")

    def evict_host(self, num_tokens: int) -> tuple[int, list[tuple[int, ...]]]:
        raise NotImplementedError("hybrid host eviction is not driven (module docstring)")
