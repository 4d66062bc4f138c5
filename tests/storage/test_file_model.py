"""A randomized, model-based test of the file backend's bookkeeping under concurrency and faults.

One real ``FileBackend`` in ``tmp_path`` (a small ``capacity_bytes``, so that sets evict; one file
per page or segments; no fsync) is driven through steps. Each step starts a few calls at once
(``set_batch`` / ``get_batch`` / ``exists_prefix`` / ``delete`` / ``clear``, in one task group),
under a fault plan drawn for the step: unlinks, reads, writes failing with EIO, writes with
ENOSPC (also once per key: the retry after the eviction it causes goes through), reads
flipping a byte in flight (often with the removal of the corrupt pages failing: they are then
kept corrupt), unlinks slower than the deadline (they end late) or just slow (other calls
overlap them), and worker threads stuck until the step ends (later calls then fail fast:
``unavailable``). Every (key, set call) writes its own content, so a page read back says which
write it came from.

When a step's calls have returned, the stuck threads are let go and the backend must become
quiescent (no key busy, no stuck thread, no reservation, no quarantined page, no temp file).
Then, against the real directory:

1. the index and the directory agree: the same page names; each indexed file (unit) is one
   inode on disk, of the bytes the index counts for it, no two units share an inode, and
   ``used_bytes`` / ``objects`` / ``files`` are those sums; no temp file is left or counted;
   a page kept corrupt (a read found it bad and its removal failed) is still the file found
   bad;
2. the capacity: whenever the reservations grow (whatever the path), the index's bytes and
   the reservations fit in ``capacity_bytes``; and after every call and when quiescent they
   exceed it by no more than the files counted without a reservation since the last one (put
   back after a failed unlink, or adopted by ``exists_prefix``) still indexed;
3. every ``get_batch`` hit is exactly the content of one write of that key that was stored
   (its set reported it ``ok``) and alive at some time during the get (never another key's,
   a failed write's, or a version replaced or told removed before the get began), and never
   a page kept corrupt when the get began;
4. a page told removed (listeners: delete, clear, eviction, corrupt, missing) is never read
   back by a later get; ``delete`` / ``clear`` count no more pages than they told removed;
5. listeners hear each removal exactly once: replaying a key's stores and removals in order,
   a removal always finds the key stored, a store never finds it stored (unless its page was
   quarantined or kept corrupt: such a page is written again in place), and at the end the
   key is stored iff its page is on disk, with the content of its last stored write.

Now and then (and whenever a page is kept corrupt) a step ends with quiet reads (no faults):
``exists_prefix`` of every key and a ``get_batch`` of some and of those kept corrupt say
exactly what is on disk, but for pages kept corrupt: misses, and the reads remove them. At the end, a restart rebuilds the same index from the directory.

Seeds are deterministic for the calls and the fault plans (thread timing is not): a failure
names its seed and the last steps. A longer run: ``ASYNCCACHE_FILE_MODEL_SEEDS=200
ASYNCCACHE_FILE_MODEL_STEPS=60 pytest tests/storage/test_file_model.py``.
"""

from __future__ import annotations

import contextvars
import hashlib
import itertools
import os
import random
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest

from asynccache.storage.base import StorageLayout
from asynccache.storage.faults import Fault, FaultKind
from asynccache.storage.file import FileBackend
from asynccache.storage.pageformat import HEADER_SIZE
from asynccache.storage.segment import file_bytes

PAGE = 512
FILE = HEADER_SIZE + PAGE
N_KEYS = 12
TIMEOUT_S = 0.04
SEEDS = int(os.environ.get("ASYNCCACHE_FILE_MODEL_SEEDS", "2"))
STEPS = int(os.environ.get("ASYNCCACHE_FILE_MODEL_STEPS", "20"))

#: Each call's op: set 40 %, get 25 %, delete 17 %, exists 13 %, clear 5 %.
OP_MIX = (("set", 0.4), ("get", 0.65), ("delete", 0.82), ("exists", 0.95), ("clear", 1.0))

_call: contextvars.ContextVar[int] = contextvars.ContextVar("file_model_call", default=-1)


def make_keys(n: int) -> list[str]:
    return [hashlib.sha256(f"file-model:{i}".encode()).hexdigest() for i in range(n)]


def payload(key: str, ver: int) -> bytes:
    """The content of write ``ver`` of ``key``: it names both, then bytes derived from them."""
    head = f"{key}:{ver}:".encode()
    block = hashlib.sha256(head).digest()
    return (head + block * (PAGE // len(block) + 1))[:PAGE]


def version_in(data: bytes, key: str) -> int | None:
    """Which write of ``key`` ``data`` (a page, or a whole file) holds (None: no page of it)."""
    at = data.find(f"{key}:".encode())
    if at < 0:
        return None
    end = data.find(b":", at + len(key) + 1)
    try:
        ver = int(data[at + len(key) + 1 : end])
    except ValueError:
        return None
    return ver if data[at : at + PAGE] == payload(key, ver) else None


# -- faults -----------------------------------------------------------------------------------


class Chaos:
    """The fault hook: per raw op, faults drawn at the step's rates. ``stuck`` blocks the worker
    thread until the step ends (:meth:`let_go`); ``slow`` delays an unlink past the deadline;
    ``lag`` delays an unlink well within the deadline (other calls run meanwhile); ``full``
    is ENOSPC for the first write of each key in the step only (a disk that an eviction made
    room on: the retry after ENOSPC goes through)."""

    def __init__(self, seed: int) -> None:
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._plan: dict[str, list[tuple[str, float]]] = {}
        self._gate = threading.Event()
        self._full: set[str] = set()  # keys a ``full`` write fault struck in this step
        self.hits: Counter[tuple[str, str]] = Counter()

    def set_plan(self, plan: dict[str, list[tuple[str, float]]]) -> None:
        with self._lock:
            self._plan = plan
            self._gate = threading.Event()
            self._full = set()

    def let_go(self, *, end: bool = True) -> None:
        """Wake the stuck threads (later ``stuck`` draws pass at once); ``end``: no more faults."""
        with self._lock:
            if end:
                self._plan = {}
            self._gate.set()

    def decide(self, op: str, key: str) -> Fault | None:
        with self._lock:
            choice = next(
                (
                    kind
                    for kind, rate in self._plan.get(op, ())
                    if self._rng.random() < rate and not (kind == "full" and key in self._full)
                ),
                None,
            )
            if choice is None:
                return None
            if choice == "full":
                self._full.add(key)
            self.hits[(op, choice)] += 1
            gate = self._gate
            slow = self._rng.uniform(1.5, 2.5) * TIMEOUT_S
            lag = self._rng.uniform(0.1, 0.3) * TIMEOUT_S
            pos = self._rng.random()
        if choice == "stuck":
            gate.wait(10)
            return None
        if choice == "slow":
            return Fault(FaultKind.DELAY, delay_s=slow)
        if choice == "lag":
            return Fault(FaultKind.DELAY, delay_s=lag)
        if choice == "flip":
            return Fault(FaultKind.FLIP_BYTES, position=pos)
        return Fault(FaultKind.ENOSPC if choice in ("enospc", "full") else FaultKind.EIO)


def draw_plan(rng: random.Random) -> dict[str, list[tuple[str, float]]]:
    """A step's fault plan: often none, else a few kinds of fault at random rates."""
    plan: dict[str, list[tuple[str, float]]] = {}
    if rng.random() < 0.35:
        return plan

    def add(op: str, kind: str, rate: float) -> None:
        plan.setdefault(op, []).append((kind, rate))

    if rng.random() < 0.3:  # stuck threads: then calls fail fast (unavailable)
        for op in ("read", "write", "delete", "exists"):
            if rng.random() < 0.5:
                add(op, "stuck", rng.choice([0.2, 0.5]))
    if rng.random() < 0.4:
        add("delete", "slow", rng.choice([0.3, 0.7, 1.0]))
    if rng.random() < 0.4:
        add("delete", "eio", rng.choice([0.3, 0.7, 1.0]))
    if rng.random() < 0.35:
        kind = rng.choice(["eio", "flip", "flip"])
        add("read", kind, rng.choice([0.3, 1.0]))
        if kind == "flip" and rng.random() < 0.7:  # the corrupt pages' removal fails: kept
            add("delete", "eio", rng.choice([0.5, 1.0]))
    if rng.random() < 0.35:  # ENOSPC, retried after an eviction (which "full" lets through)
        add("write", rng.choice(["eio", "enospc", "full", "full"]), rng.choice([0.3, 1.0]))
    if rng.random() < 0.1:
        add("exists", "eio", 0.5)
    if rng.random() < 0.3:  # unlinks that take a while (within the deadline): calls overlap them
        add("delete", "lag", 1.0)
    return plan


# -- the driver -------------------------------------------------------------------------------


class CheckedBackend(FileBackend):
    """A FileBackend whose reservations are checked as they grow: whatever path takes them,
    the index's bytes, the reservations and other writers' temp files stay within the
    capacity then (2); a breach is noted in ``reserve_over``."""

    reserve_over: list[str]

    @property  # type: ignore[override]
    def _reserved(self) -> int:
        return self._reserved_bytes

    @_reserved.setter
    def _reserved(self, value: int) -> None:
        grew = value > getattr(self, "_reserved_bytes", 0)
        self._reserved_bytes = value
        cap = self.capacity_bytes
        if grew and cap is not None and self._index.used + value + self._dir.tmp_bytes > cap:
            self.reserve_over.append(
                f"reserved {value} bytes with {self._index.used} indexed: over capacity {cap}"
            )


@dataclass
class Call:
    id: int
    op: str
    keys: list[str]
    delay: float
    vers: dict[str, int] = field(default_factory=dict)  # set: the write of each key
    start: int = -1
    end: int = -1
    result: Any = None
    data: list[bytes] = field(default_factory=list)  # get: the buffers
    kept: set[str] = field(default_factory=set)  # get: pages kept corrupt when it began

    def __repr__(self) -> str:
        keys = [KEY_NAMES[k] for k in self.keys]
        vers = {KEY_NAMES[k]: v for k, v in self.vers.items()}
        extra = f" vers={vers}" if vers else ""
        return f"{self.op}#{self.id}{keys}{extra} [{self.start}..{self.end}] -> {self.result}"


KEYS = make_keys(N_KEYS)
KEY_NAMES = {k: f"k{i}" for i, k in enumerate(KEYS)}


class Driver:
    def __init__(self, root: Any, seed: int, segmented: bool) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        if segmented:  # segments of up to 3 pages; room for about three of them
            seg = 3 * FILE
            cap = 3 * file_bytes([PAGE] * 3, False)
        else:
            seg, cap = None, 6 * FILE
        layout = StorageLayout(model="test/model", page_size=16, kv_dtype="bfloat16")
        self.b = CheckedBackend(
            root,
            layout,
            capacity_bytes=cap,
            segment_bytes=seg,
            io_threads=3,
            max_stuck_threads=2,
            timeout_s=TIMEOUT_S,
            timeout_per_gib_s=0,
        )
        self.cap = cap
        self.over: list[str] = []  # the capacity exceeded (2)
        self.b.reserve_over = self.over
        self.root = str(root)
        self.suffix = self.b.object_name("0" * 64)[64:]
        self.chaos = Chaos(seed)
        self.b.set_fault_hook(self.chaos)
        self.clock = itertools.count()
        self.ids = itertools.count()
        self.vers = itertools.count(1)
        self.disk: dict[str, int] = {}  # key -> write on disk (at the start of a step)
        self.log: list[str] = []
        #: Index units whose bytes were counted without a reservation since the last one
        #: (which brought the index and the reservations within the capacity): put back after
        #: a failed unlink (a file still on disk) or adopted by exists. Only these may take
        #: the index past the capacity.
        self.unreserved: set[int] = set()
        # What the backend reports, in order (reset each step).
        self.accounts: list[tuple[int, int, str, list[str], list[str]]] = []
        self.removals: list[tuple[int, str, list[str]]] = []
        self.heard: list[str] = []
        self.quarantined: set[str] = set()
        self.kept: set[str] = set()  # pages kept corrupt in this step (their removal failed)
        b = self.b
        account, gone, quarantine = b._account, b._gone, b._quarantine_keys
        unlink_failed = b._unlink_failed
        index = b._index
        index_add, index_restore, reserve = index.add, index.restore, b._reserve
        ops: dict[int, str] = {}  # call id -> op
        self.ops = ops

        def spy_account(op: str, keys: Any, outcomes: Any, *rest: Any) -> list[bool]:
            t = next(self.clock)
            self.accounts.append((t, _call.get(), op, list(keys), list(outcomes)))
            try:
                return account(op, keys, outcomes, *rest)
            finally:
                self.check_capacity(f"at {t} ({op}#{_call.get()})")

        def spy_add(keys: Any, nbytes: int) -> None:
            uid = index._next  # the id the new unit gets
            index_add(keys, nbytes)
            if ops.get(_call.get()) == "exists" and uid in index._units:  # adopted
                self.unreserved.add(uid)

        def spy_reserve(size: int, protect: set[str]) -> bool:
            ok = reserve(size, protect)
            if ok:  # within the capacity now, whatever was put back before
                self.unreserved.clear()
            self.check_capacity(f"reserving {size} bytes")
            return ok

        def spy_restore(keys: Any, nbytes: int, uid: int | None = None) -> int | None:
            existed = uid is not None and uid in index._units
            out = index_restore(keys, nbytes, uid)
            if out is not None and not existed:  # a unit made again: its bytes counted again
                self.unreserved.add(out)
            return out

        def spy_gone(keys: Any, cause: str) -> None:
            if keys:
                self.removals.append((next(self.clock), cause, list(keys)))
            gone(keys, cause)

        def spy_quarantine(keys: list[str]) -> Any:
            self.quarantined.update(keys)
            return quarantine(keys)

        def spy_unlink_failed(op: str, cause: str, result: Any, kept_bytes: int) -> None:
            if op == "remove_corrupt":
                self.kept.update(k for k, (o, _d) in result.items() if o not in ("ok", "miss"))
            unlink_failed(op, cause, result, kept_bytes)

        b._account = spy_account  # type: ignore[method-assign]
        b._unlink_failed = spy_unlink_failed  # type: ignore[method-assign]
        index.add = spy_add  # type: ignore[method-assign]
        index.restore = spy_restore  # type: ignore[method-assign]
        b._reserve = spy_reserve  # type: ignore[method-assign]
        b._gone = spy_gone  # type: ignore[method-assign]
        b._quarantine_keys = spy_quarantine  # type: ignore[method-assign]
        b.add_eviction_listener(self.heard.extend)

    def check_capacity(self, when: str) -> None:
        """(2): the index's bytes and the reservations stay within the capacity, but for the
        units counted without a reservation (``unreserved``) still indexed."""
        b = self.b
        units = b._index._units
        self.unreserved &= set(units)
        extra = sum(units[u].nbytes for u in self.unreserved)
        used, reserved = b._index.used, b._reserved
        if used + reserved > self.cap + extra:
            self.over.append(
                f"{when}: used {used} + reserved {reserved} > capacity {self.cap} + "
                f"{extra} bytes put back after failed unlinks or adopted"
            )

    def fail(self, msg: str) -> None:
        tail = "\n".join(self.log[-40:])
        pytest.fail(f"seed {self.seed}: {msg}\n--- last steps ---\n{tail}", pytrace=False)

    def check(self, cond: bool, msg: str) -> None:
        if not cond:
            self.fail(msg)

    # -- one step ---------------------------------------------------------------------------

    def draw_calls(self) -> list[Call]:
        rng = self.rng
        calls = []
        for _ in range(rng.randint(1, 5)):
            r = rng.random()
            op = next(op for op, upto in OP_MIX if r < upto)
            n = rng.randint(1, 4 if op in ("set", "get") else 3)
            keys = [] if op == "clear" else rng.sample(KEYS, n)
            if op in ("set", "get") and rng.random() < 0.1:
                keys.append(keys[0])  # a key twice in one batch
            delay = rng.choice([0.0, 0.0, 0.0, 0.002, 0.01, 0.05, 0.12])  # (also after deadlines)
            calls.append(Call(next(self.ids), op, keys, delay))
            if op == "set":
                calls[-1].vers = {k: next(self.vers) for k in dict.fromkeys(keys)}
        return calls

    async def run_call(self, c: Call) -> None:
        if c.delay:
            await anyio.sleep(c.delay)
        _call.set(c.id)
        self.ops[c.id] = c.op
        b = self.b
        c.start = next(self.clock)
        if c.op == "set":
            c.result = await b.set_batch(c.keys, [payload(k, c.vers[k]) for k in c.keys])
        elif c.op == "get":
            bufs = [bytearray(PAGE) for _ in c.keys]
            c.kept = set(b._kept_corrupt)  # (get_batch plans its reads before any await)
            c.result = await b.get_batch(c.keys, bufs)
            c.data = [bytes(x) for x in bufs]
        elif c.op == "exists":
            c.result = await b.exists_prefix(c.keys)
        elif c.op == "delete":
            c.result = await b.delete(c.keys)
        else:
            c.result = await b.clear()
        c.end = next(self.clock)

    async def step(self, n: int) -> None:
        b = self.b
        plan = draw_plan(self.rng)
        calls = self.draw_calls()
        self.accounts.clear()
        self.removals.clear()
        self.heard.clear()
        self.quarantined.clear()
        self.kept = set(b._kept_corrupt)
        self.over.clear()
        self.log.append(f"step {n}: disk={self.named(self.disk)} plan={plan}")
        self.chaos.set_plan(plan)

        async def let_go_later() -> None:  # long after the calls' deadlines (clear has 60 s)
            await anyio.sleep(6 * TIMEOUT_S)
            self.chaos.let_go(end=False)

        try:
            with anyio.fail_after(20):
                async with anyio.create_task_group() as outer:
                    outer.start_soon(let_go_later)
                    async with anyio.create_task_group() as tg:
                        for c in calls:
                            tg.start_soon(self.run_call, c)
                    outer.cancel_scope.cancel()
        finally:
            self.chaos.let_go()
        for c in calls:
            self.log.append(f"  {c!r}")
        await self.quiesce()
        self.log.append(
            f"  removals={[(t, cause, self.names(ks)) for t, cause, ks in self.removals]}"
        )
        self.log.append(
            "  accounts="
            + str([(t, cid, op, self.names(ks), o) for t, cid, op, ks, o in self.accounts])
        )
        disk = self.check_directory()
        self.log.append(f"  -> disk={self.named(disk)} used={b.stats()['used_bytes']}")
        self.check_history(calls, disk)
        self.check_capacity("quiescent")
        if self.over:
            self.fail(f"step {n}: {self.over[0]}")
        quiet = self.rng.random() < 0.3
        if quiet or b._kept_corrupt:  # (pages kept corrupt are rare: check them at once)
            disk = await self.verify_reads(disk)
        self.disk = disk

    def named(self, disk: dict[str, int]) -> dict[str, int]:
        return {KEY_NAMES[k]: v for k, v in sorted(disk.items(), key=lambda kv: KEY_NAMES[kv[0]])}

    def names(self, keys: list[str]) -> list[str]:
        return [KEY_NAMES.get(k, k[:8]) for k in keys]

    async def quiesce(self) -> None:
        b = self.b
        for _ in range(2000):
            if (
                not b._busy
                and b._runner.stuck == 0
                and b._reserved == 0
                and len(b._quarantine) == 0
            ):
                break
            await anyio.sleep(0.005)
        else:
            self.fail(
                f"not quiescent: busy={self.names(list(b._busy))} stuck={b._runner.stuck} "
                f"reserved={b._reserved} quarantined={len(b._quarantine)}"
            )
        await anyio.sleep(0)  # callbacks from the last thread run

    # -- invariants -------------------------------------------------------------------------

    def check_directory(self) -> dict[str, int]:
        """(1): the index agrees with the directory; returns key -> write on disk."""
        b = self.b
        disk: dict[str, int] = {}
        inode_of: dict[str, tuple[int, int]] = {}
        temps: list[str] = []
        for sub in sorted(os.listdir(self.root)):
            path = os.path.join(self.root, sub)
            if len(sub) != 2 or not os.path.isdir(path):
                continue
            for name in os.listdir(path):
                full = os.path.join(path, name)
                if name.startswith("."):
                    temps.append(name)
                    continue
                if not name.endswith(self.suffix):
                    continue
                key = name[: -len(self.suffix)]
                st = os.stat(full)
                inode_of[key] = (st.st_ino, st.st_size)
                with open(full, "rb") as f:
                    ver = version_in(f.read(), key)
                self.check(ver is not None, f"{KEY_NAMES.get(key, key)}: no page of it in its file")
                assert ver is not None
                disk[key] = ver
        self.check(not temps, f"temp files left when quiescent: {temps}")
        for k, ino in b._kept_corrupt.items():
            self.check(
                inode_of.get(k, (None, 0))[0] == ino,
                f"{KEY_NAMES.get(k, k)} kept corrupt, but its file is gone or another one",
            )
        st = b.stats()
        self.check(st["temp_bytes"] == 0, f"temp bytes counted when quiescent: {st['temp_bytes']}")
        indexed = set(b._index.keys())
        self.check(
            indexed == set(disk),
            f"index {sorted(self.names(list(indexed)))} != disk {sorted(self.names(list(disk)))}",
        )
        units = b._index._units
        seen: dict[int, int] = {}
        total = 0
        for uid, unit in units.items():
            inodes = {inode_of[k] for k in unit.keys if k in inode_of}
            self.check(
                len(inodes) == 1,
                f"unit {uid} {self.names(unit.keys)}: files {inodes} on disk, not one",
            )
            ((ino, size),) = inodes
            self.check(
                size == unit.nbytes,
                f"unit {uid} {self.names(unit.keys)}: {unit.nbytes} bytes indexed, {size} on disk",
            )
            self.check(
                ino not in seen,
                f"unit {uid} {self.names(unit.keys)} and unit {seen.get(ino)} are one file",
            )
            seen[ino] = uid
            total += unit.nbytes
        on_disk = sum({ino: size for ino, size in inode_of.values()}.values())
        self.check(
            (st["used_bytes"], st["objects"], st["files"]) == (on_disk, len(disk), len(seen))
            and total == on_disk,
            f"used/objects/files {st['used_bytes']}/{st['objects']}/{st['files']} != "
            f"{on_disk}/{len(disk)}/{len(seen)} on disk (units sum {total})",
        )
        return disk

    def check_history(self, calls: list[Call], disk: dict[str, int]) -> None:
        """(3), (4), (5): replay each key's stores and removals in order."""
        self.check(
            self.heard == [k for _t, _c, ks in self.removals for k in ks],
            "listeners heard other keys than the backend removed",
        )
        by_id = {c.id: c for c in calls}
        events: dict[str, list[tuple[int, str, Any]]] = {k: [] for k in KEYS}
        for t, cid, op, keys, outs in self.accounts:
            if op != "set":
                continue
            for k, o in zip(keys, outs, strict=True):
                if o == "ok":
                    events[k].append((t, "store", by_id[cid].vers[k]))
        for t, cause, keys in self.removals:
            for k in keys:
                events[k].append((t, "removed", cause))
        # write -> (alive from, alive until): from its set's start (or before this step)
        # until it was replaced or told removed.
        life: dict[tuple[str, int], list[float]] = {}
        set_start = {(k, v): c.start for c in calls if c.op == "set" for k, v in c.vers.items()}
        for k in KEYS:
            cur = self.disk.get(k)
            if cur is not None:
                life[(k, cur)] = [-1, float("inf")]
            for t, what, arg in sorted(events[k], key=lambda e: e[0]):
                if what == "store":
                    if cur is not None:  # only a quarantined page or one kept corrupt
                        self.check(  # is written again in place
                            k in self.quarantined or k in self.kept,
                            f"{KEY_NAMES[k]}: write {arg} stored at {t} over write {cur}, "
                            "never told removed",
                        )
                        life[(k, cur)][1] = t
                    cur = arg
                    life[(k, cur)] = [set_start[(k, cur)], float("inf")]
                else:
                    self.check(
                        cur is not None,
                        f"{KEY_NAMES[k]}: told removed ({arg}) at {t} but not stored then",
                    )
                    assert cur is not None
                    life[(k, cur)][1] = t
                    cur = None
            self.check(
                disk.get(k) == cur,
                f"{KEY_NAMES[k]}: on disk {disk.get(k)}, but stores and removals told say {cur}",
            )
        for c in calls:
            if c.op == "get":
                for k, hit, data in zip(c.keys, c.result, c.data, strict=True):
                    if not hit:
                        continue
                    self.check(
                        k not in c.kept, f"get#{c.id}: {KEY_NAMES[k]} served, kept corrupt"
                    )
                    ver = version_in(data, k)
                    self.check(ver is not None, f"get#{c.id}: {KEY_NAMES[k]} read other bytes")
                    span = life.get((k, ver))  # type: ignore[arg-type]
                    self.check(
                        span is not None,
                        f"get#{c.id}: {KEY_NAMES[k]} read write {ver}, never stored",
                    )
                    assert span is not None
                    self.check(
                        span[0] < c.end and span[1] > c.start,
                        f"get#{c.id} [{c.start}..{c.end}]: {KEY_NAMES[k]} read write {ver}, "
                        f"alive only {span}",
                    )
            elif c.op in ("delete", "clear"):
                told = sum(
                    1
                    for t, cause, keys in self.removals
                    if cause == c.op and c.start < t < c.end
                    for k in keys
                    if c.op == "clear" or k in c.keys
                )
                self.check(
                    c.result <= told,
                    f"{c.op}#{c.id} says it removed {c.result}, told {told} removed",
                )
            elif c.op == "exists":
                self.check(0 <= c.result <= len(c.keys), f"exists#{c.id}: {c.result}")

    async def verify_reads(self, disk: dict[str, int]) -> dict[str, int]:
        """Quiet reads (no faults, a generous deadline): exactly what is on disk, except pages
        kept corrupt (a read found them bad, their removal failed): never there for exists,
        misses for a read, which removes them. Returns what is on disk after."""
        b = self.b
        kept = set(b._kept_corrupt)
        b.timeout_s = 5.0
        try:
            for k in KEYS:
                there = k in disk and k not in kept
                self.check(
                    await b.exists_prefix([k]) == there,
                    f"quiet exists of {KEY_NAMES[k]} != on disk and not kept corrupt ({there})",
                )
            keys = list(dict.fromkeys([*sorted(kept), *self.rng.sample(KEYS, 6)]))
            bufs = [bytearray(PAGE) for _ in keys]
            got = await b.get_batch(keys, bufs)
        finally:
            b.timeout_s = TIMEOUT_S
        for k, hit, buf in zip(keys, got, bufs, strict=True):
            want = disk.get(k) if k not in kept else None
            self.check(hit == (want is not None), f"quiet get of {KEY_NAMES[k]}: {hit}")
            if want is not None:
                self.check(bytes(buf) == payload(k, want), f"quiet get of {KEY_NAMES[k]}: bytes")
        after = self.check_directory()
        removed = kept & set(keys)
        self.check(
            not removed & set(after) and not removed & set(b._kept_corrupt),
            f"quiet reads did not remove the pages kept corrupt {self.names(sorted(removed))}",
        )
        self.log.append(f"  quiet reads of {self.names(keys)} ok")
        return after


async def drive(root: Any, seed: int, segmented: bool, steps: int) -> Driver:
    d = Driver(root, seed, segmented)
    await d.b.start()
    for n in range(steps):
        await d.step(n)
    await d.b.aclose()
    # A restart rebuilds the same index from the directory.
    again = FileBackend(d.root, d.b.layout, segment_bytes=d.b.segment_bytes)
    await again.start()
    st, old = again.stats(), d.b.stats()
    d.check(
        (st["used_bytes"], st["objects"], st["files"])
        == (old["used_bytes"], old["objects"], old["files"]),
        f"after a restart {st['used_bytes']}/{st['objects']}/{st['files']} != "
        f"{old['used_bytes']}/{old['objects']}/{old['files']}",
    )
    await again.aclose()
    return d


@pytest.mark.parametrize("segmented", [False, True], ids=["pages", "segments"])
@pytest.mark.parametrize("seed", range(SEEDS))
async def test_file_backend_agrees_with_its_directory_under_concurrent_faults(
    tmp_path, seed, segmented
) -> None:
    d = await drive(tmp_path, seed, segmented, STEPS)
    assert d.chaos.hits  # the faults did strike


@pytest.mark.slow
@pytest.mark.parametrize("segmented", [False, True], ids=["pages", "segments"])
@pytest.mark.parametrize("seed", range(100, 106))
async def test_file_backend_model_more_seeds(tmp_path, seed, segmented) -> None:
    await drive(tmp_path, seed, segmented, 50)
