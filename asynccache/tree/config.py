"""Tree settings and argument checks shared by the tree modules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from asynccache.errors import ConfigError, InvalidInputError
from asynccache.tree.queues import policy_key

WRITE_POLICIES: Final = ("write_through", "write_through_selective", "write_back")
_THRESHOLDS: Final = {"write_through": 1, "write_through_selective": 2, "write_back": 2}


@dataclass(frozen=True, slots=True)
class TreeConfig:
    """Tree settings. ``host_enabled`` turns on the L2 tier (backups, demotion, load-back).

    Hybrid models: ``sliding_window`` > 0 adds the SWA component with that retained window
    (tokens); ``mamba`` adds the Mamba state component, whose branching seqlens lie on a grid
    of ``mamba_track_interval`` tokens (0: the page size). With ``host_enabled`` the components'
    values get host copies too (see :mod:`asynccache.tree.hybrid_host`).

    ``eagle``: the tree serves an EAGLE draft model and keys its nodes by the bigram view of
    the tokens (:class:`~asynccache.tree.keys.BigramKey`): a key of ``N + 1`` tokens names
    ``N`` positions; lengths, pages, values and hashes count bigrams.

    ``device_tokens``: the device pool's capacity in tokens (0: not given). Only the ``arc``
    eviction policy reads it (its target and ghost lists are sized in pages of the capacity),
    and it needs it: at least one page.
    """

    page_size: int = 1
    eviction_policy: str = "lru"
    host_enabled: bool = False
    write_policy: str = "write_through_selective"
    enable_kv_events: bool = False
    enable_page_hashes: bool = False
    enable_sessions: bool = False
    sliding_window: int = 0
    mamba: bool = False
    mamba_track_interval: int = 0
    eagle: bool = False
    device_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int):
            raise ConfigError(f"page_size must be an int, got {self.page_size!r}")
        if self.page_size < 1:
            raise ConfigError(f"page_size must be >= 1, got {self.page_size}")
        for flag in ("host_enabled", "enable_kv_events", "enable_page_hashes", "enable_sessions",
                     "eagle"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        policy_key(self.eviction_policy)
        dt = self.device_tokens
        if isinstance(dt, bool) or not isinstance(dt, int) or dt < 0:
            raise ConfigError(f"device_tokens must be an int >= 0, got {dt!r}")
        if self.eviction_policy == "arc" and dt < self.page_size:
            raise ConfigError(
                f"eviction_policy 'arc' needs device_tokens (the device capacity, at least one "
                f"page of {self.page_size} tokens), got device_tokens={dt}"
            )
        for name in ("sliding_window", "mamba_track_interval"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name} must be an int >= 0, got {v!r}")
        if not isinstance(self.mamba, bool):
            raise ConfigError(f"mamba must be a bool, got {self.mamba!r}")
        if self.mamba_track_interval % self.page_size:
            raise ConfigError(
                f"mamba_track_interval {self.mamba_track_interval} must be a multiple of "
                f"page_size {self.page_size}"
            )
        if self.write_policy not in WRITE_POLICIES:
            raise ConfigError(
                f"unknown write_policy {self.write_policy!r}; choose one of {list(WRITE_POLICIES)}"
            )

    @property
    def write_through_threshold(self) -> int:
        return _THRESHOLDS[self.write_policy]

    @property
    def hybrid(self) -> bool:
        return self.sliding_window > 0 or self.mamba



_INT64 = np.dtype(np.int64)


def as_slots(value: Any, what: str = "value") -> np.ndarray:
    """Slot indices as a 1-D int64 numpy array (accepts numpy, torch or a list of ints)."""
    if type(value) is np.ndarray and value.dtype is _INT64 and value.ndim == 1:
        return value  # the usual case, checked cheaply
    if isinstance(value, np.ndarray):
        arr = value
    elif hasattr(value, "numpy") and hasattr(value, "cpu"):
        arr = value.cpu().numpy()
    else:
        try:
            arr = np.asarray(value)
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(f"{what} must be an array of slot indices: {exc}") from None
    if arr.ndim != 1:
        raise InvalidInputError(f"{what} must be one-dimensional, got shape {arr.shape}")
    if arr.dtype != np.int64:
        if arr.size and arr.dtype.kind not in "iu":
            raise InvalidInputError(f"{what} must hold integer slot indices, got dtype {arr.dtype}")
        arr = arr.astype(np.int64)
    return arr


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise InvalidInputError(f"{name} must be an int, got {value!r}")
    if value < 0:
        raise InvalidInputError(f"{name} must be >= 0, got {value}")
    return int(value)
