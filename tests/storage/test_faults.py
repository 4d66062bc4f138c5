"""FaultInjectingBackend: schedules, determinism, and zero wrong bytes under every fault."""

from __future__ import annotations

import pytest
from obstore.store import MemoryStore

from asynccache.errors import ConfigError
from asynccache.storage.faults import FaultInjectingBackend, FaultKind, FaultRule
from asynccache.storage.file import FileBackend
from asynccache.storage.s3 import S3Backend

ALL_DATA_FAULTS = [
    FaultKind.EIO,
    FaultKind.ENOSPC,
    FaultKind.PARTIAL_WRITE,
    FaultKind.FLIP_BYTES,
    FaultKind.SHORT_READ,
    FaultKind.DROP,
]


def test_rules_validate_their_fields() -> None:
    with pytest.raises(ConfigError, match="rate"):
        FaultRule(FaultKind.EIO, rate=1.5)
    with pytest.raises(ConfigError, match="unknown ops"):
        FaultRule(FaultKind.EIO, ops=frozenset({"fly"}))
    with pytest.raises(ConfigError, match="applies to none"):
        FaultRule(FaultKind.ENOSPC, ops=frozenset({"read"}))
    with pytest.raises(ConfigError, match="set_fault_hook"):
        FaultInjectingBackend(object())


def test_schedule_after_times_and_keys(tmp_path, layout) -> None:
    fb = FaultInjectingBackend(
        FileBackend(tmp_path, layout),
        [
            FaultRule(
                FaultKind.EIO, ops=frozenset({"read"}), keys=frozenset({"k1"}), after=1, times=2
            )
        ],
    )
    decided = [fb.decide("read", k) for k in ["k0", "k1", "k1", "k0", "k1", "k1", "k1"]]
    kinds = [d.kind if d else None for d in decided]
    assert kinds == [None, None, FaultKind.EIO, None, FaultKind.EIO, None, None]
    assert fb.decide("write", "k1") is None  # EIO rule limited to reads
    assert fb.injected[("read", "eio")] == 2


def test_rate_draws_are_deterministic_per_seed(tmp_path, layout) -> None:
    def run(seed: int) -> list[bool]:
        fb = FaultInjectingBackend(
            FileBackend(tmp_path, layout), [FaultRule(FaultKind.EIO, rate=0.3)], seed=seed
        )
        return [fb.decide("read", f"k{i % 7}") is not None for i in range(400)]

    a, b, c = run(1), run(1), run(2)
    assert a == b and a != c
    assert 80 < sum(a) < 160  # ~30 % of 400


async def _hammer(backend, make_keys, make_pages, rounds: int, page: int) -> dict[str, int]:
    """Write and read a shifting set of pages; every hit must be the exact page."""
    keys = make_keys(48)
    pages = make_pages(48, page)
    truth = dict(zip(keys, pages, strict=True))
    seen = {"hits": 0, "misses": 0}
    for r in range(rounds):
        window = keys[(r * 8) % 24 : (r * 8) % 24 + 24]
        await backend.set_batch(window, [truth[k] for k in window])
        bufs = [bytearray(page) for _ in window]
        ok = await backend.get_batch(window, bufs)
        for key, hit, buf in zip(window, ok, bufs, strict=True):
            if hit:
                assert bytes(buf) == truth[key], f"wrong bytes served for {key}"
                seen["hits"] += 1
            else:
                seen["misses"] += 1
        n = await backend.exists_prefix(window)
        assert 0 <= n <= len(window)
    return seen


@pytest.mark.parametrize(
    "kind",
    ["file", "file-fsync", "file-segments", "file-segments-fsync", "file-segments-direct", "s3-memory"],
)
async def test_random_faults_never_serve_wrong_bytes(tmp_path, layout, make_keys, make_pages, kind):
    # -fsync: durable writes, with two threads so that each write job holds a group of files
    # (written, then synced, then published: PageFiles.write_group).
    durable = {"fsync": True, "io_threads": 2} if kind.endswith("-fsync") else {}
    if kind in ("file", "file-fsync"):
        inner = FileBackend(tmp_path, layout, timeout_s=2.0, capacity_bytes=40 * 9000, **durable)
    elif kind.startswith("file-segments"):
        # Eviction takes whole files, and a file stays while any of its pages lives: a bit
        # more room than one page at a time needs for the same working set.
        inner = FileBackend(
            tmp_path,
            layout,
            timeout_s=2.0,
            capacity_bytes=60 * 9000,
            segment_bytes=4 * 8256,
            direct_io=kind.endswith("direct"),
            **durable,
        )
    else:
        inner = S3Backend("mem", layout, store=MemoryStore(), exists_cache_ttl_s=0, timeout_s=2.0)
    rules = [FaultRule(k, rate=0.08) for k in ALL_DATA_FAULTS]
    rules.append(FaultRule(FaultKind.DELAY, rate=0.02, delay_s=0.005))
    fb = FaultInjectingBackend(inner, rules, seed=11)
    seen = await _hammer(fb, make_keys, make_pages, rounds=10, page=8192)
    assert seen["hits"] > 50 and seen["misses"] > 5
    injected = {kind for (_op, kind) in fb.injected}
    assert injected >= {k.value for k in ALL_DATA_FAULTS}
    faults = fb.stats()["faults"]
    assert faults.get("get.corrupt", 0) + faults.get("get.partial", 0) > 0
    assert faults.get("set.no_space", 0) > 0 and faults.get("get.io_error", 0) > 0
    # With the faults gone, the backend recovers fully.
    fb.clear_rules()
    keys, pages = make_keys(48), make_pages(48, 8192)
    # Pages damaged at rest (FLIP_BYTES / PARTIAL_WRITE on write) are found by the first
    # read that reaches them; one read pass drops those still indexed, then a set rewrites.
    await fb.get_batch(keys[:24], [bytearray(8192) for _ in range(24)])
    assert await fb.set_batch(keys[:24], pages[:24]) == [True] * 24
    bufs = [bytearray(8192) for _ in range(24)]
    assert await fb.get_batch(keys[:24], bufs) == [True] * 24
    assert [bytes(b) for b in bufs] == pages[:24]
    await fb.aclose()
