"""The prefetch rules in one place (``asynccache.l3.policy``), on their own, with exact values:
admission, pages to read, the stop rule and the outcome a finished prefetch is counted under.
The storage tier (cache host mode) and the buffer-only reads both call these."""

from __future__ import annotations

import pytest

from asynccache.errors import ConfigError
from asynccache.l3 import StoragePolicy
from asynccache.l3.policy import (
    admission,
    final_outcome,
    floor_pages,
    may_stop,
    pages_to_read,
    prefetch_span,
    stop_policy,
    stop_wait_s,
)

P = StoragePolicy(prefetch_threshold=256, timeout_base_s=1.0, timeout_per_ki_token_s=0.5)


def test_admission_and_span() -> None:
    assert prefetch_span(1000, 64, 64) == 896  # whole pages past the cached start
    assert floor_pages(P, 64) == 4 and floor_pages(StoragePolicy(prefetch_threshold=1), 64) == 1
    assert admission(P, 64, 255, 0, 100) == "declined_too_short"
    assert admission(P, 64, 0, 0, 100) == "declined_too_short"
    assert admission(P, 64, 256, 100, 100) == "declined_rate_limited"
    assert admission(P, 64, 256, 99, 100) is None


def test_pages_to_read() -> None:
    assert pages_to_read(P, 64, 3) == (0, "revoked_insufficient")
    assert pages_to_read(P, 64, 10) == (10, None)
    assert pages_to_read(P, 64, 10, room=6) == (6, None)
    assert pages_to_read(P, 64, 10, room=3) == (0, "revoked_rate_limited")


def test_the_stop_rule() -> None:
    assert stop_policy(None, P) == P.prefetch_policy
    with pytest.raises(ConfigError, match="'sometimes'"):
        stop_policy("sometimes", P)
    # timeout: 1.0 + 2048 / 1024 * 0.5 = 2.0 s after the start
    assert stop_wait_s("timeout", P, 2048, 0.5) == pytest.approx(1.5)
    assert stop_wait_s("best_effort", P, 2048, 0.5) == pytest.approx(-0.5)
    assert stop_wait_s("wait_complete", P, 2048, 99.0) is None
    assert not may_stop("timeout", P, 2048, 1.9, complete=False)
    assert may_stop("timeout", P, 2048, 2.0, complete=False)
    assert may_stop("best_effort", P, 2048, 0.0, complete=False)
    assert not may_stop("wait_complete", P, 2048, 1e9, complete=False)
    assert may_stop("wait_complete", P, 2048, 0.0, complete=True)


def test_final_outcome() -> None:
    assert final_outcome("issued", inserted=True, complete=True) == "completed"
    assert final_outcome("issued", inserted=True, complete=False) == "partial"
    assert final_outcome("issued", inserted=False, complete=True) == "aborted"
    assert final_outcome("revoked_insufficient", inserted=True, complete=False) == \
        "revoked_insufficient"
