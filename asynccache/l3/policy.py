"""How the engine uses storage (:class:`StoragePolicy`), and the prefetch rules every prefetch
follows, in one place: the storage tier's (cache host mode, one rank or several) and the
buffer-only host mode's.

* **Admission** (:func:`admission`): whether a prefetch starts at all (the uncached part of the
  prompt is long enough, the prefetch capacity is not full).
* **Pages to read** (:func:`pages_to_read`): how many of the pages the hit query found are read
  (the hit clears the threshold; capped by the room left, the capped figure still clears it).
* **Stop rule** (:func:`stop_after_s`, with :func:`stop_wait_s` for a caller that waits and
  :func:`may_stop` for the agreed decision of several ranks): when a prefetch may stop with
  what has arrived (``best_effort``: at once; ``wait_complete``: once complete; ``timeout``:
  once complete or past its deadline).

Synchronous; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from asynccache.errors import ConfigError

PREFETCH_POLICIES: Final = ("best_effort", "wait_complete", "timeout")


@dataclass(frozen=True, slots=True)
class StoragePolicy:
    """How the engine uses storage.

    ``prefetch_threshold``: prompts whose uncached part is shorter are not prefetched (tokens).
    ``prefetch_policy``: when a request stops waiting for its prefetch — ``best_effort`` (take
    what has arrived), ``wait_complete`` (all of it), ``timeout`` (all of it or
    ``timeout_base_s + tokens / 1024 * timeout_per_ki_token_s``, whichever comes first).
    ``prefetch_capacity_fraction``: prefetches may occupy at most this share of the host pool.
    ``write_failure_threshold`` consecutive failed write batches (nothing stored) open a circuit
    breaker: backups are not written to storage (counted as skipped, ``circuit_open``) for
    ``write_backoff_s``, doubling while the store keeps failing (up to 64x); a write that stores
    something closes it. A dead store then costs one failed batch per back-off, not a queue of
    writes that grows with every backup.
    """

    prefetch_threshold: int = 256
    prefetch_policy: str = "best_effort"
    timeout_base_s: float = 1.0
    timeout_per_ki_token_s: float = 0.25
    prefetch_capacity_fraction: float = 0.5
    write_concurrency: int = 4
    known_keys: int = 1 << 20
    write_failure_threshold: int = 3
    write_backoff_s: float = 1.0

    def __post_init__(self) -> None:
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise ConfigError(
                f"unknown prefetch_policy {self.prefetch_policy!r}; choose one of "
                f"{list(PREFETCH_POLICIES)}"
            )
        if isinstance(self.prefetch_threshold, bool) or not isinstance(self.prefetch_threshold, int) \
                or self.prefetch_threshold < 0:
            raise ConfigError(f"prefetch_threshold must be an int >= 0, got {self.prefetch_threshold!r}")
        for name in ("timeout_base_s", "timeout_per_ki_token_s"):
            if not isinstance(getattr(self, name), int | float) or getattr(self, name) < 0:
                raise ConfigError(f"{name} must be a number >= 0, got {getattr(self, name)!r}")
        if not 0 < self.prefetch_capacity_fraction <= 1:
            raise ConfigError(
                f"prefetch_capacity_fraction must be in (0, 1], got {self.prefetch_capacity_fraction!r}"
            )
        if self.write_concurrency < 1 or self.known_keys < 0:
            raise ConfigError("write_concurrency must be >= 1 and known_keys >= 0")
        if isinstance(self.write_failure_threshold, bool) or not isinstance(
                self.write_failure_threshold, int) or self.write_failure_threshold < 1:
            raise ConfigError(f"write_failure_threshold must be an int >= 1, got "
                              f"{self.write_failure_threshold!r}")
        if not isinstance(self.write_backoff_s, int | float) or not self.write_backoff_s > 0:
            raise ConfigError(f"write_backoff_s must be a number > 0, got {self.write_backoff_s!r}")

    def timeout_s(self, num_tokens: int) -> float:
        """The ``timeout`` policy's deadline for a prefetch of ``num_tokens`` tokens."""
        return self.timeout_base_s + num_tokens / 1024 * self.timeout_per_ki_token_s


# ---------------------------------------------------------------------- admission
def floor_pages(policy: StoragePolicy, page_size: int) -> int:
    """The fewest pages a prefetch may bring: the threshold, at least one page."""
    return -(-max(policy.prefetch_threshold, page_size) // page_size)


def prefetch_span(key_len: int, start: int, page_size: int) -> int:
    """Tokens a prefetch of a key of ``key_len`` tokens asks for past the cached ``start``
    (whole pages only; <= 0: nothing)."""
    return key_len - key_len % page_size - start


def admission(policy: StoragePolicy, page_size: int, span: int, occupied: int,
              limit: int) -> str | None:
    """Whether a prefetch of ``span`` tokens (:func:`prefetch_span`) starts: None if it does,
    else its outcome — ``declined_too_short`` (below the threshold, at least one page) or
    ``declined_rate_limited`` (prefetches already hold ``occupied`` of their ``limit`` host
    tokens)."""
    if span <= 0 or span < max(policy.prefetch_threshold, page_size):
        return "declined_too_short"
    if occupied >= limit:
        return "declined_rate_limited"
    return None


def pages_to_read(policy: StoragePolicy, page_size: int, hit: int,
                  room: int | None = None) -> tuple[int, str | None]:
    """How many of the ``hit`` pages storage holds a prefetch reads, at most ``room`` (None: no
    cap). Returns (pages, None), or (0, outcome): ``revoked_insufficient`` (the hit is below
    the threshold) or ``revoked_rate_limited`` (the room left is)."""
    floor = floor_pages(policy, page_size)
    if hit < floor:
        return 0, "revoked_insufficient"
    want = hit if room is None else min(hit, room)
    if want < floor:
        return 0, "revoked_rate_limited"
    return want, None


# ---------------------------------------------------------------------- the stop rule
def stop_policy(stop: str | None, policy: StoragePolicy) -> str:
    """``stop`` (None: the policy's default), checked (:class:`ConfigError` if unknown)."""
    stop = stop or policy.prefetch_policy
    if stop not in PREFETCH_POLICIES:
        raise ConfigError(f"unknown prefetch policy {stop!r}; choose one of "
                          f"{list(PREFETCH_POLICIES)}")
    return stop


def stop_after_s(stop: str, policy: StoragePolicy, requested_tokens: int) -> float | None:
    """How long after its start a prefetch of ``requested_tokens`` may stop under ``stop`` with
    only part of its pages arrived: ``best_effort`` at once (0), ``timeout`` after its
    timeout, ``wait_complete`` never (None)."""
    if stop == "best_effort":
        return 0.0
    if stop == "timeout":
        return policy.timeout_s(requested_tokens)
    return None


def stop_wait_s(stop: str, policy: StoragePolicy, requested_tokens: int,
                elapsed_s: float) -> float | None:
    """How long a caller stopping a prefetch ``elapsed_s`` after its start waits for it to
    complete first: None until it completes, <= 0 not at all (:func:`stop_after_s`)."""
    after = stop_after_s(stop, policy, requested_tokens)
    return None if after is None else after - elapsed_s


def may_stop(stop: str, policy: StoragePolicy, requested_tokens: int, elapsed_s: float, *,
             complete: bool) -> bool:
    """Whether a prefetch may stop ``elapsed_s`` after its start (``complete``: all its pages
    arrived, or its read ended) (:func:`stop_after_s`)."""
    if complete:
        return True
    after = stop_after_s(stop, policy, requested_tokens)
    return after is not None and not elapsed_s < after


def final_outcome(outcome: str, *, inserted: bool, complete: bool) -> str:
    """The outcome a finished prefetch is counted under: ``aborted`` when nothing of it is
    kept, the one it already has when it ended early (revoked, failed...), else ``completed``
    (every requested page arrived) or ``partial``."""
    if not inserted:
        return "aborted"
    if outcome == "issued":
        return "completed" if complete else "partial"
    return outcome


def count_finished(metrics: Any, op: Any, *, kept: bool, complete: bool, tokens: int) -> None:
    """Count a finished prefetch: its outcome (:func:`final_outcome`, also set on ``op`` when
    it is kept) and the ``tokens`` it brought."""
    label = final_outcome(op.outcome, inserted=kept, complete=complete)
    if kept:
        op.outcome = label
    metrics.prefetch_outcomes.labels(outcome=label).inc()
    metrics.prefetched_tokens.inc(tokens)
