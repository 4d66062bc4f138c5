"""The replay's draft sidecar (``--draft-layers``) and EAGLE keys (``--eagle``).

* A draft sidecar is written for every computed token and checked wherever the KV is (device
  hits under ``verify="all"``, L2 load-backs, L3 prefetches, buffer-only staging): the counts
  are those of the replay without it, the draft bytes checked are exactly the verified tokens
  times the draft's bytes per token, and a corrupted draft slot is caught and named.
* EAGLE: a prompt of ``n`` tokens has ``n - 1`` cacheable bigram positions; exact counts on a
  hand-made trace, the KV pattern's pages are of the bigram view, and the bounds stay bounds.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asynccache import BigramKey, CacheConfig
from asynccache.cli import main
from asynccache.errors import ConfigError
from asynccache.replay.bound import PrefixHasher
from asynccache.replay.driver import KVMismatchError, Replayer, ReplayOptions
from asynccache.replay.formats import TraceRequest
from asynccache.replay.kvcheck import ReplayKV
from asynccache.replay.kvpattern import PrefixKV
from asynccache.transfers.pools import DevicePool, KVShape

PS = 4
SMALL = ["--limit", "120", "--device-tokens", "8Ki", "--host-tokens", "32Ki"]
# Figures that depend on the bytes per token moved (the draft rides every copy) or on time.
_APART = {"config", "moved", "verified_draft_bytes", "wall_s", "timing", "requests_per_s",
          "tokens_per_s"}


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["replay", "--json", "--progress", "off", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def _counts(rep: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in rep.items() if k not in _APART}


# ---------------------------------------------------------------------------- draft sidecar
@pytest.mark.parametrize("extra", [
    [],  # L2 load-backs checked
    ["--verify", "all", "--eagle"],  # device hits too, bigram keys
    ["--verify", "none"],
])
def test_a_draft_sidecar_changes_no_count_and_its_bytes_are_all_checked(extra, capsys):
    plain = _run([*SMALL, *extra], capsys)
    draft = _run([*SMALL, *extra, "--draft-layers", "3", "--draft-heads", "1"], capsys)
    assert _counts(draft) == _counts(plain)
    per_token = 3 * 2 * 1 * 16 * 2  # layers x K/V x heads x head_dim x float16
    assert draft["verified_draft_bytes"] == draft["verified_tokens"] * per_token
    assert plain["verified_draft_bytes"] == 0
    assert draft["config"]["draft_kv_shape"] == [3, 1, 16]
    if extra != ["--verify", "none"]:
        assert draft["verified_tokens"] > 0
    # the draft rides every copy: the bytes moved grow by its share of a token's bytes
    kv_per_token = 2 * 2 * 2 * 16 * 2
    for k in ("device_to_host_bytes", "host_to_device_bytes"):
        assert draft["moved"][k] * kv_per_token == plain["moved"][k] * (kv_per_token
                                                                          + per_token)


@pytest.mark.parametrize("eagle", [[], ["--eagle"]])
@pytest.mark.parametrize("host_mode", ["cache", "buffer_only"])
def test_the_draft_rides_storage_round_trips_and_is_checked_after_prefetch(
        host_mode, eagle, tmp_path, capsys):
    argv = ["--limit", "150", "--device-tokens", "8Ki", "--host-tokens", "8Ki",
            "--write-policy", "write_through", "--host-mode", host_mode, "--clear-storage",
            *eagle]
    plain = _run([*argv, "--storage", f"file://{tmp_path / 'plain'}"], capsys)
    draft = _run([*argv, "--storage", f"file://{tmp_path / 'draft'}", "--draft-layers", "1"],
                 capsys)
    assert plain["hits"]["storage_tokens"] > 0  # the L3 path is exercised
    assert _counts(draft) == _counts(plain)
    assert draft["verified_draft_bytes"] == draft["verified_tokens"] * (1 * 2 * 2 * 16 * 2)
    kv, dr = 2 * 2 * 2 * 16 * 2, 1 * 2 * 2 * 16 * 2  # bytes per token
    for k, v in plain["moved"].items():  # every tier's bytes carry the draft's share
        assert draft["moved"][k] * kv == v * (kv + dr), k
    # the draft's objects were stored next to the KV pages
    names = [p.name for p in (tmp_path / "draft").rglob("*") if p.is_file()]
    assert any(".draft" in n for n in names), names[:5]


def test_a_kv_page_never_passes_for_a_draft_page():
    """Same geometry for both pools: the draft data of a position differs from its KV in every
    element (their lanes differ everywhere), so KV bytes copied into the draft pool fail at
    their first token, and the draft pool written by the replay verifies."""
    from asynccache.transfers.sidecars import DeviceSidecarPool, SidecarShape

    shape = KVShape(num_layers=2, num_heads=2, head_dim=4, dtype=torch.float16)
    pool = DevicePool(shape, 64, PS, device="cpu")
    draft = DeviceSidecarPool(SidecarShape(2, (2, 2, 4), torch.float16), 64, PS)
    kv = ReplayKV(pool, shape, draft=draft)
    toks = np.arange(30, 42, dtype=np.uint32)
    ids = kv.page_ids(toks, "ns")
    slots = np.arange(20, 32, dtype=np.int64)
    kv.write(slots, ids, 0)
    assert kv.verify(slots, ids, 0) is None
    want = kv.pattern.expected_draft(toks, "ns", 0, 12, kv.draft.lanes).view(torch.int16)
    assert torch.equal(draft.read_slots(slots).view(torch.int16), want)
    as_draft = pool.kv[:, :, 20:32].movedim(2, 1).view(torch.int16)  # the KV, draft-shaped
    assert bool((as_draft != want).all())
    draft.data[:, 20:32] = pool.kv[:, :, 20:32].movedim(2, 1)
    bad = kv.verify(slots, ids, 0)
    assert bad == 0 and bad is not None and bad.pool == "draft KV"


def _trace(*prompts: list[int]) -> list[TraceRequest]:
    return [TraceRequest(f"r{i}", float(i), np.asarray(p, dtype=np.uint32), 0, None)
            for i, p in enumerate(prompts)]


def _config(**kw: Any) -> CacheConfig:
    base: dict[str, Any] = dict(page_size=PS, num_layers=2, num_heads=2, head_dim=4,
                                device_tokens=64, host_tokens=0)
    base.update(kw)
    return CacheConfig(**base)


def _corrupting(rep: Replayer, trace: list[TraceRequest], after: int,
                corrupt: Any) -> Iterator[TraceRequest]:
    """``trace``, calling ``corrupt(cache)`` before request ``after + 1`` is read: the driver
    reads a request after the previous step and its copies completed, and finishes a request
    when the next one arrives, so request ``after - 1`` is cached by then."""
    for i, tr in enumerate(trace):
        if i == after + 1:
            corrupt(rep.cache)
        yield tr


A = list(range(100, 120))  # 20 tokens: 5 pages (EAGLE: 19 positions, 4 whole pages)


@pytest.mark.parametrize("eagle", [False, True])
@pytest.mark.parametrize("pool", ["draft KV", "KV"])
def test_a_corrupted_device_slot_is_caught_and_named(pool, eagle):
    """``verify="all"``: the third request is served A's pages from the device; one element
    of one slot of page 2, flipped through the pool, is named with its position."""
    rep = Replayer(_config(eagle=eagle), ReplayOptions(verify="all", draft_layers=1))
    slot_of: list[int] = []

    def corrupt(cache: Any) -> None:
        m = cache.match_prefix(A)
        slot = int(m.device_indices[9])
        slot_of.append(slot)
        if pool == "KV":
            cache.device_pool.kv.view(torch.int16)[1, 0, slot, 1, 2] ^= 8
        else:
            cache.sidecar("draft").device.layer(0).view(torch.int16)[slot, 1, 0, 3] ^= 8

    with pytest.raises(KVMismatchError) as err:
        asyncio.run(rep.run(_corrupting(rep, _trace(A, [1, 2, 3, 4], A), 1, corrupt)))
    assert str(err.value) == (f"request r2: {pool} served for token position 9 (slot "
                              f"{slot_of[0]}) differs from the {pool} of its tokens")


def test_a_corrupted_host_draft_copy_is_caught_at_load_back():
    """A's pages are evicted to host (B fills the device), the host copy of A's draft KV is
    corrupted through the host pool, and A's load-back names the draft KV."""
    B = list(range(500, 556))  # 56 tokens: with A's 20 more than the 64-slot device holds
    cfg = _config(host_tokens=256, write_policy="write_through")
    rep = Replayer(cfg, ReplayOptions(draft_layers=2, draft_heads=1))

    def corrupt(cache: Any) -> None:
        host = cache.sidecar("draft").host
        host.data.view(torch.int16)[1] ^= 1  # layer 1 of every host slot

    with pytest.raises(KVMismatchError, match=r"request r2: draft KV served for token "
                                              r"position 0 \(slot \d+\) differs"):
        asyncio.run(rep.run(_corrupting(rep, _trace(A, B, A), 1, corrupt)))


def test_bad_draft_options_are_refused():
    with pytest.raises(ConfigError, match="draft_layers must be an int >= 0, got -1"):
        ReplayOptions(draft_layers=-1)
    with pytest.raises(ConfigError, match="draft_heads=2 needs draft_layers >= 1"):
        ReplayOptions(draft_heads=2)
    with pytest.raises(ConfigError, match="draft_head_dim must be an int >= 1"):
        ReplayOptions(draft_layers=1, draft_head_dim=0)


def test_cli_refuses_draft_geometry_without_draft_layers(capsys):
    with pytest.raises(SystemExit):
        main(["replay", "--draft-heads", "2"])
    assert "--draft-heads needs --draft-layers N" in capsys.readouterr().err


# ---------------------------------------------------------------------------- EAGLE
def _replay(cfg: CacheConfig, trace: list[TraceRequest], **opts: Any) -> Any:
    rep = Replayer(cfg, ReplayOptions(**opts))
    return asyncio.run(rep.run(trace))


def test_eagle_counts_on_a_hand_made_trace():
    """Page size 4. r0: 10 tokens = 9 bigram positions (3 blocks), nothing cached; its 2 whole
    pages are cached (positions 0-7, read through token 8). r1: the same first 9 tokens, then
    another: its first 8 positions are r0's (2 pages). r2: tokens 0-7 equal, token 8 not:
    position 7's bigram differs, so only page 0 matches (a token cache would hit 8). r3: 5
    tokens = 4 positions, exactly page 0."""
    base = list(range(1, 11))
    trace = _trace(base, [*base[:9], 99], [*base[:8], 77, 78], base[:5])
    s = _replay(_config(eagle=True), trace, verify="all")
    assert (s.prompt_tokens, s.prompt_pages) == (9 + 9 + 9 + 4, 3 + 3 + 3 + 1)
    assert (s.device_hit_tokens, s.device_hit_pages) == (0 + 8 + 4 + 4, 0 + 2 + 1 + 1)
    assert s.computed_tokens == 31 - 16
    assert s.verified_tokens == 16
    assert (s.bound_hit_tokens, s.bound_hit_pages) == (16, 4)
    assert s.optimum_hit_pages == 4
    tok = _replay(_config(), trace, verify="all")  # token keys: r2 hits 8 (0 + 8 + 8 + 4)
    assert (tok.prompt_tokens, tok.device_hit_tokens, tok.bound_hit_tokens) == (35, 20, 20)


def test_eagle_page_ids_are_of_the_bigram_view():
    """The KV pattern's page ids are the chain hashes of ``BigramKey(tokens).data`` pages, and
    a prompt whose last position starts a page gets one more id (its position is computed)."""
    pat = PrefixKV(KVShape(1, 1, 4, torch.float16), PS, eagle=True)
    toks = np.arange(7, 20, dtype=np.uint32)  # 13 tokens, 12 positions: 3 pages + the last
    words = np.frombuffer(BigramKey(toks.tolist(), extra_key="ns").data, dtype="<u4")
    want = PrefixHasher(2 * PS).hashes(words, "ns", partial=True)
    ids = pat.page_ids(toks, "ns")
    assert len(want) == 3 and np.array_equal(ids[:3], want) and len(ids) == 4
    assert len(pat.page_ids(toks[:12], "ns")) == 3  # 11 positions: the last is in page 2
    assert pat.positions(13) == 12 and pat.positions(1) == 0 and pat.positions(0) == 0


@pytest.mark.parametrize("eagle", [False, True])
def test_eagle_catches_a_page_whose_next_token_differs(eagle):
    """Prompts that share tokens 0-3 and differ at token 4: under EAGLE page 0 (bigrams up to
    (t3, t4)) is another prefix's page and fails at its first token; with token keys it is the
    same page and passes, page 1 failing instead."""
    shape = KVShape(num_layers=2, num_heads=2, head_dim=4, dtype=torch.float16)
    pool = DevicePool(shape, 64, PS, device="cpu")
    kv = ReplayKV(pool, shape, eagle=eagle)
    a = np.array([5, 6, 7, 8, 9, 10, 11, 12, 13], dtype=np.uint32)
    b = a.copy()
    b[4] = 40
    slots = np.arange(8, 16, dtype=np.int64)
    kv.write(slots, kv.page_ids(a, None), 0)
    assert kv.verify(slots, kv.page_ids(a, None), 0) is None
    bad = kv.verify(slots, kv.page_ids(b, None), 0)
    assert bad == (0 if eagle else 4) and bad is not None and bad.pool == "KV"


@settings(max_examples=25, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 40)), min_size=1,
                     max_size=14),
       device=st.sampled_from([48, 64, 96]), host=st.sampled_from([0, 128]))
def test_eagle_bounds_bound_the_tree(seqs, device, host):
    """Prompts are prefixes of three base sequences (so they share pages and bigram pages);
    with EAGLE keys the infinite-cache bound is at least every tier's hits and the offline
    optimum at least the device hits, in positions and pages."""
    rng = np.random.default_rng(7)
    bases = [rng.integers(0, 6, size=48).tolist() for _ in range(3)]
    trace = _trace(*[bases[b][:n] for b, n in seqs])
    cfg = _config(eagle=True, device_tokens=device, host_tokens=host)
    s = _replay(cfg, trace, verify="all")
    assert s.rejected == 0
    assert s.prompt_tokens == sum(n - 1 for _, n in seqs)
    assert s.reused_tokens <= s.bound_hit_tokens and s.reused_pages <= s.bound_hit_pages
    assert s.device_hit_pages <= s.optimum_hit_pages
    assert s.verified_tokens == s.reused_tokens


def _store_name(path: Any) -> str:
    """The name a file-store object's header was written under (its file name, or its key)."""
    from asynccache.storage.pageformat import HEADER_SIZE, CorruptPageError, parse_header

    head = path.read_bytes()[:HEADER_SIZE]
    for name in (path.name, path.name.split(".", 1)[0] + ".draft"):
        try:
            parse_header(head, name)
            return name
        except CorruptPageError:  # the other candidate
            continue
    raise AssertionError(f"no header name fits {path.name}")


def test_a_draft_page_of_another_prefix_served_from_storage_is_named(tmp_path):
    """Storage checksums catch accidents, not a well-formed object holding another page's
    data: every ``.draft`` object of a first replay is given the next one's payload under a
    valid header, and the second replay, reading them back from L3, names the draft KV."""
    from asynccache.replay.synthetic import SyntheticSpec, synthetic_trace
    from asynccache.storage.pageformat import HEADER_SIZE, encode_header

    url = f"file://{tmp_path / 'l3'}"
    cfg = _config(page_size=16, device_tokens=8192, host_tokens=8192,
                  write_policy="write_through")
    trace = list(synthetic_trace(SyntheticSpec(seed=0)))[:40]
    first = Replayer(cfg, ReplayOptions(storage_url=url, draft_layers=1, clear_storage=True))
    asyncio.run(first.run(trace))
    assert first.stats.storage_hit_tokens > 0
    control = Replayer(cfg, ReplayOptions(storage_url=url, draft_layers=1))
    asyncio.run(control.run(trace))  # the store as written serves and verifies
    assert control.outcome.storage_foreign_pages > 0 and control.stats.verified_tokens > 0
    drafts = sorted(p for p in (tmp_path / "l3").rglob("*") if ".draft" in p.name)
    assert len(drafts) > 1
    payloads = [p.read_bytes()[HEADER_SIZE:] for p in drafts]
    for i, p in enumerate(drafts):
        payload = payloads[(i + 1) % len(payloads)]
        p.write_bytes(encode_header(_store_name(p), payload) + payload)
    second = Replayer(cfg, ReplayOptions(storage_url=url, draft_layers=1))
    with pytest.raises(KVMismatchError, match=r"draft KV served for token position \d+ "
                                              r"\(slot \d+\) differs from the draft KV"):
        asyncio.run(second.run(trace))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fragmented", [False, True])
def test_draft_write_and_verify_on_cuda_pools(fragmented, monkeypatch):
    from asynccache.replay import kvcheck
    from asynccache.transfers.sidecars import DeviceSidecarPool, SidecarShape

    if fragmented:
        monkeypatch.setattr(kvcheck, "_MAX_RUNS", 0)
    shape = KVShape(num_layers=2, num_heads=2, head_dim=4, dtype=torch.float16)
    pool = DevicePool(shape, 256, PS, device="cuda")
    draft = DeviceSidecarPool(SidecarShape(1, (2, 1, 8), torch.float16), 256, PS,
                              device="cuda")
    kv = ReplayKV(pool, shape, draft=draft, eagle=True)
    slots = np.concatenate([np.arange(36, 44), np.arange(8, 16), np.arange(80, 82)])
    toks = np.arange(3, 3 + len(slots) + 1, dtype=np.uint32)
    ids = kv.page_ids(toks, None)
    kv.write(slots, ids, 0)
    assert kv.verify(slots, ids, 0) is None
    want = kv.pattern.expected_draft(toks, None, 0, len(slots), kv.draft.lanes)
    assert torch.equal(draft.read_slots(slots).view(torch.int16), want.view(torch.int16))
    draft.data.view(torch.int16)[0, int(slots[11]), 1, 0, 5] ^= 2
    bad = kv.verify(slots, ids, 0)
    assert bad == 11 and bad is not None and bad.pool == "draft KV"
