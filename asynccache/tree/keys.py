"""Keys of the radix tree: token ids plus a namespace.

Tokens are stored as little-endian uint32 bytes. That one representation gives C-speed
slicing and comparison while walking the tree, hashable child keys, and the exact bytes the
SHA-256 page chain hashes (no conversion when storage hashing or KV events are on).
"""

from __future__ import annotations

import sys
import weakref
from array import array
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np

from asynccache.errors import InvalidInputError

TOKEN_BYTES: Final = 4
MAX_TOKEN_ID: Final = 2**32 - 1

_ARRAY_I_OK: Final = array("I").itemsize == 4 and sys.byteorder == "little"


class Namespace:
    """A key namespace: ``extra_key`` (LoRA id / adapter name) and ``cache_salt`` (an empty
    salt is no salt, as in SGLang; an empty ``extra_key`` is a namespace of its own).

    Keys of different namespaces never share a node, a storage object or an event hash.
    Instances are interned while anything uses them (a key, a node, a cached hash seed), so
    identity comparison is exact; the intern table holds them weakly, so per-request salts do
    not accumulate.
    """

    __slots__ = ("__weakref__", "cache_salt", "extra_key")
    _interned: weakref.WeakValueDictionary[tuple[str | None, str | None], Namespace] = (
        weakref.WeakValueDictionary()
    )
    _default: Namespace | None = None

    extra_key: str | None
    cache_salt: str | None

    def __new__(cls, extra_key: str | None = None, cache_salt: str | None = None) -> Namespace:
        if cache_salt == "":
            cache_salt = None  # as SGLang's RadixKey (``cache_salt or None``): no salt
        if extra_key is None and cache_salt is None and cls._default is not None:
            return cls._default
        for name, val in (("extra_key", extra_key), ("cache_salt", cache_salt)):
            if val is not None and not isinstance(val, str):
                raise InvalidInputError(f"{name} must be a str or None, got {val!r}")
        ident = (extra_key, cache_salt)
        found = cls._interned.get(ident)
        if found is None:
            found = object.__new__(cls)
            object.__setattr__(found, "extra_key", extra_key)
            object.__setattr__(found, "cache_salt", cache_salt)
            cls._interned[ident] = found
        return found

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Namespace is immutable")

    @property
    def is_default(self) -> bool:
        return self.extra_key is None and self.cache_salt is None

    def __repr__(self) -> str:
        return f"Namespace(extra_key={self.extra_key!r}, cache_salt={self.cache_salt!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Namespace, (self.extra_key, self.cache_salt))


DEFAULT_NAMESPACE: Final = Namespace()
Namespace._default = DEFAULT_NAMESPACE  # held for good (and found without a table lookup)


def interned_namespaces() -> int:
    """How many namespaces are interned now (the ones something still uses)."""
    return len(Namespace._interned)


def encode_tokens(tokens: Any) -> bytes:
    """Validate token ids and return them as little-endian uint32 bytes.

    Accepts what engines hold: a list or tuple of ints, an ``array.array`` of integers (SGLang
    keeps ``array('q')``), a numpy integer array, a torch integer tensor (any device). Each
    form takes one vectorised pass with one range check; Python ``bool`` values, being ints,
    read as 0 and 1 (bool arrays and tensors are refused). Raises :class:`InvalidInputError`
    naming the first bad value.
    """
    kind = type(tokens)
    if kind is list or kind is tuple:
        if _ARRAY_I_OK:
            try:  # one C pass: ints (and numpy ints) in [0, 2**32)
                if kind is list:  # fromlist reads the list directly (a quarter fewer steps)
                    ids = array("I")
                    ids.fromlist(tokens)
                    return ids.tobytes()
                return array("I", tokens).tobytes()
            except (OverflowError, TypeError, ValueError):
                pass  # find and name the bad value below
        return _encode_slow(tokens)
    if kind is array:
        fast = _ARRAY_FAST.get(tokens.typecode)
        if fast is not None:
            out = fast(tokens)
            if out is not None:
                return out
        elif tokens.typecode not in _INT_TYPECODES:
            raise InvalidInputError(
                f"tokens must be integers, got an array of typecode {tokens.typecode!r}"
            )
        return _encode_numpy(np.frombuffer(tokens, dtype=tokens.typecode))
    if isinstance(tokens, bytes | bytearray | memoryview):
        raise InvalidInputError("tokens must be a sequence of ints, got a bytes-like object")
    if isinstance(tokens, np.ndarray):
        return _encode_numpy(tokens)
    if kind.__module__.startswith("torch"):
        try:
            arr = np.asarray(tokens.detach().cpu())
        except (AttributeError, RuntimeError, NotImplementedError, TypeError) as exc:
            where = getattr(tokens, "device", "?")
            raise InvalidInputError(
                f"tokens: cannot read the ids of a {kind.__name__} on device {where} "
                f"({exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
            ) from None
        return _encode_numpy(arr)
    if not isinstance(tokens, Sequence):
        raise InvalidInputError(f"tokens must be a sequence of ints, got {kind.__name__}")
    return _encode_slow(tokens)


_INT_TYPECODES: Final = frozenset("bBhHiIlLqQ")

_LITTLE: Final = sys.byteorder == "little"
_U32: Final = np.dtype("<u4")
_I32: Final = np.dtype("<i4")
try:  # the C function np.count_nonzero calls for a whole array, without its Python wrapper
    from numpy._core.multiarray import count_nonzero as _count_nonzero
except ImportError:  # numpy < 2
    _count_nonzero = np.count_nonzero
_min_of = np.minimum.reduce


def _wide_ids(tokens: Any) -> bytes | None:
    """Eight-byte integers (``array('q')``, SGLang's form): on a little-endian machine each is
    a low and a high uint32 word, and the ids are in range exactly when every high word is 0
    (a negative id has a high word of all ones). One count over the high words checks them
    all; the low words are the key. None: a bad id, named by the general path."""
    words = np.frombuffer(tokens, _U32)
    if _count_nonzero(words[1::2]):
        return None
    out: bytes = words[0::2].tobytes()
    return out


def _u32_ids(tokens: Any) -> bytes:
    """Four-byte unsigned integers: their native little-endian bytes are the key as they are."""
    return bytes(tokens)


def _i32_ids(tokens: Any) -> bytes | None:
    """Four-byte signed integers: the key as they are once none is negative."""
    if len(tokens) and _min_of(np.frombuffer(tokens, _I32)) < 0:
        return None
    return bytes(tokens)


def _array_fast_paths() -> dict[str, Callable[[Any], bytes | None]]:
    """The typecodes with a one-pass path on this machine (by item size; none on a big-endian
    machine, where every array takes the general numpy path)."""
    if not _LITTLE:
        return {}
    paths: dict[str, Callable[[Any], bytes | None]] = {}
    for code in "iIlLqQ":
        size = array(code).itemsize
        if size == 8:
            paths[code] = _wide_ids
        elif size == 4:
            paths[code] = _u32_ids if code.isupper() else _i32_ids
    return paths


#: array typecode -> its fast path (returns None for an out-of-range id)
_ARRAY_FAST: Final = _array_fast_paths()


def _encode_numpy(arr: np.ndarray) -> bytes:
    if arr.ndim != 1:
        raise InvalidInputError(f"tokens must be one-dimensional, got shape {arr.shape}")
    dtype = arr.dtype
    if dtype.isnative and arr.flags.c_contiguous:
        fast = _ARRAY_FAST.get(dtype.char)
        if fast is not None:
            out = fast(arr)
            if out is not None:
                return out
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidInputError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN_ID):
        bad = arr[(arr < 0) | (arr > MAX_TOKEN_ID)][0]
        pos = int(np.flatnonzero((arr < 0) | (arr > MAX_TOKEN_ID))[0])
        raise InvalidInputError(
            f"token id {int(bad)} at position {pos} is outside [0, {MAX_TOKEN_ID}]"
        )
    return arr.astype("<u4", copy=False).tobytes()


def _encode_slow(tokens: Sequence[Any]) -> bytes:
    """Element by element, naming the first value that is not an int in range."""
    for pos, tok in enumerate(tokens):
        if not isinstance(tok, int | np.integer):
            raise InvalidInputError(f"token at position {pos} is not an int: {tok!r}")
        if not 0 <= int(tok) <= MAX_TOKEN_ID:
            raise InvalidInputError(
                f"token id {int(tok)} at position {pos} is outside [0, {MAX_TOKEN_ID}]"
            )
    return np.asarray([int(t) for t in tokens], dtype="<u4").tobytes()


def decode_tokens(data: bytes) -> list[int]:
    """The token ids stored in ``data`` (inverse of :func:`encode_tokens`)."""
    out: list[int] = np.frombuffer(data, dtype="<u4").tolist()
    return out


class RadixKey:
    """Validated token ids (as uint32 bytes) plus a namespace.

    Build one per request and reuse it for match and insert: validation happens once.
    """

    __slots__ = ("data", "namespace")

    data: bytes
    namespace: Namespace
    #: bytes of one unit of ``data`` (a token here; a bigram in :class:`BigramKey`)
    unit_bytes: int = TOKEN_BYTES
    #: True for :class:`BigramKey` (the EAGLE view)
    is_bigram: bool = False

    def __init__(
        self,
        tokens: Any,
        extra_key: str | None = None,
        cache_salt: str | None = None,
        *,
        namespace: Namespace | None = None,
    ) -> None:
        self.data = encode_tokens(tokens)
        if namespace is None:
            if extra_key is None and cache_salt is None:
                self.namespace = DEFAULT_NAMESPACE
            else:
                self.namespace = Namespace(extra_key, cache_salt)
        elif extra_key is not None or cache_salt is not None:
            raise InvalidInputError("pass either namespace or extra_key/cache_salt, not both")
        else:
            self.namespace = namespace

    @classmethod
    def from_bytes(cls, data: bytes, namespace: Namespace = DEFAULT_NAMESPACE) -> RadixKey:
        if len(data) % cls.unit_bytes:
            raise InvalidInputError(
                f"{cls.__name__} bytes length {len(data)} is not a multiple of {cls.unit_bytes}"
            )
        key = cls.__new__(cls)
        key.data = bytes(data)
        key.namespace = namespace
        return key

    def __len__(self) -> int:
        return len(self.data) >> 2

    @property
    def tokens(self) -> list[int]:
        return decode_tokens(self.data)

    def __getitem__(self, item: slice) -> RadixKey:
        if not isinstance(item, slice) or item.step not in (None, 1):
            raise InvalidInputError("RadixKey supports only contiguous slices")
        start, stop, _ = item.indices(len(self))
        return RadixKey.from_bytes(self.data[start * 4 : stop * 4], self.namespace)

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is type(self)
            and self.namespace is other.namespace
            and self.data == other.data
        )

    def __hash__(self) -> int:
        return hash((self.data, id(self.namespace)))

    def __repr__(self) -> str:
        toks = self.tokens
        shown = toks if len(toks) <= 8 else [*toks[:8], "..."]
        ns = "" if self.namespace.is_default else f", {self.namespace!r}"
        return f"RadixKey({shown}, len={len(toks)}{ns})"


class BigramKey(RadixKey):
    """The EAGLE view of a key: ``N + 1`` raw tokens read as ``N`` bigrams ``(t_i, t_i+1)``.

    A cache serving an EAGLE draft model keys its KV this way: the draft KV at position ``i``
    depends on token ``i + 1`` too, so ``N + 1`` tokens name ``N`` positions. ``data`` holds
    each bigram as ``u32le(t_i) || u32le(t_i+1)`` (8 bytes), built once when the key is made:
    every tree operation then walks, compares, slices and splits whole bigrams with the same
    C-speed bytes operations as token keys (no per-operation view), and a page of ``data`` is
    exactly the bytes the reference's page hash reads for a bigram page. Lengths, slices and
    positions count bigrams; :attr:`tokens` gives the raw tokens back.
    """

    __slots__ = ()
    unit_bytes = 2 * TOKEN_BYTES
    is_bigram = True

    def __init__(
        self,
        tokens: Any,
        extra_key: str | None = None,
        cache_salt: str | None = None,
        *,
        namespace: Namespace | None = None,
    ) -> None:
        super().__init__(tokens, extra_key, cache_salt, namespace=namespace)
        self.data = bigram_bytes(self.data)

    @classmethod
    def of(cls, key: RadixKey) -> BigramKey:
        """The bigram view of the token key ``key`` (same namespace); a BigramKey as is."""
        if isinstance(key, BigramKey):
            return key
        out = cls.__new__(cls)
        out.data = bigram_bytes(key.data)
        out.namespace = key.namespace
        return out

    def __len__(self) -> int:
        return len(self.data) >> 3

    @property
    def tokens(self) -> list[int]:
        """The raw tokens (``len(self) + 1`` of them; none for an empty key)."""
        words = np.frombuffer(self.data, dtype="<u4")
        if not len(words):
            return []
        out: list[int] = words[::2].tolist()
        out.append(int(words[-1]))
        return out

    @property
    def pairs(self) -> list[tuple[int, int]]:
        """The bigrams, as ``(t_i, t_i+1)`` tuples."""
        return decode_pairs(self.data)

    def __getitem__(self, item: slice) -> BigramKey:
        if not isinstance(item, slice) or item.step not in (None, 1):
            raise InvalidInputError("BigramKey supports only contiguous slices")
        start, stop, _ = item.indices(len(self))
        out = BigramKey.__new__(BigramKey)
        out.data = self.data[start * 8 : stop * 8]
        out.namespace = self.namespace
        return out

    def extended(self, tokens: Any) -> BigramKey:
        """This key followed by the raw ``tokens`` (the bigram across the seam included)."""
        new = encode_tokens(tokens)
        if not new:
            return self
        if not self.data:
            raise InvalidInputError(
                "an empty BigramKey has no last token to extend from; build the key from "
                "all raw tokens instead"
            )
        out = BigramKey.__new__(BigramKey)
        out.data = self.data + bigram_bytes(self.data[-4:] + new)
        out.namespace = self.namespace
        return out

    def __repr__(self) -> str:
        toks = self.tokens
        shown = toks if len(toks) <= 8 else [*toks[:8], "..."]
        ns = "" if self.namespace.is_default else f", {self.namespace!r}"
        return f"BigramKey(tokens={shown}, bigrams={len(self)}{ns})"


def decode_pairs(data: bytes) -> list[tuple[int, int]]:
    """The bigrams stored in ``data`` (BigramKey bytes), as ``(t_i, t_i+1)`` tuples."""
    words: list[int] = np.frombuffer(data, dtype="<u4").tolist()
    return list(zip(words[::2], words[1::2], strict=True))


def bigram_bytes(raw: bytes) -> bytes:
    """The bigram bytes of raw token bytes: ``u32le(t_i) || u32le(t_i+1)`` for each ``i``
    (empty for fewer than two tokens)."""
    n = len(raw) >> 2
    if n < 2:
        return b""
    words = np.frombuffer(raw, dtype="<u4")
    out = np.empty(2 * n - 2, dtype="<u4")
    out[0::2] = words[:-1]
    out[1::2] = words[1:]
    return out.tobytes()


def as_key(key: Any) -> RadixKey:
    """Return ``key`` as a :class:`RadixKey` (token sequences get the default namespace)."""
    return key if isinstance(key, RadixKey) else RadixKey(key)


def as_bigram_key(key: Any) -> BigramKey:
    """``key`` (a BigramKey, a RadixKey of raw tokens, or raw token ids) as a BigramKey."""
    if isinstance(key, BigramKey):
        return key
    if isinstance(key, RadixKey):
        return BigramKey.of(key)
    return BigramKey(key)
