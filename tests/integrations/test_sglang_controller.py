"""SGLang's own HiCache controller (``HiCacheController``) on CPU with asynccache as its L3:
the controller attaches the adapter through its ``dynamic`` backend path, its backup thread
writes host-pool pages (v1 zero-copy calls, or the generic calls), its prefetch threads query
and read them back into other host pages, bit-exact, and asynccache's own backend reads what
the controller wrote. Single process: a 1-rank gloo group, SGLang's parallel context stated
for rank 0 of 1 (and cleared after)."""

from __future__ import annotations

import asyncio
import queue
import threading

import pytest
import torch

from asynccache.integrations.sglang_import_guard import missing_package_stand_in
from asynccache.storage.factory import open_backend

try:
    import torch.distributed as dist

    with missing_package_stand_in():
        from sglang.srt.managers.cache_controller import HiCacheController
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.utils import get_storage_hash_str
        from sglang.srt.runtime_context import get_parallel

    from asynccache.integrations.sglang import AsyncCacheStorage
except Exception as exc:  # not installed (scripts/install_sglang_cpu.sh installs it)
    pytest.skip(f"SGLang's cache controller does not import here ({exc!r}); run "
                "scripts/install_sglang_cpu.sh", allow_module_level=True)

PAGE = 4
LAYERS, HEADS, DIM = 2, 2, 8
TIMEOUT = 30.0


@pytest.fixture
def one_rank(tmp_path):
    """A 1-rank gloo group and SGLang's parallel context for it (both undone after)."""
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0,
                                world_size=1)
    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                                        attn_dcp_rank=0, attn_dcp_size=1)
    yield dist.group.WORLD
    get_parallel().clear_stamp()
    if made:
        dist.destroy_process_group()


def _controller(group, layout: str, url: str, v1: bool) -> tuple[HiCacheController,
                                                                 MHATokenToKVPoolHost]:
    kv = MHATokenToKVPool(64, PAGE, torch.float16, HEADS, DIM, LAYERS, "cpu", False,
                          start_layer=0, end_layer=LAYERS)
    alloc = PagedTokenToKVPoolAllocator(64, PAGE, torch.float16, "cpu", kv, False)
    host = MHATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, 4.0, 0, PAGE, layout,
                                pin_memory=False, device_capacity_tokens=kv.size,
                                start_layer=0, end_layer=LAYERS)
    g = torch.Generator().manual_seed(5)
    flat = host.kv_buffer.view(-1)
    flat.copy_(torch.randn(flat.numel(), generator=g).to(torch.float16))
    ctrl = HiCacheController(
        alloc, host, PAGE, group, threading.Event(), io_backend="direct",
        storage_backend="dynamic", model_name="tiny/llama",
        storage_backend_extra_config={
            "backend_name": "asynccache", "module_path": "asynccache.integrations.sglang",
            "class_name": "AsyncCacheStorage", "url": url, "page_size": PAGE,
            "kv_dtype": "float16", "interface_v1": int(v1)})
    return ctrl, host


def _page(host: MHATokenToKVPoolHost, start: int) -> torch.Tensor:
    return host.get_data_page(start, flat=True).view(torch.int16).clone()


@pytest.mark.parametrize(("layout", "v1"), [("page_first", True), ("layer_first", True),
                                            ("page_first", False)],
                         ids=["page_first-v1", "layer_first-v1", "page_first-generic"])
def test_sglang_controller_backs_up_and_prefetches_through_asynccache(
        one_rank, tmp_path, layout, v1):
    ctrl, host = _controller(one_rank, layout, f"file://{tmp_path}/l3", v1)
    try:
        storage = ctrl.storage_backend
        assert isinstance(storage, AsyncCacheStorage)
        assert storage.mem_pool_host is host
        zero_copy = ctrl.page_set_func.__name__ == "_page_set_zero_copy"
        assert zero_copy is v1
        tokens = list(range(100, 100 + 5 * PAGE))
        hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
        src = host.alloc(5 * PAGE)
        # the backup thread writes the pages (write_storage is what HiRadixCache calls)
        ctrl.write_storage(src, tokens, hash_value=hashes)
        done = ctrl.ack_backup_queue.get(timeout=TIMEOUT)
        assert done.completed_tokens == 5 * PAGE
        assert storage.batch_exists(hashes) == 5
        starts = src[::PAGE].tolist()

        async def ours() -> list[torch.Tensor]:  # asynccache reads SGLang's pages
            backend = await open_backend(f"file://{tmp_path}/l3", storage.layout)
            try:
                bufs = [torch.empty(host.get_data_page(0).numel(), dtype=torch.float16)
                        for _ in hashes]
                assert await backend.get_batch(hashes, bufs) == [True] * 5
                return bufs
            finally:
                await backend.aclose()

        for buf, s in zip(asyncio.run(ours()), starts, strict=True):
            assert torch.equal(buf.view(torch.int16), _page(host, s))

        # a request whose 5 leading pages are stored and a sixth is not
        op = ctrl.prefetch("req-1", tokens + list(range(7, 7 + PAGE)))
        hit = ctrl.prefetch_hit_queue.get(timeout=TIMEOUT)
        assert hit is op and op.storage_hit_count == 5 * PAGE
        assert op.hash_value == hashes
        dst = host.alloc(5 * PAGE)  # (what HiRadixCache does with a storage hit)
        op.host_indices = dst
        ctrl.prefetch_buffer.put(op)
        progress = []  # the acks the scheduler thread would consume, in order
        while True:
            ack = ctrl.ack_prefetch_queue.get(timeout=TIMEOUT)
            assert ack.rid == "req-1"
            if ack.completed_req:
                break
            progress.append(ack.completed_tokens)
        assert progress == [5 * PAGE]  # one storage batch, all of it read
        for s, d in zip(starts, dst[::PAGE].tolist(), strict=True):
            assert torch.equal(_page(host, d), _page(host, s))
    finally:
        ctrl.detach_storage_backend()
    with pytest.raises(queue.Empty):
        ctrl.ack_prefetch_queue.get_nowait()
