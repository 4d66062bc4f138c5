"""A throw-away SeaweedFS S3 server for tests, and how to reach it."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asynccache.storage.base import StorageLayout
    from asynccache.storage.s3 import S3Backend
    from asynccache.storage.seaweed import LocalSeaweed

__all__ = ["S3Server"]


@dataclass(frozen=True)
class S3Server:
    """A running S3 endpoint with one bucket and credentials that can use it.

    ``backend(layout)`` builds an :class:`~asynccache.storage.s3.S3Backend` on it (a fresh random prefix
    unless one is given, so tests sharing the server never see each other's pages);
    ``url(prefix)`` / ``backend_kwargs()`` are what :func:`storage.open_backend` takes.
    """

    endpoint: str
    bucket: str
    access_key_id: str
    secret_access_key: str
    region: str = "us-east-1"
    server: LocalSeaweed | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, server: LocalSeaweed) -> S3Server:
        return cls(endpoint=server.endpoint, bucket=server.bucket,
                   access_key_id=server.access_key, secret_access_key=server.secret_key,
                   server=server)

    def url(self, prefix: str = "") -> str:
        """``s3://bucket/prefix?endpoint=...`` (credentials go in :meth:`backend_kwargs`)."""
        return f"s3://{self.bucket}/{prefix.strip('/')}?endpoint={self.endpoint}&region={self.region}"

    def backend_kwargs(self) -> dict[str, Any]:
        return {"access_key_id": self.access_key_id, "secret_access_key": self.secret_access_key}

    def backend(self, layout: StorageLayout, *, prefix: str | None = None,
                **kwargs: Any) -> S3Backend:
        """An S3Backend on this server (not checked: ``await backend.check()`` for that)."""
        from asynccache.storage.s3 import S3Backend

        prefix = prefix if prefix is not None else f"test-{secrets.token_hex(6)}"
        options: dict[str, Any] = {"endpoint": self.endpoint, "region": self.region,
                                   "timeout_s": 10.0, "retries": 0, **self.backend_kwargs()}
        options.update(kwargs)
        return S3Backend(self.bucket, layout, prefix=prefix, **options)
