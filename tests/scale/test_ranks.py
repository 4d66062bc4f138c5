"""The rank-group interface in one process: the identity group and input checks."""

from __future__ import annotations

import pytest

from asynccache import CacheConfig, HierarchicalCache
from asynccache.errors import ConfigError, InvalidInputError
from asynccache.ranks import RankGroup, SingleRank, TorchRankGroup


async def test_single_rank_is_the_identity() -> None:
    g = SingleRank()
    assert isinstance(g, RankGroup) and g.is_single
    assert (g.rank, g.size, g.tp_rank, g.tp_size, g.pp_rank, g.pp_size) == (0, 1, 0, 1, 0, 1)
    assert await g.all_reduce_min([3, -1, 7]) == [3, -1, 7]
    assert await g.all_reduce_min_max([1, 2], [5], scope="tp") == ([1, 2], [5])
    assert await g.all_gather_bytes(b"x", scope="pp") == [b"x"]
    await g.barrier()
    g.close()


async def test_single_rank_rejects_bad_input() -> None:
    g = SingleRank()
    with pytest.raises(InvalidInputError, match="unknown rank scope 'dp'"):
        await g.all_reduce_min([1], scope="dp")
    with pytest.raises(InvalidInputError, match=r"values must be ints, got 1\.5"):
        await g.all_reduce_min([1.5])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError, match="got True"):
        await g.all_reduce_min_max([True], [])  # type: ignore[list-item]


def test_torch_group_checks_its_arguments() -> None:
    with pytest.raises(ConfigError, match=r"torch\.distributed is not initialised"):
        TorchRankGroup()
    with pytest.raises(ConfigError, match="rank 2 is not in a world of size 2"):
        TorchRankGroup.create(2, 2, "tcp://127.0.0.1:1")
    with pytest.raises(ConfigError, match="backend must be 'gloo' or 'nccl', got 'mpi'"):
        TorchRankGroup.create(0, 1, "tcp://127.0.0.1:1", backend="mpi")
    with pytest.raises(ConfigError, match="timeout_s must be > 0, got 0"):
        TorchRankGroup.create(0, 1, "tcp://127.0.0.1:1", timeout_s=0)


async def test_cache_takes_a_rank_group() -> None:
    cfg = CacheConfig(page_size=4, device_tokens=64, host_tokens=64)
    with pytest.raises(InvalidInputError, match="ranks must be a RankGroup, got 'tp2'"):
        HierarchicalCache(cfg, ranks="tp2")  # type: ignore[arg-type]
    async with HierarchicalCache(cfg, ranks=SingleRank()) as cache:
        assert cache.agreement is None  # one rank keeps the immediate (callback) commits
        assert await cache.sync() == 0
        layout = cache.storage_layout()
        assert (layout.tp_rank, layout.tp_size, layout.kv_replicated) == (0, 1, False)
    with pytest.raises(ConfigError, match="kv_replicated must be a bool, got 'yes'"):
        CacheConfig(device_tokens=64, kv_replicated="yes")  # type: ignore[arg-type]
