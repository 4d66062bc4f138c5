"""A shared L3 across instances: two independent cache processes over one file directory or
one S3 bucket (a real SeaweedFS): pages one instance wrote are prefetched by the other, and
both writing the same pages at once is safe."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from asynccache.testing.ranks import check_ranks, run_ranks

SCENARIOS = Path(__file__).with_name("rank_scenarios.py")
PS = 4


def _check(results: list[dict[str, Any]]) -> None:
    for r in results:
        fetched = r["fetched"]
        # the other instance's three 36-token prompts: 9 whole pages each, none local,
        # all fetched from the shared tier and served on the device
        for local, got, prefix in fetched[:3]:
            assert (local, got, prefix) == (0, 36, 36), (r["rank"], fetched)
        # the common prompts are local already (written here too): nothing to fetch
        for local, got, prefix in fetched[3:]:
            assert got == 0 and local == prefix == 40, (r["rank"], fetched)


def test_two_instances_share_a_directory(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'shared-l3'}"
    _check(check_ranks(run_ranks(SCENARIOS, "shared_l3", 2, args=(url, {}), timeout_s=90)))


@pytest.mark.seaweedfs
def test_two_instances_share_an_s3_bucket(asynccache_s3: Any) -> None:
    url = asynccache_s3.url("shared-l3-test")
    kwargs = asynccache_s3.backend_kwargs()
    _check(check_ranks(run_ranks(SCENARIOS, "shared_l3", 2, args=(url, kwargs), timeout_s=90)))
