"""The L3 storage protocol, object naming and buffer helpers shared by every backend.

A backend stores *pages*: one object per page hash. The caller (the cache engine) owns the
host buffers; a backend reads into and writes from them and never keeps a reference after a
call returns, also when the call timed out or was cancelled.

Keys are page-hash hex strings (the SHA-256 chain of the tree, 64 lowercase hex digits),
already namespaced by the caller (LoRA / cache salt go into the hash seed). A key may carry a
pool suffix (``<hash>.<pool>``) for non-KV pools such as mamba state. The object name adds the
:class:`StorageLayout` tag so that different models, page sizes, KV layouts/dtypes and
tensor/pipeline-parallel ranks never share an object.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from asynccache.errors import ConfigError, InvalidInputError

__all__ = [
    "OBJECT_SUFFIX",
    "EvictionListener",
    "Pieces",
    "StorageBackend",
    "StorageLayout",
    "check_batch",
    "copy_into",
    "listen_for_evictions",
    "readable_view",
    "stop_listening",
    "validate_keys",
    "writable_view",
]

#: Every object name ends with ``.<layout tag>`` + this suffix.
OBJECT_SUFFIX = ".kv"

#: ``fn(keys)``: pages a backend no longer has (see ``BackendBase.add_eviction_listener``).
#: Whatever ``fn`` returns is ignored.
EvictionListener = Callable[[list[str]], object]


def listen_for_evictions(backend: object, fn: EvictionListener) -> None:
    """``backend.add_eviction_listener(fn)`` where the backend has it (a custom backend, or a
    wrapper around one, may not: then nothing)."""
    add = getattr(backend, "add_eviction_listener", None)
    if add is not None:
        add(fn)


def stop_listening(backend: object, fn: EvictionListener) -> None:
    """``backend.remove_eviction_listener(fn)`` where the backend has it."""
    remove = getattr(backend, "remove_eviction_listener", None)
    if remove is not None:
        remove(fn)


_KEY_RE = re.compile(r"[0-9a-f]{64}(?:\.[a-z0-9_-]{1,32})?")
_SLUG_RE = re.compile(r"[^A-Za-z0-9.+-]+")
_FIELD_RE = re.compile(r"[A-Za-z0-9._+-]{1,64}")


@dataclass(frozen=True, slots=True)
class StorageLayout:
    """Everything that changes the bytes of a page, and so must change the object name.

    ``kv_replicated`` is for KV that every tensor-parallel rank holds whole (MLA): the TP rank
    and size are then left out of the name so the ranks share one object per page. Pipeline
    ranks hold different layers and are always part of the name when ``pp_size > 1``.
    ``extra`` takes anything else that changes the bytes (quantization scheme, a format tag).
    """

    model: str
    page_size: int
    kv_dtype: str = "bfloat16"
    kv_layout: str = "layer_first"
    tp_rank: int = 0
    tp_size: int = 1
    kv_replicated: bool = False
    pp_rank: int = 0
    pp_size: int = 1
    extra: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ConfigError(f"StorageLayout.model must be a non-empty string, got {self.model!r}")
        for field in ("page_size", "tp_size", "pp_size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"StorageLayout.{field} must be an int >= 1, got {value!r}")
        for rank_field, size_field in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
            rank, size = getattr(self, rank_field), getattr(self, size_field)
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
                raise ConfigError(
                    f"StorageLayout.{rank_field} must be an int in [0, {size_field}={size}), "
                    f"got {rank!r}"
                )
        for field in ("kv_dtype", "kv_layout"):
            value = getattr(self, field)
            if not isinstance(value, str) or not _FIELD_RE.fullmatch(value):
                raise ConfigError(
                    f"StorageLayout.{field} must match [A-Za-z0-9._+-]{{1,64}}, got {value!r}"
                )
        if not isinstance(self.extra, str):
            raise ConfigError(f"StorageLayout.extra must be a string, got {self.extra!r}")

    def _identity(self) -> dict[str, Any]:
        ident = asdict(self)
        if self.kv_replicated:
            del ident["tp_rank"], ident["tp_size"]
        if self.pp_size == 1:
            del ident["pp_rank"], ident["pp_size"]
        return ident

    @property
    def tag(self) -> str:
        """A file-name-safe tag: a readable summary plus a digest of the exact fields.

        The readable part is lossy (``org/model`` and ``org-model`` read the same); the digest
        is over the exact field values, so different layouts never share a tag.
        """
        return _layout_tag(self)

    @property
    def object_suffix(self) -> str:
        """What follows the key in every object name of this layout."""
        return f".{self.tag}{OBJECT_SUFFIX}"

    def object_name(self, key: str) -> str:
        """The object (file) name of a page key in this layout."""
        return key + self.object_suffix


@functools.lru_cache(maxsize=256)
def _layout_tag(layout: StorageLayout) -> str:
    slug = _SLUG_RE.sub("-", layout.model).strip("-.")[:48] or "model"
    parts = [slug, f"p{layout.page_size}", layout.kv_dtype, layout.kv_layout]
    if not layout.kv_replicated:
        parts.append(f"tp{layout.tp_rank}of{layout.tp_size}")
    if layout.pp_size > 1:
        parts.append(f"pp{layout.pp_rank}of{layout.pp_size}")
    canonical = json.dumps(layout._identity(), sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:12]
    return "_".join([*parts, digest])


def validate_keys(keys: Sequence[str]) -> list[str]:
    """Return ``keys`` as a list; raise InvalidInputError naming the first bad key."""
    if isinstance(keys, str | bytes):
        raise InvalidInputError(f"keys must be a sequence of key strings, got a single {keys!r}")
    try:
        out = list(keys)
    except TypeError:
        raise InvalidInputError(
            f"keys must be a sequence of key strings, got {type(keys).__name__}"
        ) from None
    for i, key in enumerate(out):
        if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
            raise InvalidInputError(
                f"keys[{i}] = {key!r} is not a page key: expected 64 lowercase hex digits "
                "(a SHA-256 page hash), optionally followed by '.<pool>'"
            )
    return out


def _torch_view(buf: Any, index: int) -> memoryview:
    if buf.device.type != "cpu":
        raise InvalidInputError(f"buffers[{index}] is a tensor on {buf.device}, need a CPU tensor")
    if not buf.is_contiguous():
        raise InvalidInputError(f"buffers[{index}] is a non-contiguous tensor")
    import torch  # a tensor was passed, so torch is importable

    flat = buf.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy())


def _as_view(buf: Any, index: int) -> memoryview:
    if type(buf).__module__.startswith("torch"):
        view = _torch_view(buf, index)
    else:
        try:
            view = memoryview(buf)
        except TypeError:
            raise InvalidInputError(
                f"buffers[{index}] of type {type(buf).__name__} does not support the buffer "
                "protocol (pass a bytearray, memoryview, numpy array or CPU torch tensor)"
            ) from None
    if not view.c_contiguous:
        raise InvalidInputError(f"buffers[{index}] is not C-contiguous")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def writable_view(buf: Any, index: int = 0) -> memoryview:
    """A flat, writable byte view of a caller buffer (InvalidInputError if it is not one)."""
    view = _as_view(buf, index)
    if view.readonly:
        raise InvalidInputError(f"buffers[{index}] is read-only; get_batch needs writable buffers")
    return view


def readable_view(buf: Any, index: int = 0) -> memoryview:
    """A flat byte view of a caller buffer (InvalidInputError if it is not one)."""
    return _as_view(buf, index)


def _nbytes(buf: Any) -> int:
    size = getattr(buf, "nbytes", None)
    if isinstance(size, int):
        return size
    try:
        return memoryview(buf).nbytes
    except TypeError:
        return 0  # not a buffer: check_batch names it


class Pieces:
    """One page given as several buffers, its bytes in their order: a page that lies apart in
    the caller's memory (the K and V halves of an SGLang host-pool page) is written and read
    in place, without gathering it into one buffer first. The stored object is the same as
    for the joined bytes. Backends that take pieces say so (``FileBackend``); others raise
    InvalidInputError for them. ``parts``: the buffers (after ``check_batch``: flat byte views)."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, parts: Sequence[Any]) -> None:
        self.parts = list(parts)
        if not self.parts:
            raise InvalidInputError("Pieces needs at least one buffer")
        self.nbytes = sum(_nbytes(p) for p in self.parts)

    def tobytes(self) -> bytes:
        return b"".join(bytes(p) for p in self.parts)

    def __repr__(self) -> str:
        return f"Pieces({len(self.parts)} parts, {self.nbytes} bytes)"


#: A page's buffer after ``check_batch``: one flat byte view, or its pieces' views.
PageView = memoryview | Pieces

_GIL_FREE_COPY_BYTES = 256 * 1024


def copy_into(dst: memoryview | Pieces, src: memoryview) -> None:
    """``dst[:] = src``; large copies through numpy, which releases the GIL (a memoryview
    copy holds it, which is cheaper only for small pages). A :class:`Pieces` ``dst`` takes
    ``src`` in order, piece by piece."""
    if isinstance(dst, Pieces):
        at = 0
        for part in dst.parts:
            copy_into(part, src[at : at + part.nbytes])
            at += part.nbytes
        return
    if dst.nbytes < _GIL_FREE_COPY_BYTES:
        dst[:] = src
    else:
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def _pieces_view(buf: Pieces, index: int, writable: bool) -> Pieces:
    make = writable_view if writable else readable_view
    try:
        views = [make(p, index) for p in buf.parts]
    except InvalidInputError as exc:
        raise InvalidInputError(f"a piece of {exc}") from None
    return Pieces(views)


def check_batch(
    keys: Sequence[str], buffers: Sequence[Any], *, writable: bool, pieces: bool = False
) -> tuple[list[str], list[Any]]:
    """Validate a get/set batch: keys, equal lengths, usable buffers, no empty pages. With
    ``pieces`` a buffer may be a :class:`Pieces` (its views come back as one)."""
    key_list = validate_keys(keys)
    if isinstance(buffers, str):
        raise InvalidInputError("buffers must be a sequence of buffers, got a str")
    try:
        bufs = list(buffers)
    except TypeError:
        raise InvalidInputError(
            f"buffers must be a sequence of buffers, got {type(buffers).__name__}"
        ) from None
    if len(bufs) != len(key_list):
        raise InvalidInputError(
            f"got {len(key_list)} keys but {len(bufs)} buffers; need one buffer per key"
        )
    make = writable_view if writable else readable_view
    views: list[Any] = []
    for i, b in enumerate(bufs):
        if isinstance(b, Pieces):
            if not pieces:
                raise InvalidInputError(
                    f"buffers[{i}] is {b!r}; this backend takes one contiguous buffer per page"
                )
            views.append(_pieces_view(b, i, writable))
        else:
            views.append(make(b, i))
    for i, v in enumerate(views):
        if v.nbytes == 0:
            raise InvalidInputError(f"buffers[{i}] is empty; a page has at least one byte")
    return key_list, views


@runtime_checkable
class StorageBackend(Protocol):
    """The one small async protocol of every L3 backend.

    Faults (I/O errors, a full disk, a corrupt or partial object, a slow or dead server, a
    timeout) never raise: they turn into misses / skipped writes, a structlog event and a
    metric. Bad input (malformed keys, unusable buffers) raises InvalidInputError; a call on a
    closed backend raises ClosedError.

    Cancelling a call (or its timeout firing) is safe: once it returns or raises, the backend
    neither reads nor writes any of its buffers any more. A buffer whose ``get_batch`` result
    is ``False`` holds unspecified bytes; ``True`` means the bytes were verified against the
    stored checksum.
    """

    @property
    def layout(self) -> StorageLayout: ...

    async def exists_prefix(self, keys: Sequence[str]) -> int:
        """The number of leading ``keys`` stored (stops at the first missing one)."""
        ...

    async def get_batch(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        """Read page ``keys[i]`` into ``buffers[i]``; True = filled and verified."""
        ...

    async def set_batch(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        """Store ``buffers[i]`` as page ``keys[i]``; True = stored (or already there)."""
        ...

    async def delete(self, keys: Sequence[str]) -> int:
        """Remove pages; returns how many were removed."""
        ...

    async def clear(self) -> int:
        """Remove every page of this layout; returns how many were removed."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters and gauges of this backend instance (plain values)."""
        ...

    async def aclose(self) -> None:
        """Release resources; later calls raise ClosedError."""
        ...
