"""Object-store backend: the S3 API through obstore, with the same checksummed page format.

obstore (Python bindings of the Rust ``object_store`` crate, maintained by the developmentseed
team and used by the Apache Arrow ecosystem) gives native async ``get``/``put``/``head``/
``delete``/``list`` with its own connection pool, request timeouts and retries, without
dragging in botocore; see ``docs/storage.md`` for the comparison. Its async calls are asyncio
futures: this backend needs an asyncio event loop (anyio on its asyncio backend is fine).

* Object names: ``<prefix>/<key>.<layout tag>.kv`` (``.<layout tag>.mac-<key id>.kv`` with a
  ``mac_key``: pages then carry a keyed MAC and only verified pages are served).
* Every call runs under a deadline (``timeout_s`` + ``timeout_per_gib_s`` per GiB); requests
  still running when it passes are cancelled and their pages count as ``timeout`` misses.
  obstore's own per-request timeout and a small retry budget sit below that.
* Reads verify the header and checksum before copying into the caller's buffer; a bad object
  is deleted. Checksums and copies of pages of 2 MiB and more run in a worker thread (numpy and
  xxhash release the GIL) so the event loop stays responsive with multi-MiB pages.
* A small positive cache (key -> last seen) lets ``exists_prefix`` and ``set_batch`` skip HEAD
  and PUT requests for pages known to be stored.
"""

from __future__ import annotations

import os
import re
import time
from collections import OrderedDict
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import obstore
from obstore.exceptions import (
    NotFoundError,
    PermissionDeniedError,
    UnauthenticatedError,
)
from obstore.store import S3Store
from prometheus_client import CollectorRegistry

from asynccache.errors import ConfigError, StorageError
from asynccache.storage.backend import MISS, OK, PRESENT, BackendBase, os_error_reason, positive
from asynccache.storage.base import StorageLayout, check_batch, copy_into, validate_keys
from asynccache.storage.faults import Fault, FaultKind, fault_error, flip_byte
from asynccache.storage.pageformat import (
    HEADER_SIZE,
    CorruptPageError,
    encode_header,
    parse_header,
    verify_payload,
)

__all__ = ["S3Backend"]

#: Pages at least this large are checksummed / copied in a worker thread (numpy and xxhash
#: release the GIL). Smaller ones inline: a thread hop costs more than ~0.3 ms of loop time
#: (measured with scripts/bench_storage.py: inline 1 MiB gets ran at 1.1x raw, offloaded 0.7x).
_OFFLOAD_BYTES = 2 * 1024 * 1024


_HTTP_KIND_RE = re.compile(r"HttpError\s*\{\s*kind:\s*(\w+)")
_HTTP_KIND_REASON = {
    "Connect": "connection",
    "Request": "connection",
    "Interrupted": "connection",
    "Timeout": "timeout",
}


def _reason(exc: BaseException) -> str:
    """Map an obstore (or OS) error to a fault reason."""
    if isinstance(exc, PermissionDeniedError | UnauthenticatedError):
        return "permission"
    if isinstance(exc, OSError):
        return os_error_reason(exc)
    text = str(exc)
    m = _HTTP_KIND_RE.search(text)
    if m:
        return _HTTP_KIND_REASON.get(m.group(1), "io_error")
    if "403 Forbidden" in text or "SignatureDoesNotMatch" in text:
        return "permission"
    return "io_error"


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def _summary(exc: BaseException) -> str:
    """The whole first paragraph of an error (obstore appends a multi-line debug dump)."""
    return " ".join(str(exc).split("\n\n", 1)[0].split()) or type(exc).__name__


class S3Backend(BackendBase):
    """Pages as objects in an S3 bucket (AWS, SeaweedFS, MinIO, ...)."""

    kind = "s3"

    def __init__(
        self,
        bucket: str,
        layout: StorageLayout,
        *,
        prefix: str = "",
        endpoint: str | None = None,
        region: str = "us-east-1",
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        max_concurrency: int = 16,
        retries: int = 2,
        request_timeout_s: float | None = None,
        timeout_s: float = 10.0,
        timeout_per_gib_s: float = 20.0,
        exists_cache_ttl_s: float = 30.0,
        exists_cache_size: int = 100_000,
        registry: CollectorRegistry | None = None,
        metrics_label: str | None = None,
        store: Any = None,
        mac_key: bytes | str | None = None,
    ) -> None:
        super().__init__(
            layout,
            timeout_s=timeout_s,
            timeout_per_gib_s=timeout_per_gib_s,
            registry=registry,
            metrics_label=metrics_label,
            mac_key=mac_key,
        )
        if not isinstance(bucket, str) or not bucket:
            raise ConfigError(f"bucket must be a non-empty string, got {bucket!r}")
        if not isinstance(prefix, str):
            raise ConfigError(f"prefix must be a string, got {prefix!r}")
        if endpoint is not None and not (
            isinstance(endpoint, str) and endpoint.startswith(("http://", "https://"))
        ):
            raise ConfigError(f"endpoint must be an http(s):// URL, got {endpoint!r}")
        for name, value in (
            ("max_concurrency", max_concurrency),
            ("exists_cache_size", exists_cache_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ConfigError(f"retries must be an int >= 0, got {retries!r}")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint = endpoint
        self.max_concurrency = max_concurrency
        self.exists_cache_ttl_s = positive(
            "exists_cache_ttl_s", exists_cache_ttl_s, allow_zero=True
        )
        self.exists_cache_size = exists_cache_size
        req_timeout = positive(
            "request_timeout_s", request_timeout_s if request_timeout_s is not None else timeout_s
        )
        if store is None:
            access_key_id = access_key_id or os.environ.get("AWS_ACCESS_KEY_ID")
            secret_access_key = secret_access_key or os.environ.get("AWS_SECRET_ACCESS_KEY")
            session_token = session_token or os.environ.get("AWS_SESSION_TOKEN")
            config: dict[str, Any] = {"region": region, "virtual_hosted_style_request": False}
            if endpoint is not None:
                config["endpoint"] = endpoint
            if access_key_id and secret_access_key:
                config["access_key_id"] = access_key_id
                config["secret_access_key"] = secret_access_key
                if session_token:
                    config["session_token"] = session_token
            elif endpoint is not None:
                # A custom endpoint never gets cloud instance-metadata credentials (obstore
                # would ask 169.254.169.254, then fail with an unrelated error).
                raise ConfigError(
                    f"S3 endpoint {endpoint}: no credentials: set AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY (or pass access_key_id / secret_access_key)"
                )
            store = self._make_store(bucket, config, endpoint, req_timeout, retries)
        self._store = store
        self._known: OrderedDict[str, float] = OrderedDict()  # key -> monotonic time seen
        self._sem: anyio.Semaphore | None = None
        # HMAC runs at ~1.8 GB/s against ~20 for xxh3: with a key, offload smaller pages too.
        self._offload = _OFFLOAD_BYTES if self._mac is None else _OFFLOAD_BYTES // 4

    def _make_store(
        self,
        bucket: str,
        config: dict[str, Any],
        endpoint: str | None,
        req_timeout: float,
        retries: int,
    ) -> S3Store:
        try:
            return S3Store(
                bucket,
                prefix=self.prefix or None,
                config=config,  # type: ignore[arg-type]
                client_options={
                    "allow_http": bool(endpoint and endpoint.startswith("http://")),
                    "timeout": timedelta(seconds=req_timeout),
                    "connect_timeout": timedelta(seconds=min(req_timeout, 3.0)),
                },
                retry_config={
                    "max_retries": retries,
                    "retry_timeout": timedelta(seconds=self.timeout_s),
                    "backoff": {
                        "init_backoff": timedelta(milliseconds=50),
                        "max_backoff": timedelta(seconds=1),
                        "base": 2,
                    },
                },
            )
        except Exception as exc:  # obstore validates the configuration here
            raise ConfigError(f"cannot configure S3 bucket {bucket!r}: {exc}") from exc

    # -- helpers --------------------------------------------------------------------------------

    def _name(self, key: str) -> str:
        return key + self._suffix

    def _semaphore(self) -> anyio.Semaphore:
        if self._sem is None:
            self._sem = anyio.Semaphore(self.max_concurrency)
        return self._sem

    def _seen(self, key: str) -> None:
        if self.exists_cache_ttl_s > 0:
            self._known[key] = time.monotonic()
            self._known.move_to_end(key)
            while len(self._known) > self.exists_cache_size:
                self._known.popitem(last=False)

    def _forget(self, key: str) -> None:
        self._known.pop(key, None)

    def _known_fresh(self, key: str) -> bool:
        t = self._known.get(key)
        return t is not None and time.monotonic() - t < self.exists_cache_ttl_s

    async def _pre_fault(self, fault: Fault | None, what: str) -> None:
        if fault is None:
            return
        if fault.kind is FaultKind.DELAY:
            await anyio.sleep(fault.delay_s)
        elif fault.kind in (FaultKind.EIO, FaultKind.DROP, FaultKind.ENOSPC):
            raise fault_error(fault.kind, what)

    async def _run_pages(
        self, n: int, one: Any, deadline: float
    ) -> tuple[list[str], list[str | None]]:
        """Run ``one(i)`` -> (outcome, detail) for every page, at most max_concurrency at once."""
        outcomes: list[str | None] = [None] * n
        details: list[str | None] = [None] * n
        sem = self._semaphore()

        async def run(i: int) -> None:
            async with sem:
                outcomes[i], details[i] = await one(i)

        with anyio.move_on_after(deadline):
            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(run, i)
        return [o if o is not None else "timeout" for o in outcomes], details

    # -- exists ---------------------------------------------------------------------------------

    async def _head(self, key: str) -> tuple[str, str | None]:
        try:
            await self._pre_fault(self._fault("exists", key), "head")
            await obstore.head_async(self._store, self._name(key))
        except (FileNotFoundError, NotFoundError):
            return MISS, None
        except Exception as exc:
            return _reason(exc), _short(exc)
        self._seen(key)
        return OK, None

    async def exists_prefix(self, keys: Sequence[str]) -> int:
        self._check_open()
        key_list = validate_keys(keys)
        started = time.perf_counter()
        n = 0
        while n < len(key_list) and self._known_fresh(key_list[n]):
            n += 1
        rest = key_list[n:]
        window = self.max_concurrency
        end = anyio.current_time() + self._deadline()
        while rest:
            chunk, rest = rest[:window], rest[window:]
            outcomes, details = await self._run_pages(
                len(chunk),
                lambda i, c=chunk: self._head(c[i]),
                max(0.0, end - anyio.current_time()),
            )
            lead = next((j for j, o in enumerate(outcomes) if o != OK), len(chunk))
            n += lead
            if lead < len(chunk):
                # The first page that is not there ends the prefix; say why if it is a fault.
                reason, detail = outcomes[lead], details[lead]
                if reason != MISS:
                    self.metrics.fault("exists", reason)
                    self._log.warning(
                        "storage_faults", op="exists", faults={reason: 1}, detail=detail
                    )
                break
        self.metrics.page("exists", "hit", n)
        self.metrics.page("exists", "miss", min(1, len(key_list) - n))
        self.metrics.observe("exists", time.perf_counter() - started)
        return n

    # -- get ------------------------------------------------------------------------------------

    async def get_batch(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        self._check_open()
        key_list, views = check_batch(keys, buffers, writable=True)
        started = time.perf_counter()

        async def one(i: int) -> tuple[str, str | None]:
            return await self._get_one(key_list[i], views[i])

        total = sum(v.nbytes for v in views)
        outcomes, details = await self._run_pages(len(key_list), one, self._deadline(total))
        corrupt: list[str] = []
        missing: list[str] = []
        for key, outcome in zip(key_list, outcomes, strict=True):
            if outcome in ("corrupt", "partial"):
                corrupt.append(key)  # the object was deleted
            elif outcome == MISS and key in self._known:
                missing.append(key)  # seen stored, now gone: another writer deleted it
            if outcome in (MISS, "corrupt", "partial"):
                self._forget(key)
        sizes = [v.nbytes for v in views]
        results = self._account("get", key_list, outcomes, details, sizes, started)
        self._gone(corrupt, "corrupt")
        self._gone(missing, "missing")
        return results

    async def _get_one(self, key: str, target: memoryview) -> tuple[str, str | None]:
        name = self._name(key)
        fault = self._fault("read", key)
        try:
            await self._pre_fault(fault, "get")
            result = await obstore.get_async(self._store, name)
            data: Any = await result.bytes_async()
        except (FileNotFoundError, NotFoundError):
            return MISS, None
        except Exception as exc:
            return _reason(exc), _short(exc)
        view = memoryview(data)
        if fault is not None and fault.kind is FaultKind.SHORT_READ:
            view = view[: int(len(view) * fault.position)]
        elif fault is not None and fault.kind is FaultKind.FLIP_BYTES:
            view = memoryview(bytearray(view))
            flip_byte(view, fault.position)

        mac = self._mac

        def verify_and_copy() -> tuple[str, str | None]:
            info = parse_header(view, name, mac)
            if info.payload_len != target.nbytes and len(view) == HEADER_SIZE + info.payload_len:
                return "size_mismatch", (
                    f"object has {info.payload_len} payload bytes, buffer {target.nbytes}"
                )
            if len(view) != HEADER_SIZE + target.nbytes:
                raise CorruptPageError(
                    "partial",
                    f"object {name}: {len(view)} bytes, expected {HEADER_SIZE + target.nbytes}",
                )
            verify_payload(info, view[HEADER_SIZE:], name, mac)
            copy_into(target, view[HEADER_SIZE:])
            return OK, None

        try:
            if target.nbytes >= self._offload:
                # Not abandonable: a cancelled call waits for this memcpy, so no late writes.
                outcome, detail = await anyio.to_thread.run_sync(verify_and_copy)
            else:
                outcome, detail = verify_and_copy()
        except CorruptPageError as exc:
            await self._remove_bad(key, name)
            return ("partial" if exc.reason == "partial" else "corrupt"), str(exc)
        if outcome == OK:
            self._seen(key)
        return outcome, detail

    async def _remove_bad(self, key: str, name: str) -> None:
        """Delete the corrupt object ``name``. A delete that fails or outlives ``timeout_s``
        is counted (``remove_corrupt.<reason>`` faults) and logged: the object stays, and the
        next read finds it corrupt again (never served) and tries again."""
        reason, detail = "timeout", f"no answer within {self.timeout_s} s"
        with anyio.move_on_after(self.timeout_s):
            try:
                await self._pre_fault(self._fault("delete", key), "delete")
                await obstore.delete_async(self._store, name)
                return
            except (FileNotFoundError, NotFoundError):
                return  # someone else removed it
            except Exception as exc:
                reason, detail = _reason(exc), _short(exc)
        self.metrics.fault("remove_corrupt", reason)
        self._log.warning("storage_remove_bad_failed", object=name, reason=reason, error=detail)

    # -- set ------------------------------------------------------------------------------------

    async def set_batch(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        self._check_open()
        key_list, views = check_batch(keys, buffers, writable=False)
        started = time.perf_counter()

        async def one(i: int) -> tuple[str, str | None]:
            return await self._put_one(key_list[i], views[i])

        total = sum(v.nbytes for v in views)
        outcomes, details = await self._run_pages(len(key_list), one, self._deadline(total))
        sizes = [v.nbytes for v in views]
        return self._account("set", key_list, outcomes, details, sizes, started)

    async def _put_one(self, key: str, payload: memoryview) -> tuple[str, str | None]:
        if self._known_fresh(key):  # content-addressed: already stored
            return PRESENT, None
        name = self._name(key)
        fault = self._fault("write", key)

        def build() -> bytearray:
            body = bytearray(HEADER_SIZE + payload.nbytes)
            body[:HEADER_SIZE] = encode_header(name, payload, self._mac)
            np.copyto(
                np.frombuffer(body, dtype=np.uint8, offset=HEADER_SIZE),
                np.frombuffer(payload, dtype=np.uint8),
            )
            return body

        try:
            await self._pre_fault(fault, "put")
            if payload.nbytes >= self._offload:
                body = await anyio.to_thread.run_sync(build)
            else:
                body = build()
            out: Any = body
            if fault is not None and fault.kind is FaultKind.FLIP_BYTES:
                flip_byte(memoryview(body)[HEADER_SIZE:], fault.position)
            elif fault is not None and fault.kind is FaultKind.PARTIAL_WRITE:
                out = memoryview(body)[: HEADER_SIZE + int(payload.nbytes * fault.position)]
            await obstore.put_async(self._store, name, out, use_multipart=False)
        except Exception as exc:
            return _reason(exc), _short(exc)
        self._seen(key)
        return OK, None

    # -- delete / clear / check -----------------------------------------------------------------

    async def delete(self, keys: Sequence[str]) -> int:
        """Delete pages; S3 does not say whether they existed, so this counts requests done."""
        self._check_open()
        key_list = list(dict.fromkeys(validate_keys(keys)))
        started = time.perf_counter()
        for key in key_list:
            self._forget(key)

        async def one(i: int) -> tuple[str, str | None]:
            try:
                await self._pre_fault(self._fault("delete", key_list[i]), "delete")
                await obstore.delete_async(self._store, self._name(key_list[i]))
            except (FileNotFoundError, NotFoundError):
                return MISS, None
            except Exception as exc:
                return _reason(exc), _short(exc)
            return OK, None

        outcomes, details = await self._run_pages(len(key_list), one, self._deadline())
        sizes = [0] * len(key_list)
        removed = sum(self._account("delete", key_list, outcomes, details, sizes, started))
        self._gone([k for k, o in zip(key_list, outcomes, strict=True) if o == OK], "delete")
        return removed

    async def clear(self) -> int:
        """Delete every object of this layout under the prefix."""
        self._check_open()
        self._known.clear()
        suffix = self._suffix
        removed: list[str] = []
        try:
            with anyio.fail_after(max(self.timeout_s, 60.0)):
                stream = obstore.list(self._store, chunk_size=1000)
                async for batch in stream:
                    paths = [m["path"] for m in batch if m["path"].endswith(suffix)]
                    if paths:
                        await obstore.delete_async(self._store, paths)
                        removed += [p.rsplit("/", 1)[-1][: -len(suffix)] for p in paths]
        except Exception as exc:
            self.metrics.fault("clear", _reason(exc))
            self._log.warning("storage_clear_failed", error=_short(exc), removed=len(removed))
        self._gone(removed, "clear")
        return len(removed)

    async def check(self) -> None:
        """Round-trip a probe object; raise StorageError saying what is wrong (credentials,
        bucket, endpoint). Use it at start-up: later faults only degrade to misses."""
        self._check_open()
        probe = f".asynccache-probe-{os.getpid()}-{time.monotonic_ns()}"
        where = f"s3://{self.bucket}/{self.prefix} at {self.endpoint or 'AWS'}"
        try:
            with anyio.fail_after(self.timeout_s):
                await obstore.put_async(self._store, probe, b"probe", use_multipart=False)
                got = await (await obstore.get_async(self._store, probe)).bytes_async()
                await obstore.delete_async(self._store, probe)
        except (PermissionDeniedError, UnauthenticatedError) as exc:
            raise StorageError(f"{where}: credentials rejected ({_short(exc)})") from exc
        except TimeoutError as exc:
            raise StorageError(f"{where}: no answer within {self.timeout_s} s") from exc
        except Exception as exc:
            reason = _reason(exc)
            if reason == "connection" or "error sending request" in str(exc):
                raise StorageError(
                    f"{where}: the endpoint is unreachable (is the S3 server running, and the "
                    f"endpoint right?): {_summary(exc)}"
                ) from exc
            raise StorageError(f"{where}: {reason}: {_summary(exc)}") from exc
        if bytes(got) != b"probe":
            raise StorageError(f"{where}: probe object read back wrong bytes")

    def stats(self) -> dict[str, Any]:
        return {
            **self._base_stats(),
            "bucket": self.bucket,
            "prefix": self.prefix,
            "endpoint": self.endpoint,
            "known_objects": len(self._known),
        }

    async def aclose(self) -> None:
        self._closed = True

    def __repr__(self) -> str:
        return (
            f"S3Backend(bucket={self.bucket!r}, prefix={self.prefix!r}, tag={self._layout.tag!r})"
        )
