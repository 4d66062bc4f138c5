"""KV events on the wire: a ZMQ publisher a KV-aware router subscribes to unchanged.

The protocol is SGLang's and vLLM's: a PUB socket sends each batch as three frames ``(topic,
seq, payload)`` (``seq`` an 8-byte big-endian counter from 0, ``payload`` the msgpack batch of
:mod:`asynccache.kvevents`); an optional ROUTER *replay* socket answers a request frame holding
a start sequence number (8 bytes, big-endian) with every buffered batch from there, as
``(topic, seq, payload)`` frames, then an end marker ``(b"", seq -1, b"")``, so a subscriber
that joined late (or lost messages) recovers what it missed.

Asyncio-native: it lives on the loop that owns the cache (the replay socket is served by a task
on it); publishing never blocks (PUB drops past its high-water mark, as ZMQ does; the replay
buffer still has the batch)::

    async with KVEventPublisher("tcp://127.0.0.1:5557",
                                replay_endpoint="tcp://127.0.0.1:5558") as pub:
        ...
        pub.publish_from(cache)  # after each scheduler step: cache.take_events(), if any

Needs ``pyzmq`` (``pip install asynccache[events]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Protocol

from asynccache.errors import ConfigError
from asynccache.kvevents import encode_batch
from asynccache.logs import get_logger
from asynccache.tree.events import KVEvent

_log = get_logger("events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class _EventSource(Protocol):
    def take_events(self) -> list[KVEvent]: ...


def _zmq() -> Any:
    try:
        import zmq
        import zmq.asyncio
    except ImportError as exc:  # an optional extra
        raise ConfigError("KV event publishing needs pyzmq: pip install 'asynccache[events]'"
                          ) from exc
    return zmq


class KVEventPublisher:
    """PUB socket (and optional ROUTER replay socket) for one cache's KV events.

    ``endpoint`` / ``replay_endpoint``: ZMQ addresses to bind (``tcp://127.0.0.1:5557``,
    ``ipc://...``; port 0 binds a free port, see :attr:`endpoint`). ``buffer_steps`` batches
    are kept for replay; ``attn_dp_rank`` goes into every batch.
    """

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None,
                 topic: str = "", buffer_steps: int = 10_000, hwm: int = 100_000,
                 attn_dp_rank: int | None = None) -> None:
        if buffer_steps < 1:
            raise ConfigError(f"buffer_steps must be >= 1, got {buffer_steps!r}")
        self._zmq = _zmq()
        self._want = (endpoint, replay_endpoint)
        self._topic = topic.encode("utf-8")
        self._hwm = hwm
        self._rank = attn_dp_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = itertools.count()
        self._ctx: Any = None
        self._pub: Any = None
        self._replay: Any = None
        self._replay_task: asyncio.Task[None] | None = None
        self.endpoint: str | None = None  # as bound (a port 0 resolved)
        self.replay_endpoint: str | None = None
        self.published = 0  # batches sent

    async def start(self) -> KVEventPublisher:
        zmq = self._zmq
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)  # (a plain socket: a PUB send never waits)
        self._pub.setsockopt(zmq.SNDHWM, self._hwm)
        self.endpoint = self._bind(self._pub, self._want[0])
        if self._want[1] is not None:
            self._replay = zmq.asyncio.Context.shadow(self._ctx).socket(zmq.ROUTER)
            self.replay_endpoint = self._bind(self._replay, self._want[1])
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())
        return self

    def _bind(self, sock: Any, endpoint: str) -> str:
        zmq = self._zmq
        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            port = sock.bind_to_random_port(endpoint[: -len(":0")])
            return f"{endpoint[: -len(':0')]}:{port}"
        sock.bind(endpoint)
        bound: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return bound

    def publish(self, events: Sequence[KVEvent], *, ts: float | None = None) -> int | None:
        """Send ``events`` as one batch; returns its sequence number (None: nothing to send)."""
        if self._pub is None:
            raise ConfigError("the publisher is not started: use 'async with KVEventPublisher(...)'")
        if not events:
            return None
        seq = next(self._seq)
        payload = encode_batch(events, ts=ts, attn_dp_rank=self._rank)
        frames = (self._topic, seq.to_bytes(8, "big"), payload)
        try:
            self._pub.send_multipart(frames, flags=self._zmq.NOBLOCK)
        except self._zmq.Again:  # past the high-water mark: dropped (the replay buffer has it)
            _log.warning("kv_events_dropped", seq=seq, events=len(events))
        self._buffer.append((seq, payload))
        self.published += 1
        return seq

    def publish_from(self, cache: _EventSource) -> int | None:
        """Publish what ``cache`` recorded since the last call (``cache.take_events()``)."""
        return self.publish(cache.take_events())

    async def _serve_replay(self) -> None:
        sock = self._replay
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                _log.warning("kv_events_bad_replay_request", frames=len(frames))
                continue
            client, empty, start = frames
            first = int.from_bytes(start, "big", signed=True)
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await sock.send_multipart(
                        (client, empty, self._topic, seq.to_bytes(8, "big"), payload))
            await sock.send_multipart((client, empty, b"", END_SEQ, b""))

    async def aclose(self) -> None:
        task, self._replay_task = self._replay_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def __aenter__(self) -> KVEventPublisher:
        return await self.start()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()
