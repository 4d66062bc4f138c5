"""L3 storage backends of asynccache: one small async protocol, a file and an S3 backend.

``S3Backend`` is imported lazily (it needs obstore); everything else is light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from storage.base import StorageBackend, StorageLayout, validate_keys
from storage.factory import open_backend, parse_size
from storage.faults import Fault, FaultInjectingBackend, FaultKind, FaultRule
from storage.file import FileBackend
from storage.pageformat import HEADER_SIZE, CorruptPageError

if TYPE_CHECKING:
    from storage.s3 import S3Backend

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
        from storage.s3 import S3Backend

        return S3Backend
    raise AttributeError(f"module 'storage' has no attribute {name!r}")
