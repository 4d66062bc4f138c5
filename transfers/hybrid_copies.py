"""Host copies of the hybrid-model components: Mamba state copies and grouped copies.

* :class:`StateCopier` copies recurrent states between two :class:`MambaStatePool` s (device
  and host) on one worker thread; each copy is one gather / scatter over the state tensors.
  Completions reach the loop through a :class:`LoopBridge`.
* :class:`GroupHandle` joins the copies of one operation over several pools (FULL KV, SWA KV,
  Mamba states) into a single :class:`CopyHandle`: it finishes when every part has, with the
  first part's error if any failed. The FULL part's indices and the summed bytes describe it.

SWA KV moves with a second :class:`~asynccache.transfers.engine.CopyEngine` over the SWA device and host
pools (same page layout as FULL KV, fewer layers).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from asynccache.errors import ClosedError, InvalidInputError, OwnerError
from asynccache.transfers.bridge import LoopBridge
from asynccache.transfers.handles import CopyHandle, CopyResult
from asynccache.transfers.hybrid_pools import MambaStatePool
from asynccache.transfers.indices import as_slot_array


def host_state_pool(device_pool: MambaStatePool, num_states: int) -> MambaStatePool:
    """A host pool of ``num_states`` states shaped like ``device_pool``'s (pinned on CUDA)."""
    shape = tuple(device_pool.states.shape[1:])
    pool = MambaStatePool(num_states, shape, dtype=device_pool.states.dtype, device="cpu")
    if device_pool.states.device.type == "cuda":
        pool.states = pool.states.pin_memory()
    return pool


class StateCopier:
    """Copies Mamba states device <-> host on one worker thread."""

    def __init__(self, device: MambaStatePool, host: MambaStatePool,
                 name: str = "asynccache-states") -> None:
        if tuple(device.states.shape[1:]) != tuple(host.states.shape[1:]) or (
            device.states.dtype != host.states.dtype
        ):
            raise InvalidInputError(
                f"state pools differ: device {tuple(device.states.shape[1:])} "
                f"{device.states.dtype} vs host {tuple(host.states.shape[1:])} {host.states.dtype}"
            )
        self.device = device
        self.host = host
        self.name = name
        self._bytes_per_state = device.states[0].numel() * device.states.element_size()
        self._executor: ThreadPoolExecutor | None = None
        self._bridge: LoopBridge | None = None
        self._loop_thread = 0
        self._in_flight: set[asyncio.Future[Any]] = set()

    async def start(self) -> None:
        if self._executor is not None:
            raise ClosedError(f"StateCopier {self.name!r} already started")
        self._bridge = LoopBridge()
        self._loop_thread = threading.get_ident()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=self.name)

    async def aclose(self) -> None:
        """Wait for the copies in flight, then stop the worker."""
        if self._in_flight:
            await asyncio.gather(*self._in_flight, return_exceptions=True)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._executor = None

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def submit_d2h(self, device_idx: Any, host_idx: Any) -> CopyHandle:
        return self._submit("d2h", self.device, device_idx, self.host, host_idx)

    def submit_h2d(self, host_idx: Any, device_idx: Any) -> CopyHandle:
        return self._submit("h2d", self.host, host_idx, self.device, device_idx)

    def _submit(self, op: str, src: MambaStatePool, src_idx: Any, dst: MambaStatePool,
                dst_idx: Any) -> CopyHandle:
        if self._executor is None or self._bridge is None:
            raise ClosedError(f"StateCopier {self.name!r} is not running")
        if threading.get_ident() != self._loop_thread:
            raise OwnerError("StateCopier.submit_* must be called on its event loop thread")
        s = as_slot_array(src_idx, name="src_idx").copy()
        d = as_slot_array(dst_idx, name="dst_idx").copy()
        if s.shape != d.shape:
            raise InvalidInputError(f"{s.shape[0]} source states but {d.shape[0]} destinations")
        for arr, pool in ((s, src), (d, dst)):
            if arr.shape[0] and (int(arr.min()) < 0 or int(arr.max()) >= pool.states.shape[0]):
                raise InvalidInputError(f"a state slot of {arr.tolist()[:8]} is out of range")
        nbytes = int(s.shape[0]) * self._bytes_per_state
        submitted = time.perf_counter()

        def work() -> CopyResult:
            began = time.perf_counter()
            if s.shape[0]:
                rows = src.states.index_select(0, torch.from_numpy(s).to(src.states.device))
                dst.states.index_copy_(0, torch.from_numpy(d).to(dst.states.device),
                                       rows.to(dst.states.device, non_blocking=False))
                if dst.states.device.type == "cuda":  # the scatter is queued: wait for it
                    torch.cuda.current_stream(dst.states.device).synchronize()
            return CopyResult(op, int(s.shape[0]), nbytes, began - submitted,
                              time.perf_counter() - began)

        fut = self._bridge.wrap_future(self._executor.submit(work))
        self._in_flight.add(fut)
        fut.add_done_callback(self._in_flight.discard)
        fut.add_done_callback(_retrieve)
        return CopyHandle(op, fut, s, d, nbytes)


class GroupHandle(CopyHandle):
    """Several copies of one operation as one handle (see the module docstring)."""

    __slots__ = ("parts",)

    def __init__(self, parts: Sequence[CopyHandle]) -> None:
        if not parts:
            raise InvalidInputError("a GroupHandle needs at least one copy")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        fut.add_done_callback(_retrieve)
        first = parts[0]
        super().__init__(first.op, fut, first.src_indices, first.dst_indices,
                         sum(p.num_bytes for p in parts))
        self.parts = tuple(parts)
        left = [len(parts)]

        def one_done(_h: CopyHandle) -> None:
            left[0] -= 1
            if left[0] or fut.done():
                return
            error = None
            for p in self.parts:
                try:
                    p.result()
                except BaseException as exc:  # the part's own error
                    error = exc
                    break
            if error is not None:
                fut.set_exception(error)
                return
            results = [p.result() for p in self.parts]
            fut.set_result(CopyResult(
                first.op, first.num_tokens, self.num_bytes,
                min(r.queued_s for r in results), max(r.duration_s for r in results)))

        for p in parts:
            p.add_done_callback(one_done)


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


def state_bytes(pool: MambaStatePool, slots: np.ndarray) -> bytes:
    """The raw bytes of the states ``slots`` (for bit-exact comparisons and storage)."""
    idx = torch.from_numpy(as_slot_array(slots, name="slots").copy())
    rows = pool.states.index_select(0, idx.to(pool.states.device)).cpu().contiguous()
    return bytes(rows.view(torch.uint8).numpy().tobytes())
