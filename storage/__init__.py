"""asynccache.storage: L3 backends behind one small async protocol (file and S3 backends).

``S3Backend`` is imported lazily (it needs obstore); everything else is light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asynccache.storage.base import StorageBackend, StorageLayout, validate_keys
from asynccache.storage.factory import open_backend, parse_size
from asynccache.storage.faults import Fault, FaultInjectingBackend, FaultKind, FaultRule
from asynccache.storage.file import FileBackend
from asynccache.storage.pageformat import HEADER_SIZE, CorruptPageError

if TYPE_CHECKING:
    from asynccache.storage.s3 import S3Backend

__all__ = [
    "HEADER_SIZE",
    "CorruptPageError",
    "Fault",
    "FaultInjectingBackend",
    "FaultKind",
    "FaultRule",
    "FileBackend",
    "S3Backend",
    "StorageBackend",
    "StorageLayout",
    "open_backend",
    "parse_size",
    "validate_keys",
]


def __getattr__(name: str) -> Any:
    if name == "S3Backend":
        from asynccache.storage.s3 import S3Backend

        return S3Backend
    raise AttributeError(f"module 'asynccache.storage' has no attribute {name!r}")
