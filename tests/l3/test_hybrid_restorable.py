"""Hybrid (SWA / Mamba) prefetch restores the longest restorable prefix (asynccache/l3/hybrid.py).

A writer cache stores one conversation of 600 tokens (150 pages of 4) inserted in two turns, so
storage holds a Mamba state at the end of each turn (tokens 300 and 600) and the SWA pages of
both nodes. A fresh cache on the same storage then prefetches the conversation while parts of
it are missing, corrupt, slow or short of host memory, and must restore exactly the deepest
prefix every pool can restore — bit for bit (KV, the SWA window, the state) — or nothing, with
every host slot of every pool accounted for. File backend and a real SeaweedFS S3 server.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from asynccache.l3 import StoragePolicy
from asynccache.storage.faults import FaultInjectingBackend, FaultKind, FaultRule

N = 600  # 150 pages: two read batches (128 + 22)
T1 = 300  # the first turn ends here (75 pages)
WINDOW = 8  # sliding window: 2 pages
MAMBA = {"mamba_states": 4, "mamba_state_shape": (4, 3)}
SWA = {"sliding_window": WINDOW, "swa_tokens": 1024}
COMBOS = {"full+swa": SWA, "full+mamba": MAMBA, "full+swa+mamba": {**SWA, **MAMBA}}
WITH_MAMBA = ["full+mamba", "full+swa+mamba"]
POLICY = StoragePolicy(prefetch_threshold=16, prefetch_policy="wait_complete")
FALLBACK = "asynccache_prefetch_component_fallback_tokens"
BACKENDS = ["file", pytest.param("seaweedfs", marks=pytest.mark.seaweedfs)]


@pytest.fixture(params=BACKENDS)
def open_backend(request: Any, kit: Any, make_file_backend: Any, make_s3_backend: Any) -> Any:
    """``open_backend(cache, rules=None)``: a backend on this test's storage (every call opens
    a new instance on the same storage), wrapped in the fault injector when ``rules`` is given."""
    if request.param == "file":
        return make_file_backend
    seaweed = request.getfixturevalue("seaweed")
    prefix = kit.new_prefix()

    async def make(cache: Any, rules: Any = None) -> Any:
        backend = make_s3_backend(seaweed, cache, prefix)
        return backend if rules is None else FaultInjectingBackend(backend, rules)

    return make


def _randomize(cache: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    hy = cache.hybrid
    for t in (cache.device_pool.kv, *([hy.swa_pool.kv] if hy.swa_pool is not None else []),
              *([hy.mamba_pool.states] if hy.mamba_pool is not None else [])):
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def _snapshot(cache: Any, slots: Any, state: int | None) -> dict[str, torch.Tensor]:
    """What a cache holding ``slots`` (a prefix) and ``state`` must serve for it."""
    hy = cache.hybrid
    out = {"full": cache.device_pool.read_slots(slots).clone()}
    if hy.swa_map is not None:  # the last window is what a match needs (and storage keeps)
        out["swa"] = hy.swa_pool.read_slots(hy.swa_map.translate(slots[len(slots) - WINDOW :]))
    if state is not None:
        out["mamba"] = hy.mamba_pool.states[state].clone()
    return out


async def _store(kit: Any, make_cache: Any, open_backend: Any, combo: str,
                 points: tuple[int, ...] = (),
                 ) -> tuple[list[int], dict[int, dict[str, torch.Tensor]]]:
    """Write the two-turn conversation; returns its tokens and what each turn (and each prefix
    length in ``points``, without a state) must serve."""
    toks = [int(t) for t in kit.tokens(5, N)]
    a = await make_cache(**COMBOS[combo])
    a.attach_storage(await open_backend(a), POLICY)
    _randomize(a, 3)
    hy = a.hybrid
    slots = a.try_alloc_device(N)
    want: dict[int, dict[str, torch.Tensor]] = {}
    for p in points:
        want[p] = _snapshot(a, slots[:p], None)
    s1 = a.alloc_mamba_state() if hy.mamba_pool is not None else None
    want[T1] = _snapshot(a, slots[:T1], s1)
    a.insert(toks[:T1], slots[:T1], mamba_value=s1)
    await a.flush()
    s2 = a.alloc_mamba_state() if hy.mamba_pool is not None else None
    want[N] = _snapshot(a, slots, s2)
    a.insert(toks, slots, prev_prefix_len=T1, mamba_value=s2)
    await a.flush()
    await a.storage.drain()
    await a.detach_storage()
    await a.aclose()
    return toks, want


def _served(cache: Any, toks: list[int], slots: Any) -> dict[str, torch.Tensor]:
    hy = cache.hybrid
    p = len(slots)
    out = {"full": cache.device_pool.read_slots(slots)}
    if hy.swa_map is not None:
        out["swa"] = hy.swa_pool.read_slots(hy.swa_map.translate(slots[p - WINDOW :]))
    if hy.mamba_pool is not None:
        m = cache.match_prefix(toks, cow_mamba=True)
        assert m.device_prefix_len == p
        out["mamba"] = hy.mamba_pool.states[m.mamba_cow_slot].clone()
    return out


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), name


def _balanced(kit: Any, cache: Any, own_receipts: int = 0) -> None:
    """Nothing in flight in any pool (KV, SWA, Mamba) and the accounting balances."""
    kit.assert_at_rest(cache, own_receipts=own_receipts)
    assert all(v == 0 for v in cache.hybrid.tier.inflight.values()), cache.hybrid.tier.inflight


async def _serve(kit: Any, cache: Any, toks: list[int], want: dict[int, Any], expect: int,
                 policy: str | None = None) -> None:
    """Prefetch ``toks`` into a fresh request: exactly ``expect`` tokens come, bit for bit."""
    req = cache.admit([*toks, 1])
    assert (req.prefix_len, req.host_hit_length) == (0, 0)
    got = await asyncio.wait_for(cache.prefetch_request(req, policy=policy), kit.TIMEOUT)
    assert got == expect
    _balanced(kit, cache, own_receipts=(req.receipt is not None) + (req.host_receipt is not None))
    if expect:
        assert await asyncio.wait_for(cache.load_back_request(req), kit.TIMEOUT) == expect
        cache.sanity_check()
        _assert_same(_served(cache, toks, req.slots[:expect]), want[expect])
    else:
        assert cache.match_prefix(toks).host_hit_length == 0
    cache.abort_req(req)
    await kit.quiesce(cache)
    _balanced(kit, cache)


def _fallbacks(kit: Any, cache: Any) -> dict[str, int]:
    out = {}
    for reason in ("not_stored", "host_memory", "stopped", "fault"):
        v = int(kit.counter(cache, FALLBACK, reason=reason))
        if v:
            out[reason] = v
    return out


def _objects_read(backend: Any) -> int:
    """Objects (KV pages and component objects) the backend read and verified so far."""
    return int(backend.stats()["pages"].get("get.hit", 0))


# -- a missing state ---------------------------------------------------------------------------


async def _missing_last_state(kit: Any, make_cache: Any, open_backend: Any, combo: str) -> None:
    toks, want = await _store(kit, make_cache, open_backend, combo)
    keys = kit.page_keys(toks)
    b = await make_cache(**COMBOS[combo])
    backend = await open_backend(b)
    assert await backend.delete([f"{keys[-1]}.mamba"]) == 1
    b.attach_storage(backend, POLICY)
    before = _objects_read(backend)
    await _serve(kit, b, toks, want, T1)
    # Only the restorable prefix was read: 75 KV pages, its window's SWA pages, one state.
    extra = (WINDOW // kit.PS if b.hybrid.swa_map is not None else 0) + 1
    assert _objects_read(backend) - before == T1 // kit.PS + extra
    assert _fallbacks(kit, b) == {"not_stored": N - T1}
    assert kit.counter(b, "asynccache_storage_prefetch_hit_tokens") == T1
    assert kit.outcomes(b) == {"issued": 1, "completed": 1}


@pytest.mark.parametrize("combo", WITH_MAMBA)
async def test_missing_last_state_restores_the_first_turn(kit, make_cache, open_backend,
                                                          combo) -> None:
    await _missing_last_state(kit, make_cache, open_backend, combo)


async def test_restorable_prefix_below_the_threshold_is_revoked_unread(
        kit, make_cache, make_file_backend) -> None:
    """Threshold 320 tokens, last state missing: the restorable 300 tokens are a short hit."""
    toks, _ = await _store(kit, make_cache, make_file_backend, "full+swa+mamba")
    keys = kit.page_keys(toks)
    b = await make_cache(**COMBOS["full+swa+mamba"])
    backend = await make_file_backend(b)
    assert await backend.delete([f"{keys[-1]}.mamba"]) == 1
    b.attach_storage(backend, StoragePolicy(prefetch_threshold=320))
    before = _objects_read(backend)
    await _serve(kit, b, toks, {}, 0, policy="wait_complete")
    assert _objects_read(backend) == before  # nothing read
    assert kit.outcomes(b) == {"issued": 1, "revoked_insufficient": 1}
    assert _fallbacks(kit, b) == {"not_stored": N}
    assert kit.counter(b, "asynccache_storage_prefetch_hit_tokens") == 0


@pytest.mark.parametrize("combo", sorted(COMBOS))
async def test_intact_store_restores_everything(kit, make_cache, make_file_backend,
                                                combo) -> None:
    toks, want = await _store(kit, make_cache, make_file_backend, combo)
    b = await make_cache(**COMBOS[combo])
    b.attach_storage(await make_file_backend(b), POLICY)
    await _serve(kit, b, toks, want, N)
    assert _fallbacks(kit, b) == {}


# -- a prefetch stopped early ----------------------------------------------------------------------


async def _until(cond: Any, what: str) -> None:
    async def wait() -> None:
        while not cond():
            await asyncio.sleep(0.001)

    try:
        await asyncio.wait_for(wait(), 10.0)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def _load(kit: Any, cache: Any, toks: list[int], want: dict[int, Any], expect: int) -> None:
    """A request finds exactly ``expect`` tokens on host and serves them bit for bit."""
    req = cache.admit([*toks, 1])
    assert (req.prefix_len, req.host_hit_length) == (0, expect)
    assert await asyncio.wait_for(cache.load_back_request(req), kit.TIMEOUT) == expect
    cache.sanity_check()
    _assert_same(_served(cache, toks, req.slots[:expect]), want[expect])
    cache.abort_req(req)
    await kit.quiesce(cache)
    _balanced(kit, cache)


@pytest.mark.parametrize("policy", ["best_effort", "timeout"])
@pytest.mark.parametrize(("combo", "expect"), [("full+mamba", T1), ("full+swa+mamba", T1),
                                               ("full+swa", 512)])
async def test_stop_midway_restores_the_deepest_state_that_arrived(
        kit, make_cache, open_backend, combo, expect, policy) -> None:
    """Batch 2 (pages 128..149) is stuck on a slow page (0.5 s) when the prefetch is stopped
    (best_effort; or a timeout of 0.05 s from its start): of the 128 pages that arrived, the
    deepest restorable prefix is the first turn (its state); without Mamba every arrived page
    is restorable (all SWA pages are stored)."""
    toks, want = await _store(kit, make_cache, open_backend, combo, points=(512,))
    keys = kit.page_keys(toks)
    c = await make_cache(**COMBOS[combo])
    slow = await open_backend(c, [FaultRule(
        FaultKind.DELAY, ops=frozenset({"read"}), keys=frozenset({keys[128]}), times=1,
        delay_s=0.5)])
    c.attach_storage(slow, StoragePolicy(prefetch_threshold=16, timeout_base_s=0.05,
                                         timeout_per_ki_token_s=0.0))
    op = c.start_prefetch(toks, c.match_prefix(toks))
    assert op is not None
    await _until(lambda: op.completed_tokens == 512 and slow.injected_total() == 1,
                 "batch 2 to start")
    got = await asyncio.wait_for(c.storage.finish_prefetch(op, policy), kit.TIMEOUT)
    assert got == expect
    assert kit.outcomes(c) == {"issued": 1, "partial": 1}
    assert _fallbacks(kit, c) == ({"stopped": 512 - expect} if expect < 512 else {})
    _balanced(kit, c)
    await _load(kit, c, toks, want, expect)


async def test_best_effort_stop_before_any_state_arrived_inserts_nothing(
        kit, make_cache, make_file_backend) -> None:
    """With a threshold above the first turn, the 128 arrived pages hold no usable state."""
    toks, _ = await _store(kit, make_cache, make_file_backend, "full+swa+mamba")
    keys = kit.page_keys(toks)
    c = await make_cache(**COMBOS["full+swa+mamba"])
    slow = await make_file_backend(c, [FaultRule(
        FaultKind.DELAY, ops=frozenset({"read"}), keys=frozenset({keys[128]}), times=1,
        delay_s=0.5)])
    c.attach_storage(slow, StoragePolicy(prefetch_threshold=320))
    op = c.start_prefetch(toks, c.match_prefix(toks))
    assert op is not None
    await _until(lambda: op.completed_tokens == 512 and slow.injected_total() == 1,
                 "batch 2 to start")
    assert await asyncio.wait_for(c.storage.finish_prefetch(op), kit.TIMEOUT) == 0
    assert _fallbacks(kit, c) == {"stopped": 512}
    assert c.match_prefix(toks).host_hit_length == 0
    _balanced(kit, c)


# -- SWA pages missing -------------------------------------------------------------------------


@pytest.mark.parametrize(("deleted", "expect"), [((148,), 592), ((147, 149), 588), ((), N)])
async def test_swa_page_missing_falls_back_to_the_prefix_whose_window_is_intact(
        kit, make_cache, open_backend, deleted, expect) -> None:
    """SWA only, window of 2 pages. Page 148's SWA missing: the 148-page prefix (window 146,
    147) is restorable. Pages 147 and 149 missing: 149 pages would need 147 and 148, so the
    147-page prefix (window 145, 146) is the longest."""
    toks, want = await _store(kit, make_cache, open_backend, "full+swa", points=(592, 588))
    keys = kit.page_keys(toks)
    b = await make_cache(**COMBOS["full+swa"])
    backend = await open_backend(b)
    if deleted:
        assert await backend.delete([f"{keys[i]}.swa" for i in deleted]) == len(deleted)
    b.attach_storage(backend, POLICY)
    await _serve(kit, b, toks, want, expect)
    assert _fallbacks(kit, b) == ({"not_stored": N - expect} if expect < N else {})


# -- faults on component objects ---------------------------------------------------------------


FAULTS = {  # rule kind and the pages whose component object it hits
    "eio_state": (FaultKind.EIO, ".mamba", (149,)),
    "flip_state_read": (FaultKind.FLIP_BYTES, ".mamba", (149,)),
    "flip_swa_read": (FaultKind.FLIP_BYTES, ".swa", (149,)),
    "both_states_unreadable": (FaultKind.EIO, ".mamba", (74, 149)),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
async def test_component_fault_degrades_to_a_shorter_prefix_or_a_miss(
        kit, make_cache, open_backend, fault) -> None:
    """The objects exist (the query finds them) but cannot be read: the prefix they would
    restore is given up for the next restorable one, never served wrong."""
    toks, want = await _store(kit, make_cache, open_backend, "full+swa+mamba")
    keys = kit.page_keys(toks)
    kind, suffix, pages = FAULTS[fault]
    b = await make_cache(**COMBOS["full+swa+mamba"])
    backend = await open_backend(b, [FaultRule(kind, ops=frozenset({"read"}),
                                               keys=frozenset(f"{keys[i]}{suffix}" for i in pages))])
    b.attach_storage(backend, POLICY)
    expect = 0 if len(pages) == 2 else T1
    await _serve(kit, b, toks, want, expect)
    assert _fallbacks(kit, b) == {"fault": N - expect}
    assert kit.counter(b, "asynccache_storage_prefetch_hit_tokens") == N
    assert kit.counter(b, "asynccache_prefetched_tokens") == expect
    assert backend.injected_total() == len(pages)


@pytest.mark.parametrize("pages", [(149,), (74, 149)])
async def test_state_corrupt_at_rest_degrades(kit, make_cache, make_file_backend, pages) -> None:
    """A state object whose bytes changed on disk fails its checksum: a shorter prefix or a
    miss."""
    toks, want = await _store(kit, make_cache, make_file_backend, "full+mamba")
    keys = kit.page_keys(toks)
    b = await make_cache(**COMBOS["full+mamba"])
    backend = await make_file_backend(b)
    for i in pages:
        path = kit.object_path(backend, f"{keys[i]}.mamba")
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        path.write_bytes(bytes(raw))
    b.attach_storage(backend, POLICY)
    expect = 0 if len(pages) == 2 else T1
    await _serve(kit, b, toks, want, expect)
    assert _fallbacks(kit, b) == {"fault": N - expect}


# -- host memory -------------------------------------------------------------------------------


@pytest.mark.parametrize("combo", WITH_MAMBA)
async def test_host_memory_shortfall_reads_only_the_restorable_prefix(
        kit, make_cache, open_backend, combo) -> None:
    """A reader whose host pool holds 512 tokens: room for 128 of the 150 pages, of which the
    first turn is the deepest restorable prefix; only its 75 KV pages are read."""
    toks, want = await _store(kit, make_cache, open_backend, combo)
    b = await make_cache(**COMBOS[combo], host_tokens=512)
    backend = await open_backend(b)
    b.attach_storage(backend, POLICY)
    before = _objects_read(backend)
    await _serve(kit, b, toks, want, T1)
    extra = (WINDOW // kit.PS if b.hybrid.swa_map is not None else 0) + 1
    assert _objects_read(backend) - before == T1 // kit.PS + extra
    assert _fallbacks(kit, b) == {"host_memory": N - T1}


# -- cancellation --------------------------------------------------------------------------------


async def _reset(kit: Any, c: Any) -> None:
    """Drop every copy on device and host (once the threads of abandoned reads are done: while
    they run the file backend fails new calls fast, by design)."""
    await _until(lambda: not c.storage.backend.stats()["stuck_threads"], "abandoned reads")
    await c.flush()
    c.evict(10**6)
    c.evict_host(10**6)
    assert c.host_size == 0 and c.tree.device_size == 0
    _balanced(kit, c)


def _own(req: Any) -> int:
    return (req.receipt is not None) + (req.host_receipt is not None)


async def test_cancel_prefetch_request_at_every_await_leaks_nothing(
        kit, make_cache, make_file_backend) -> None:
    """The last state is missing (the query searches for the first turn's), the first turn is
    read in one batch with its components: cancelled after k loop turns, for every k until
    the prefetch completes, nothing is inserted and no slot of any pool is held."""
    toks, want = await _store(kit, make_cache, make_file_backend, "full+swa+mamba")
    keys = kit.page_keys(toks)
    c = await make_cache(**COMBOS["full+swa+mamba"])
    backend = await make_file_backend(c)
    assert await backend.delete([f"{keys[-1]}.mamba"]) == 1
    c.attach_storage(backend, POLICY)
    cancelled = 0
    for k in range(10_000):
        req = c.admit([*toks, 1])
        task = asyncio.ensure_future(c.prefetch_request(req, policy="wait_complete"))
        for _ in range(k):
            if task.done():
                break
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.wait({task}, timeout=kit.TIMEOUT)
        assert task.done()
        if task.cancelled():
            cancelled += 1
            assert req.host_hit_length == 0 and c.host_size == 0
        else:
            assert task.result() == T1
        _balanced(kit, c, own_receipts=_own(req))
        c.abort_req(req)
        _balanced(kit, c)
        await _reset(kit, c)
        if not task.cancelled():
            break
    else:
        raise AssertionError("the prefetch never completed")
    assert cancelled > 3
    await _serve(kit, c, toks, want, T1)


async def test_cancel_a_best_effort_stop_while_it_fetches_components(
        kit, make_cache, make_file_backend) -> None:
    """best_effort stops the prefetch while the first turn's state read (between the two KV
    batches) is slow, so the stop fetches the components itself; cancelled after k loop turns
    for every k: nothing held, and whatever was inserted is a restorable prefix."""
    toks, want = await _store(kit, make_cache, make_file_backend, "full+mamba")
    keys = kit.page_keys(toks)
    c = await make_cache(**COMBOS["full+mamba"])
    backend = await make_file_backend(c, [])
    c.attach_storage(backend, POLICY)
    state = f"{keys[T1 // kit.PS - 1]}.mamba"
    for k in range(10_000):
        backend.add_rule(FaultRule(FaultKind.DELAY, ops=frozenset({"read"}),
                                   keys=frozenset({state}), times=1, delay_s=0.2))
        seen = backend.injected_total()
        op = c.start_prefetch(toks, c.match_prefix(toks))
        assert op is not None
        await _until(lambda o=op, s=seen: o.completed_tokens == 512
                     and backend.injected_total() > s, "the slow state read")
        task = asyncio.ensure_future(c.storage.finish_prefetch(op, "best_effort"))
        for _ in range(k):
            if task.done():
                break
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.wait({task}, timeout=kit.TIMEOUT)
        assert task.done()
        if not op.finished:  # cancelled before it began: the op is still the caller's
            assert k == 0
            await c.storage.abort_prefetch(op)
        _balanced(kit, c)
        if not task.cancelled():  # the stop fetched the first turn's state itself
            assert task.result() == T1
            await _load(kit, c, toks, want, T1)
            await _reset(kit, c)
            break
        assert c.host_size in (0, T1)  # a cancelled stop inserts nothing or a whole turn
        await _reset(kit, c)
    else:
        raise AssertionError("the stop never completed")
    assert k > 0
    await _serve(kit, c, toks, want, N)


# -- random deletions against an oracle ----------------------------------------------------------


def _oracle(swa: list[bool] | None, mamba: list[bool] | None, floor: int) -> int:
    """The longest restorable prefix (pages) by definition, or 0 below ``floor`` pages."""
    w = WINDOW // 4
    for p in range(len(swa or mamba or []), floor - 1, -1):
        if mamba is not None and not mamba[p - 1]:
            continue
        if swa is not None and not all(swa[max(0, p - w) : p]):
            continue
        return p
    return 0


@pytest.mark.parametrize("combo", ["full+swa", "full+swa+mamba"])
@pytest.mark.parametrize("seed", range(6))
async def test_random_missing_components_restore_the_oracle_prefix(
        kit, make_cache, make_file_backend, tmp_path, combo, seed) -> None:
    """Random component objects deleted (SWA pages mostly near the turn ends, sometimes a
    state): the prefetch restores exactly the prefix the definition gives, bit for bit."""
    import random

    rng = random.Random(seed)
    root = tmp_path / f"store-{combo}-{seed}"

    async def opener(cache: Any) -> Any:
        return await make_file_backend(cache, root=root)

    mamba = "mamba" in combo
    toks, want = await _store(kit, make_cache, opener, combo,
                              points=() if mamba else tuple(range(4, N + 1, 4)))
    keys = kit.page_keys(toks)
    pages = N // kit.PS
    swa_ok = [True] * pages
    for _ in range(rng.randint(1, 6)):
        swa_ok[rng.choice([*range(70, 76), *range(140, 150), rng.randrange(pages)])] = False
    state_ok = [i in (T1 // kit.PS - 1, pages - 1) for i in range(pages)]
    if mamba and rng.random() < 0.5:
        state_ok[pages - 1] = False
    b = await make_cache(**COMBOS[combo])
    backend = await opener(b)
    gone = [f"{keys[i]}.swa" for i in range(pages) if not swa_ok[i]]
    if mamba and not state_ok[-1]:
        gone.append(f"{keys[-1]}.mamba")
    assert await backend.delete(gone) == len(gone)
    b.attach_storage(backend, POLICY)
    expect = _oracle(swa_ok, state_ok if mamba else None, 16 // kit.PS) * kit.PS
    await _serve(kit, b, toks, want, expect)
    assert _fallbacks(kit, b) == ({"not_stored": N - expect} if expect < N else {})


async def test_one_host_state_slot_still_restores_the_deepest_state(
        kit, make_cache, make_file_backend) -> None:
    """With a single host Mamba state, the first turn's state held after batch 1 makes room for
    the conversation's last state once all KV pages arrived."""
    toks, want = await _store(kit, make_cache, make_file_backend, "full+mamba")
    b = await make_cache(**COMBOS["full+mamba"], mamba_host_states=1)
    b.attach_storage(await make_file_backend(b), POLICY)
    await _serve(kit, b, toks, want, N)
    assert _fallbacks(kit, b) == {}
