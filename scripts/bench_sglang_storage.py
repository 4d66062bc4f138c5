#!/usr/bin/env python
"""asynccache as SGLang's L3 against SGLang's own ``HiCacheFile``, on the same pages, same run.

The pages live in SGLang's own host pool (``MHATokenToKVPoolHost`` on CPU, unpinned, in
``--layout``), and every backend is called the way SGLang's cache controller calls it:

* ``sglang_file``: ``HiCacheFile`` through the controller's generic path (``_generic_page_set``:
  ``get_data_page(index)`` of each page, then ``batch_set``; ``_generic_page_get``:
  ``batch_get`` into ``get_dummy_flat_data_page()`` buffers, then ``set_from_flat_data_page``);
  the controller never uses another path for ``HiCacheFile``.
* ``asynccache_v1``: the adapter created through SGLang's factory (``dynamic``) with
  ``interface_v1`` on, as the controller then calls it: ``batch_set_v1`` / ``batch_get_v1``
  with the pages' host indices (the file backend takes an MHA page's K and V pieces in place).
* ``asynccache_generic``: the adapter through the generic path, like ``sglang_file``.
* with ``--fsync``, also ``asynccache_v1_fsync``: ``fsync=True`` (data and directories durable
  before a write reports success; ``HiCacheFile`` never syncs).

Batches of 128 pages (SGLang's STORAGE_BATCH_SIZE). Reads are cold: every file is dropped from
the page cache first (``posix_fadvise(DONTNEED)`` after an ``fsync``, outside the timing), and
land in a second region of the host pool, checked bit-exact against the written pages. The
sides take turns (A B C A B C ..., the order rotated each round), ``--reps`` rounds in fresh
directories. Per side: median GB/s over rounds and the CPU seconds of the process per GiB
(all threads: steadier than wall time on a shared machine); ratios are medians of the
per-round ratios to ``sglang_file``, with their range. Targets: writes >= 2x, cold reads >= 1x.
``--quick`` runs in a few seconds. Needs sglang (scripts/install_sglang_cpu.sh).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asynccache.integrations.sglang_import_guard import missing_package_stand_in

with missing_package_stand_in():
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

BATCH = 128  # SGLang's STORAGE_BATCH_SIZE
PAGE_TOKENS = 64


def drop_cache(root: str) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)  # dirty pages cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def host_pool(layout: str, pages: int, layers: int, heads: int, dim: int) -> MHATokenToKVPoolHost:
    """SGLang's host pool with room for the written pages and the read-back region."""
    kv = MHATokenToKVPool(PAGE_TOKENS, PAGE_TOKENS, torch.float16, heads, dim, layers, "cpu",
                          False, start_layer=0, end_layer=layers)
    return MHATokenToKVPoolHost(
        kv.get_device_pool_infos()[0].buffer_info, 1.0, 0, PAGE_TOKENS, layout,
        pin_memory=False, device_capacity_tokens=kv.size, start_layer=0, end_layer=layers,
        host_token_capacity=2 * pages * PAGE_TOKENS)


def config(layout: str, extra: dict[str, Any]) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False,
        is_page_first_layout=layout == "page_first", model_name="bench/model",
        extra_config=extra)


def make(side: str, root: str, host: MHATokenToKVPoolHost) -> Any:
    if side == "sglang_file":
        return HiCacheFile(config(host.layout, {"file_storage_path": root}), file_path=root)
    extra = {"backend_name": "asynccache", "class_name": "AsyncCacheStorage",
             "module_path": "asynccache.integrations.sglang", "url": f"file://{root}",
             "page_size": PAGE_TOKENS, "kv_dtype": "float16",
             "interface_v1": int(side.startswith("asynccache_v1"))}
    if side.endswith("_fsync"):
        extra["backend_kwargs"] = {"fsync": True}
    storage = StorageBackendFactory.create_backend("dynamic", config(host.layout, extra), host)
    storage.register_mem_pool_host(host)
    return storage


def write(side: str, storage: Any, host: MHATokenToKVPoolHost, keys: list[str],
          idx: torch.Tensor) -> None:
    for i in range(0, len(keys), BATCH):
        k = keys[i:i + BATCH]
        ix = idx[i * PAGE_TOKENS:(i + len(k)) * PAGE_TOKENS]
        if side.startswith("asynccache_v1"):
            assert all(storage.batch_set_v1(k, ix)), side
        else:  # the controller's _generic_page_set
            assert storage.batch_set(k, [host.get_data_page(ix[j * PAGE_TOKENS])
                                         for j in range(len(k))]), side


def read(side: str, storage: Any, host: MHATokenToKVPoolHost, keys: list[str],
         idx: torch.Tensor) -> None:
    for i in range(0, len(keys), BATCH):
        k = keys[i:i + BATCH]
        ix = idx[i * PAGE_TOKENS:(i + len(k)) * PAGE_TOKENS]
        if side.startswith("asynccache_v1"):
            assert all(storage.batch_get_v1(k, ix)), side
            continue
        dst = [host.get_dummy_flat_data_page() for _ in k]  # the controller's _generic_page_get
        got = storage.batch_get(k, dst)
        for j, page in enumerate(got):
            assert page is not None, side
            host.set_from_flat_data_page(int(ix[j * PAGE_TOKENS]), page)


def run_side(side: str, host: MHATokenToKVPoolHost, keys: list[str], src: torch.Tensor,
             dst: torch.Tensor, page_bytes: int) -> dict[str, float]:
    nbytes = page_bytes * len(keys)
    for s in dst[::PAGE_TOKENS].tolist():  # poison the read-back region
        host.get_data_page(s, flat=False).fill_(0)
    with tempfile.TemporaryDirectory(prefix=f"bench-{side}-") as root:
        storage = make(side, root, host)
        try:
            os.sync()
            t0, c0 = time.perf_counter(), time.process_time()
            write(side, storage, host, keys, src)
            w_s, w_cpu = time.perf_counter() - t0, time.process_time() - c0
            drop_cache(root)
            t0, c0 = time.perf_counter(), time.process_time()
            read(side, storage, host, keys, dst)
            r_s, r_cpu = time.perf_counter() - t0, time.process_time() - c0
            for a, b in zip(src[::PAGE_TOKENS].tolist(), dst[::PAGE_TOKENS].tolist(), strict=True):
                assert torch.equal(host.get_data_page(a).view(torch.int16),
                                   host.get_data_page(b).view(torch.int16)), side
        finally:
            close = getattr(storage, "close", None)
            if close is not None:
                close()
    gib = nbytes / 2**30
    return {"write_gbs": nbytes / w_s / 1e9, "cold_read_gbs": nbytes / r_s / 1e9,
            "write_cpu_s_per_gib": w_cpu / gib, "read_cpu_s_per_gib": r_cpu / gib}


def _range(xs: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3),
            "max": round(max(xs), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", default="page_first",
                    choices=("page_first", "layer_first", "page_first_direct", "page_head"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--fsync", action="store_true", help="also asynccache_v1 with fsync=True")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.pages, a.reps = 32, 2
    host = host_pool(a.layout, a.pages, a.layers, a.heads, a.head_dim)
    g = torch.Generator().manual_seed(0)
    flat = host.kv_buffer.view(-1)
    flat.copy_(torch.randn(flat.numel(), generator=g).to(torch.float16))
    src = host.alloc(a.pages * PAGE_TOKENS)
    dst = host.alloc(a.pages * PAGE_TOKENS)
    page_bytes = host.get_data_page(0).numel() * 2
    keys, prev = [], b""
    for i in range(a.pages):
        prev = hashlib.sha256(prev + i.to_bytes(8, "little")).digest()
        keys.append(prev.hex())
    sides = ["asynccache_v1", "sglang_file", "asynccache_generic"]
    if a.fsync:
        sides.append("asynccache_v1_fsync")
    rounds: dict[str, list[dict[str, float]]] = {s: [] for s in sides}
    for r in range(a.reps):
        for side in sides[r % len(sides):] + sides[:r % len(sides)]:
            rounds[side].append(run_side(side, host, keys, src, dst, page_bytes))
    out: dict[str, Any] = {
        "benchmark": "sglang_storage", "layout": a.layout, "page_bytes": page_bytes,
        "pages": a.pages, "reps": a.reps, "sides": {}, "ratios_vs_sglang_file": {}}
    for side, rs in rounds.items():
        out["sides"][side] = {m: _range([r[m] for r in rs]) for m in rs[0]}
    base = rounds["sglang_file"]
    for side in sides:
        if side == "sglang_file":
            continue
        out["ratios_vs_sglang_file"][side] = {
            "write": _range([x["write_gbs"] / y["write_gbs"] for x, y in zip(rounds[side], base, strict=True)]),
            "cold_read": _range([x["cold_read_gbs"] / y["cold_read_gbs"] for x, y in zip(rounds[side], base, strict=True)]),
            "write_cpu": _range([x["write_cpu_s_per_gib"] / y["write_cpu_s_per_gib"] for x, y in zip(rounds[side], base, strict=True)]),
        }
    out.update(target_write=2.0, target_cold_read=1.0, loadavg_1m=os.getloadavg()[0])
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
