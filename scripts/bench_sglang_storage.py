#!/usr/bin/env python
"""asynccache as SGLang's L3 against SGLang's own ``HiCacheFile``, on the same pages, same run.

Both backends are created as SGLang's cache controller creates them (``AsyncCacheStorage``
through ``StorageBackendFactory`` with ``dynamic``; ``HiCacheFile`` directly) and called as
it calls them: ``batch_set`` of page tensors in batches of 128 pages, ``batch_get`` into page
tensors. Writes are not forced to disk on either side (SGLang's file backend never fsyncs;
asynccache's file backend by default neither). Reads are cold: every file of the directory
is dropped from the page cache (``posix_fadvise(DONTNEED)``) first.

The two sides alternate (A B A B), ``--reps`` rounds in fresh directories; the JSON gives each
side's median GB/s and the median of the per-round ratios (targets: writes >= 2, cold reads
>= 1). Needs sglang (scripts/install_sglang_cpu.sh). ``--quick`` runs in a few seconds.
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

BATCH = 128  # SGLang's STORAGE_BATCH_SIZE


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


def config(url: str, page_tokens: int, extra: dict[str, Any]) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="bench/model",
        extra_config={"backend_name": "asynccache", "class_name": "AsyncCacheStorage",
                      "module_path": "asynccache.integrations.sglang", "url": url,
                      "page_size": page_tokens, "kv_dtype": "float16", **extra})


def make(side: str, root: str, page_tokens: int) -> Any:
    if side == "asynccache":
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        return StorageBackendFactory.create_backend(
            "dynamic", config(f"file://{root}", page_tokens, {}), None)
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    return HiCacheFile(config("", page_tokens, {"file_storage_path": root}), file_path=root)


def run_side(side: str, keys: list[str], pages: list[torch.Tensor],
             page_tokens: int) -> tuple[float, float]:
    nbytes = sum(p.numel() * p.element_size() for p in pages)
    with tempfile.TemporaryDirectory(prefix=f"bench-{side}-") as root:
        storage = make(side, root, page_tokens)
        try:
            t0 = time.perf_counter()
            for i in range(0, len(keys), BATCH):
                assert storage.batch_set(keys[i:i + BATCH], pages[i:i + BATCH])
            write_s = time.perf_counter() - t0
            drop_cache(root)
            dst = [torch.empty_like(p) for p in pages]
            t0 = time.perf_counter()
            for i in range(0, len(keys), BATCH):
                got = storage.batch_get(keys[i:i + BATCH], dst[i:i + BATCH])
                assert all(g is not None for g in got), side
            read_s = time.perf_counter() - t0
            assert all(torch.equal(a, b) for a, b in zip(dst, pages, strict=True)), side
        finally:
            close = getattr(storage, "close", None)
            if close is not None:
                close()
    return nbytes / write_s / 1e9, nbytes / read_s / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-mib", type=float, default=1.0)
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.pages, a.reps = 64, 1
    page_numel = int(a.page_mib * 2**20) // 2  # float16
    page_tokens = 64
    g = torch.Generator().manual_seed(0)
    pages = [torch.randn(page_numel, generator=g).to(torch.float16) for _ in range(a.pages)]
    keys, prev = [], b""
    for i in range(a.pages):
        prev = hashlib.sha256(prev + i.to_bytes(8, "little")).digest()
        keys.append(prev.hex())
    rounds: dict[str, list[tuple[float, float]]] = {"asynccache": [], "sglang_file": []}
    for _ in range(a.reps):
        for side in ("asynccache", "sglang_file"):
            rounds[side].append(run_side(side, keys, pages, page_tokens))
    med = {side: {"write_gbs": round(statistics.median(w for w, _ in r), 3),
                  "cold_read_gbs": round(statistics.median(c for _, c in r), 3)}
           for side, r in rounds.items()}
    ratio_w = statistics.median(x[0] / y[0] for x, y in zip(rounds["asynccache"],
                                                           rounds["sglang_file"], strict=True))
    ratio_r = statistics.median(x[1] / y[1] for x, y in zip(rounds["asynccache"],
                                                           rounds["sglang_file"], strict=True))
    print(json.dumps({
        "benchmark": "sglang_storage", "page_bytes": page_numel * 2, "pages": a.pages,
        "reps": a.reps, **med, "ratio_write": round(ratio_w, 3),
        "ratio_cold_read": round(ratio_r, 3), "target_write": 2.0, "target_cold_read": 1.0,
        "loadavg_1m": os.getloadavg()[0],
    }, indent=2))


if __name__ == "__main__":
    main()
