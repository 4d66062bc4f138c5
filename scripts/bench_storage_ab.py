#!/usr/bin/env python
"""Durable file-backend writes (``fsync=True``, one file per page and 2 MiB segments): grouped
write jobs (several files written, then synced, then published: ``PageFiles.write_group``)
against one file per job (write, sync, publish, the earlier scheme), interleaved in rounds with
raw sequential durable writes of the same bytes in the same run.

Per round and page size, in a rotating order: ``raw_write`` (one file, 4 MiB writes, one fsync
at the end), ``raw_write_direct`` (the same with ``O_DIRECT``), ``raw_write_batch_sync``
(page-sized writes, an fsync after every batch), the backend with grouped jobs and with one
file a job. Each backend write is divided by the fastest raw write of its round
(``ratio_per_round``); ``ratio`` is their median. Prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_storage import (  # type: ignore[import-not-found]
    MiB,
    backend_read,
    backend_write,
    keys_for,
    pages_for,
    parse_sizes,
    raw_read,
    raw_write,
    raw_write_direct,
)

from asynccache.storage.base import StorageLayout
from asynccache.storage.file import FileBackend


def one_file_a_job(b: FileBackend) -> FileBackend:
    b._write_jobs = lambda files, total: [[f] for f in files]  # type: ignore[method-assign]
    return b


async def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"load_before": os.getloadavg(), "sizes": {}}
    with tempfile.TemporaryDirectory(prefix="bench-ab-", dir=args.dir) as tmp:
        root = Path(tmp)
        chunk = os.urandom(4 * MiB)
        for size in args.sizes:
            n = max(8, args.total // size)
            pages = pages_for(n, size)
            layout = StorageLayout(model="bench", page_size=size)
            rows: dict[str, list[float]] = {}
            names = ["raw_write", "raw_write_direct", "raw_write_batch_sync", "grouped", "per_file"]
            if args.segment:
                names += ["grouped_seg", "per_file_seg"]
            if args.read:
                names += ["raw_read", "read"]
            for r in range(args.rounds):
                order = names[r % len(names):] + names[: r % len(names)]
                for name in order:
                    raw_path = root / "raw.bin"
                    if name == "raw_write":
                        v = raw_write(raw_path, n * size // len(chunk) * len(chunk), chunk)
                    elif name == "raw_write_direct":
                        v = raw_write_direct(root / "d.bin", n * size // len(chunk) * len(chunk), chunk)
                        (root / "d.bin").unlink(missing_ok=True)
                    elif name == "raw_write_batch_sync":
                        v = raw_write(raw_path, n * size, bytes(pages[0]), args.batch * size)
                    elif name == "raw_read":
                        raw_write(raw_path, n * size // len(chunk) * len(chunk), chunk)
                        v = raw_read(raw_path, 4 * MiB)
                    else:
                        seg = 2 * MiB if name.endswith("_seg") else None
                        d = root / f"{name}{r}"
                        b = FileBackend(d, layout, fsync=True, timeout_s=120, segment_bytes=seg)
                        if name.startswith("per_file"):
                            one_file_a_job(b)
                        keys = keys_for(n, f"{name}:{size}:{r}")
                        if name == "read":
                            await backend_write(b, keys, pages, args.batch)
                            v = await backend_read(b, keys, pages, args.batch, d)
                        else:
                            v = await backend_write(b, keys, pages, args.batch)
                        await b.clear()
                        await b.aclose()
                    raw_path.unlink(missing_ok=True)
                    if v is not None:
                        rows.setdefault(name, []).append(v)
            fastest = [
                max(vals)
                for vals in zip(
                    *(rows[k] for k in ("raw_write", "raw_write_direct", "raw_write_batch_sync") if k in rows),
                    strict=False,
                )
            ]
            case: dict[str, Any] = {"GBps_median": {k: round(statistics.median(v), 3) for k, v in rows.items()}}
            for k in ("grouped", "per_file", "grouped_seg", "per_file_seg"):
                if k in rows:
                    per = [round(a / f, 3) for a, f in zip(rows[k], fastest, strict=False)]
                    case[k] = {"ratio_per_round": per, "ratio": round(statistics.median(per), 3)}
            if "read" in rows:
                per = [round(a / f, 3) for a, f in zip(rows["read"], rows["raw_read"], strict=False)]
                case["read"] = {"ratio_per_round": per, "ratio": round(statistics.median(per), 3)}
            case["rows"] = rows
            out["sizes"][f"{size // 1024}KiB"] = case
    out["load_after"] = os.getloadavg()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,2M,4M")
    ap.add_argument("--total", type=int, default=256, help="MiB per run")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--segment", action="store_true", help="also 2 MiB segment files")
    ap.add_argument("--read", action="store_true", help="also cold reads against a raw cold read")
    ap.add_argument("--dir")
    args = ap.parse_args()
    args.sizes = parse_sizes(args.sizes)
    args.total *= MiB
    print(json.dumps(asyncio.run(run(args)), indent=1))


if __name__ == "__main__":
    main()
