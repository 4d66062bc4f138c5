"""Validated configuration of a :class:`~asynccache.HierarchicalCache`."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from asynccache.errors import ConfigError, InvalidInputError
from asynccache.transfers.handles import layer_map
from asynccache.tree.keys import MAX_TOKEN_ID
from asynccache.tree.queues import POLICIES
from asynccache.tree.tree import WRITE_POLICIES

HOST_MODES = ("cache", "buffer_only")
_DTYPES = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


def _positive(name: str, value: Any, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


@dataclass(frozen=True)
class CacheConfig:
    """Everything a cache needs; every field is checked in ``__post_init__``.

    Capacities: give ``device_tokens`` or ``device_bytes`` (and ``host_tokens`` or
    ``host_bytes``; zero or unset host capacity means no L2 tier). ``load_back_threshold``: host
    hits shorter than this many tokens are recomputed rather than loaded.
    ``host_mode``: ``"cache"`` (host memory is the L2 tier) or ``"buffer_only"`` (host memory is
    only staging between device and an attached storage backend; FULL and FULL+SWA caches
    only, Mamba is refused; see docs/cache.md).
    ``device``: where the device (L1) pools live. ``"auto"`` (the default) picks ``"cuda"``
    (the current CUDA device) when CUDA is available, else ``"cpu"``, and is resolved once
    here: ``config.device`` never reads ``"auto"``. An explicit ``"cuda"`` / ``"cuda:N"``
    without CUDA is a :class:`ConfigError`.
    """

    page_size: int = 16
    num_layers: int = 4
    num_heads: int = 2
    head_dim: int = 64
    dtype: str = "float16"
    device_tokens: int | None = None
    device_bytes: int | None = None
    host_tokens: int | None = None
    host_bytes: int | None = None
    host_layout: str = "layer_first"
    device: str = "auto"  # "auto": "cuda" when CUDA is available, else "cpu"
    write_policy: str = "write_through_selective"
    eviction_policy: str = "lru"
    load_back_threshold: int = 10
    enable_kv_events: bool = False
    enable_page_hashes: bool = False
    disable: bool = False
    enable_sessions: bool = False  # radix session references (session paths evicted last)
    retraction_backup: bool = False  # retract/restore requests via host memory
    model_name: str = "model"  # names L3 objects: different models never share one
    host_mode: str = "cache"  # "cache": host RAM is the L2 tier; "buffer_only": staging only
    kv_replicated: bool = False  # every TP rank holds the whole KV (MLA): ranks share L3 objects
    # Hybrid models: an SWA component with this retained window (0: none), its KV pool of
    # `swa_layers` layers and `swa_tokens` slots (default: the device pool's), and a Mamba
    # component with a pool of `mamba_states` states of `mamba_state_shape` (0: none). With a
    # host tier: `swa_host_tokens` host SWA slots (default: the host pool's) and
    # `mamba_host_states` host states (default: `mamba_states`).
    sliding_window: int = 0
    swa_layers: int = 1
    swa_tokens: int | None = None
    mamba_states: int = 0
    mamba_state_shape: tuple[int, ...] = (64,)
    swa_host_tokens: int | None = None
    mamba_host_states: int | None = None
    # Hybrid models: the model's layers in order, each "full", "swa" or "mamba" (None: not
    # given). With it, a hybrid load-back's `layer(i)` / `wait_layer(i)` wait only for what
    # model layer i reads: its own layer of the FULL or SWA load, or the whole Mamba state
    # copy (without it: FULL layer i and the SWA / Mamba copies whole).
    layer_components: tuple[str, ...] | None = None
    # SWA: at every cache_unfinished_req (chunked prefill), free the SWA slots of the request's
    # own tokens that slid out of the window (keeping window + one page), as release_swa_window.
    swa_free_out_of_window: bool = False
    # The largest token id the model's vocabulary has (None: any uint32). Ids above it are
    # rejected at admission (InvalidInputError), before anything is matched or allocated.
    max_token_id: int | None = None
    # The longest alloc_device / extend waits for storage writes whose host pins are what keeps
    # device pages from eviction (seconds); past it, PoolExhaustedError. Allocations that no
    # storage write could help fail at once.
    alloc_wait_s: float = 0.5
    # EAGLE draft models: key the tree by the bigram view of the tokens (a prompt of N + 1
    # tokens caches N positions; lengths, pages and page hashes count bigrams). Requests still
    # pass raw tokens: admit and cache_(un)finished_req translate (docs/tree.md, "EAGLE keys").
    eagle: bool = False

    def __post_init__(self) -> None:
        for name in ("page_size", "num_layers", "num_heads", "head_dim"):
            _positive(name, getattr(self, name))
        _positive("load_back_threshold", self.load_back_threshold, allow_zero=True)
        if str(self.dtype) not in _DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; choose one of {sorted(_DTYPES)}")
        for tier in ("device", "host"):
            tokens, nbytes = getattr(self, f"{tier}_tokens"), getattr(self, f"{tier}_bytes")
            if tokens is not None and nbytes is not None:
                raise ConfigError(f"give {tier}_tokens or {tier}_bytes, not both")
            for name, val in ((f"{tier}_tokens", tokens), (f"{tier}_bytes", nbytes)):
                if val is not None:
                    _positive(name, val, allow_zero=tier == "host")
        if self.device_tokens is None and self.device_bytes is None:
            raise ConfigError("set device_tokens or device_bytes (the L1 capacity)")
        if not isinstance(self.model_name, str) or not self.model_name.strip():
            raise ConfigError(f"model_name must be a non-empty string, got {self.model_name!r}")
        for flag in ("enable_kv_events", "enable_page_hashes", "disable", "enable_sessions",
                     "retraction_backup", "kv_replicated", "swa_free_out_of_window", "eagle"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        if self.host_mode not in HOST_MODES:
            raise ConfigError(
                f"unknown host_mode {self.host_mode!r}; choose one of {list(HOST_MODES)}"
            )
        if self.host_mode == "buffer_only":
            if not self.host_enabled:
                raise ConfigError(
                    "host_mode 'buffer_only' stages pages in host memory between device and "
                    "storage: set host_tokens or host_bytes (got no host capacity)"
                )
            if self.write_policy == "write_back":
                raise ConfigError(
                    "host_mode 'buffer_only' needs a write-through write_policy "
                    "('write_through' or 'write_through_selective'), got 'write_back': there "
                    "is no host tier to write evicted pages back to"
                )
        if self.host_layout not in ("layer_first", "page_first"):
            raise ConfigError(f"unknown host_layout {self.host_layout!r}")
        if self.write_policy not in WRITE_POLICIES:
            raise ConfigError(
                f"unknown write_policy {self.write_policy!r}; choose one of {list(WRITE_POLICIES)}"
            )
        if self.eviction_policy not in POLICIES:
            raise ConfigError(
                f"unknown eviction_policy {self.eviction_policy!r}; choose one of {sorted(POLICIES)}"
            )
        if self.retraction_backup and not self.host_enabled:
            raise ConfigError("retraction_backup needs a host tier (host_tokens or host_bytes)")
        if self.max_token_id is not None:
            _positive("max_token_id", self.max_token_id, allow_zero=True)
            if self.max_token_id > MAX_TOKEN_ID:
                raise ConfigError(
                    f"max_token_id must be <= {MAX_TOKEN_ID} (token ids are uint32), "
                    f"got {self.max_token_id}"
                )
        if isinstance(self.alloc_wait_s, bool) or not isinstance(self.alloc_wait_s, int | float) \
                or not 0 <= self.alloc_wait_s < float("inf"):
            raise ConfigError(f"alloc_wait_s must be a number of seconds >= 0, got "
                              f"{self.alloc_wait_s!r}")
        _positive("sliding_window", self.sliding_window, allow_zero=True)
        _positive("swa_layers", self.swa_layers)
        _positive("mamba_states", self.mamba_states, allow_zero=True)
        for opt in ("swa_tokens", "swa_host_tokens", "mamba_host_states"):
            if getattr(self, opt) is not None:
                _positive(opt, getattr(self, opt))
        self._check_layer_components()
        shape = self.mamba_state_shape
        if not isinstance(shape, tuple | list) or not shape or any(
            isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in shape
        ):
            raise ConfigError(f"mamba_state_shape must be a tuple of positive ints, got {shape!r}")
        if self.mamba_states and self.host_enabled and self.host_mode == "buffer_only":
            raise ConfigError(
                "host_mode 'buffer_only' supports FULL and FULL+SWA caches only: Mamba is not "
                f"supported in buffer_only mode (mamba_states={self.mamba_states}, "
                f"sliding_window={self.sliding_window}); use host_mode='cache' or no host memory"
            )
        if self.device == "auto":  # resolved once: everything downstream sees a real device
            object.__setattr__(self, "device", "cuda" if torch.cuda.is_available() else "cpu")
        try:
            dev = torch.device(self.device)
        except RuntimeError as exc:
            raise ConfigError(f"bad device {self.device!r}: {exc}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {self.device!r} requested but CUDA is not available")

    def _check_layer_components(self) -> None:
        kinds = self.layer_components
        if kinds is None:
            return
        try:
            layer_map(kinds)
        except InvalidInputError as exc:
            raise ConfigError(f"layer_components: {exc}") from None
        swa = (self.swa_layers, f"swa_layers={self.swa_layers}") if self.sliding_window \
            else (0, "sliding_window=0: no SWA component")
        for name, (n, why) in (("full", (self.num_layers, f"num_layers={self.num_layers}")),
                               ("swa", swa)):
            if kinds.count(name) != n:
                raise ConfigError(f"layer_components has {kinds.count(name)} {name!r} layers; "
                                  f"expected {n} ({why})")
        if bool(kinds.count("mamba")) != bool(self.mamba_states):
            raise ConfigError(f"layer_components has {kinds.count('mamba')} 'mamba' layers "
                              f"with mamba_states={self.mamba_states}")
        object.__setattr__(self, "layer_components", tuple(kinds))

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[str(self.dtype)]

    @property
    def hybrid(self) -> bool:
        return self.sliding_window > 0 or self.mamba_states > 0

    @property
    def host_enabled(self) -> bool:
        """A host pool exists (an L2 tier, or buffer-only staging)."""
        return bool(self.host_tokens) or bool(self.host_bytes)

    @property
    def host_tier(self) -> bool:
        """Host memory is an L2 tier the tree keeps pages in (``host_mode == "cache"``)."""
        return self.host_enabled and self.host_mode == "cache"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CacheConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}; known keys: {sorted(known)}")
        return cls(**data)
