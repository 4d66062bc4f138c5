"""A real transformers model (a seeded random Llama, fp32, CPU) prefilling only the uncached
suffix over KV read from asynccache's pools: logits equal a full recompute within 1e-5 and greedy
outputs are identical, for L1 hits, L2 load-backs (a small device pool: evictions between turns)
and L3 prefetches from a file backend; a corrupted stored page is caught by its checksum and
recomputed, never fed to the model."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import os
import secrets
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from asynccache import HierarchicalCache, StoragePolicy
from asynccache.integrations import hf
from asynccache.storage.file import FileBackend

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf_chat.py"
TOL = 1e-5
TIMEOUT = 60.0
NEW = 3  # greedy tokens per turn


@pytest.fixture(scope="module")
def runner() -> hf.ModelRunner:
    return hf.ModelRunner(hf.load_model(seed=0))


def conversations(seed: int, n: int, vocab: int, system: int = 24) -> list[list[list[int]]]:
    """``n`` conversations of 3 user messages each, all sharing a system prompt."""
    rng = np.random.default_rng(seed)
    sys_prompt = rng.integers(0, vocab, system).tolist()
    return [[sys_prompt + rng.integers(0, vocab, 9).tolist()]
            + [rng.integers(0, vocab, int(rng.integers(5, 21))).tolist() for _ in range(2)]
            for _ in range(n)]


def check_turn(runner: hf.ModelRunner, tokens: list[int], r: hf.TurnResult) -> None:
    full = runner.full_logits(tokens)
    start = r.model_prefix
    assert r.logits.shape == full[start:].shape
    err = (r.logits - full[start:]).abs().max().item()
    assert err <= TOL, f"suffix logits differ from a full recompute by {err:.3g}"
    assert r.output == runner.generate_uncached(tokens, NEW)[1]


async def chat(cache: HierarchicalCache, runner: hf.ModelRunner, convs: list[list[list[int]]],
               **kw: Any) -> list[hf.TurnResult]:
    """Serve the conversations turn by turn, round-robin (other chats run between two turns of
    one chat), checking every turn against a full recompute."""
    out = []
    history: list[list[int]] = [[] for _ in convs]
    for turn in range(len(convs[0])):
        for c, conv in enumerate(convs):
            tokens = history[c] + conv[turn]
            r = await asyncio.wait_for(hf.serve_turn(cache, runner, tokens, new_tokens=NEW, **kw),
                                       TIMEOUT)
            check_turn(runner, tokens, r)
            history[c] = tokens + r.output
            out.append(r)
    await cache.flush()
    cache.sanity_check()
    return out


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layerwise", [True, False])
async def test_l1_hits_and_l2_load_backs_match_a_full_recompute(
        runner: hf.ModelRunner, page_size: int, layerwise: bool) -> None:
    # Device pool for ~1.5 conversations: the others' turns evict a chat's KV to host (L2).
    cfg = hf.cache_config(runner.model, page_size=page_size, device_tokens=112,
                          host_tokens=4096, write_policy="write_through", load_back_threshold=1,
                          device="cpu")
    async with HierarchicalCache(cfg) as cache:
        results = await chat(cache, runner, conversations(page_size, 4, runner.vocab_size),
                             layerwise=layerwise)
        assert cache.outstanding_device_tokens == 0
    assert any(r.device_hit > 0 for r in results), "no L1 hit"
    assert any(r.loaded > 0 for r in results), "no L2 load-back"
    assert any(r.layerwise for r in results) == layerwise
    assert sum(r.computed for r in results) < sum(r.tokens for r in results)


def page_keys(toks: list[int], page_size: int) -> list[str]:
    """Storage keys of the whole pages of ``toks`` (the default namespace's SHA-256 chain)."""
    out, prev = [], b""
    for i in range(0, len(toks) - len(toks) % page_size, page_size):
        prev = hashlib.sha256(prev + struct.pack(f"<{page_size}I", *toks[i:i + page_size])).digest()
        out.append(prev.hex())
    return out


async def _write_then_fetch(runner: hf.ModelRunner, page_size: int,
                            make_backend: Callable[[Any], Any],
                            corrupt: Callable[[list[int]], None] | None = None,
                            ) -> tuple[list[hf.TurnResult], float]:
    """Cache A serves two prompts with storage attached (written through to L3); after an
    optional ``corrupt(prompt)``, a restarted cache B (empty L1 and L2) serves them again from
    storage. Returns B's turns and the corrupt pages its backend counted."""
    cfg = hf.cache_config(runner.model, page_size=page_size, device_tokens=512, host_tokens=1024,
                          write_policy="write_through", load_back_threshold=1, device="cpu")
    convs = conversations(100 + page_size, 2, runner.vocab_size)
    prompts = [c[0] + c[1] for c in convs]
    a = HierarchicalCache(cfg)
    async with make_backend(a.storage_layout()) as backend, a:
        a.attach_storage(backend, StoragePolicy())
        for p in prompts:
            check_turn(runner, p, await hf.serve_turn(a, runner, p, new_tokens=NEW))
        await a.flush()
        await a.storage.drain()  # type: ignore[union-attr]
    if corrupt is not None:
        corrupt(prompts[0])
    b = HierarchicalCache(cfg)
    async with make_backend(b.storage_layout()) as backend, b:
        b.attach_storage(backend, StoragePolicy(prefetch_policy="wait_complete",
                                                prefetch_threshold=1))
        out = []
        for p in prompts:
            r = await hf.serve_turn(b, runner, p, new_tokens=NEW)
            check_turn(runner, p, r)
            out.append(r)
        await b.flush()
        b.sanity_check()
        faults = sum(s.value for m in backend.metrics.registry.collect() for s in m.samples
                     if s.name == "asynccache_storage_faults_total"
                     and s.labels.get("reason") == "corrupt")
    return out, faults


@pytest.mark.parametrize("page_size", [1, 16])
async def test_l3_prefetch_from_a_file_backend_matches(tmp_path: Path, runner: hf.ModelRunner,
                                                       page_size: int) -> None:
    results, faults = await _write_then_fetch(
        runner, page_size, lambda layout: FileBackend(tmp_path / "kv", layout))
    assert faults == 0
    assert all(r.fetched > 0 and r.loaded == r.fetched for r in results), results
    assert all(r.computed < r.tokens for r in results)


@pytest.mark.seaweedfs
async def test_l3_prefetch_from_s3_matches(asynccache_s3: Any, runner: hf.ModelRunner) -> None:
    prefix = f"hf-{secrets.token_hex(6)}"
    results, faults = await _write_then_fetch(
        runner, 16, lambda layout: asynccache_s3.backend(layout, prefix=prefix))
    assert faults == 0
    assert all(r.fetched > 0 and r.loaded == r.fetched for r in results), results


async def test_a_corrupt_stored_page_is_recomputed_not_served(tmp_path: Path,
                                                              runner: hf.ModelRunner) -> None:
    root = tmp_path / "kv"

    def flip_second_page(prompt: list[int]) -> None:
        key = page_keys(prompt, 16)[1]
        (f,) = root.rglob(f"{key}*")
        data = bytearray(f.read_bytes())
        data[-8:] = bytes(x ^ 0xFF for x in data[-8:])
        f.write_bytes(bytes(data))

    results, faults = await _write_then_fetch(
        runner, 16, lambda layout: FileBackend(root, layout), flip_second_page)
    assert faults == 1, "the checksum did not catch the corrupted page"
    # The first page came from storage; the corrupted second one and every page after it were
    # recomputed (and the logits matched a full recompute: no corrupted KV reached the model).
    first = results[0]
    assert (first.fetched, first.model_prefix, first.computed) == (16, 16, first.tokens - 16)


async def test_a_fully_cached_prompt_recomputes_only_its_last_token(
        runner: hf.ModelRunner) -> None:
    cfg = hf.cache_config(runner.model, page_size=1, device_tokens=256, host_tokens=0,
                          device="cpu")
    toks = list(range(7, 47))
    async with HierarchicalCache(cfg) as cache:
        await hf.serve_turn(cache, runner, toks, new_tokens=NEW)
        r = await hf.serve_turn(cache, runner, toks, new_tokens=NEW)
        check_turn(runner, toks, r)
        assert (r.device_hit, r.model_prefix, r.computed) == (40, 39, 1)
        cache.sanity_check()
        assert cache.outstanding_device_tokens == 0


@pytest.mark.parametrize("at", ["prefill", "decode"])
async def test_cancelling_a_turn_during_a_layerwise_load_leaves_nothing(
        runner: hf.ModelRunner, at: str) -> None:
    cfg = hf.cache_config(runner.model, page_size=16, device_tokens=96, host_tokens=1024,
                          write_policy="write_through", load_back_threshold=1, device="cpu")
    a, b = list(range(1, 65)), list(range(100, 164))
    q = [*a, 5]
    async with HierarchicalCache(cfg) as cache:
        await hf.serve_turn(cache, runner, a, new_tokens=1)
        await cache.flush()
        await hf.serve_turn(cache, runner, b, new_tokens=1)  # evicts a's KV to host
        await cache.flush()
        req = cache.admit(q)
        assert req.host_hit_length > 0
        cache.abort_req(req)
        gate = asyncio.Event()
        real = runner.prefill if at == "prefill" else runner.decode

        async def slow_prefill(*args: Any, **kw: Any) -> Any:
            gate.set()
            await asyncio.sleep(10)
            return await real(*args, **kw)  # type: ignore[misc]

        loop = asyncio.get_running_loop()

        def slow_decode(*args: Any, **kw: Any) -> Any:  # (runs in a worker thread)
            loop.call_soon_threadsafe(gate.set)
            time.sleep(0.5)
            return real(*args, **kw)

        patched = hf.ModelRunner(runner.model)
        if at == "prefill":
            patched.prefill = slow_prefill  # type: ignore[method-assign]
        else:
            patched.decode = slow_decode  # type: ignore[method-assign]
        task = asyncio.create_task(hf.serve_turn(cache, patched, q, new_tokens=2))
        await asyncio.wait_for(gate.wait(), TIMEOUT)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await cache.flush()
        cache.sanity_check()
        assert cache.outstanding_device_tokens == 0
        assert cache.tree.held_locks == 0
        r = await hf.serve_turn(cache, runner, q, new_tokens=NEW)  # still served right
        check_turn(runner, q, r)


async def test_layer_i_waits_only_for_its_own_load() -> None:
    """The prefill of layer 0 runs while layer 1's load-back is still pending."""
    runner = hf.ModelRunner(hf.load_model(seed=1))
    cfg = hf.cache_config(runner.model, page_size=1, device_tokens=256, host_tokens=0,
                          device="cpu")
    tokens = list(range(40))
    async with HierarchicalCache(cfg) as cache:
        first = await hf.serve_turn(cache, runner, tokens[:30], new_tokens=1)
        assert first.model_prefix == 0
        req = cache.admit(tokens)
        try:
            assert req.prefix_len == 30
            gates = [asyncio.Event() for _ in range(runner.num_layers)]
            consumed: list[int] = []

            class Gate:
                async def layer(self, i: int) -> None:
                    await gates[i].wait()

            task = asyncio.create_task(runner.prefill(
                cache, req.slots[:30], tokens[30:], load=Gate(), on_layer=consumed.append))
            gates[0].set()
            for _ in range(500):
                if consumed:
                    break
                await asyncio.sleep(0.01)
            assert consumed == [0], "layer 0 did not start before layer 1's load completed"
            await asyncio.sleep(0.05)
            assert consumed == [0]
            for g in gates:
                g.set()
            res = await asyncio.wait_for(task, TIMEOUT)
            assert consumed == list(range(runner.num_layers))
            full = runner.full_logits(tokens)
            assert (res.logits - full[30:]).abs().max().item() <= TOL
        finally:
            cache.abort_req(req)


async def test_a_failed_layer_load_fails_the_prefill_and_ends_the_model_thread(
        runner: hf.ModelRunner) -> None:
    cfg = hf.cache_config(runner.model, page_size=1, device_tokens=256, host_tokens=0,
                          device="cpu")
    tokens = list(range(3, 43))
    async with HierarchicalCache(cfg) as cache:
        await hf.serve_turn(cache, runner, tokens[:30], new_tokens=1)
        req = cache.admit(tokens)
        consumed: list[int] = []

        class Broken:
            async def layer(self, i: int) -> None:
                if i == 1:
                    raise RuntimeError("copy of layer 1 failed")

        try:
            with pytest.raises(RuntimeError, match="layer 1 failed"):
                await asyncio.wait_for(runner.prefill(cache, req.slots[:30], tokens[30:],
                                                      load=Broken(), on_layer=consumed.append),
                                       TIMEOUT)
            assert consumed == [0]  # layer 0 ran; layer 1 never saw KV
        finally:
            cache.abort_req(req)
        cache.sanity_check()


def test_a_checkpoint_directory_loads_through_the_same_path(tmp_path: Path,
                                                            runner: hf.ModelRunner) -> None:
    runner.model.save_pretrained(tmp_path / "ckpt")
    again = hf.ModelRunner(hf.load_model(tmp_path / "ckpt"))
    toks = list(range(1, 20))
    assert torch.equal(again.full_logits(toks), runner.full_logits(toks))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("model_device", ["cpu", "cuda"])
async def test_cuda_pools(model_device: str) -> None:
    """The cache's pools on CUDA (staged copies, pinned host), the model on either device."""
    cuda = hf.ModelRunner(hf.load_model(seed=0).to(model_device))
    cfg = hf.cache_config(cuda.model, page_size=16, device_tokens=112, host_tokens=4096,
                          write_policy="write_through", load_back_threshold=1, device="cuda")
    async with HierarchicalCache(cfg) as cache:
        results = await chat(cache, cuda, conversations(7, 4, cuda.vocab_size))
    assert any(r.loaded > 0 for r in results), "no L2 load-back"
    assert any(r.layerwise for r in results)


def example() -> Any:
    """examples/hf_chat.py as a module (run in-process: no second torch import)."""
    spec = importlib.util.spec_from_file_location("hf_chat_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


async def test_the_example_reports_with_and_without_the_cache() -> None:
    ex = example()
    rep = await ex.main(ex.parse(["--conversations", "3", "--turns", "3", "--verify",
                                  "--layers", "2", "--hidden", "64"]))
    json.dumps(rep)  # the --json report is plain JSON
    assert rep["verified"] is True
    assert rep["with_cache"]["prefill_tokens"] < rep["without_cache"]["prefill_tokens"]
    assert rep["with_cache"]["requests"] == rep["without_cache"]["requests"] == 9
    assert rep["with_cache"]["ttft_s"] > 0 and rep["without_cache"]["ttft_s"] > 0
    assert "with cache" in ex.show(rep)


TRACE = ROOT.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"


@pytest.mark.skipif(not TRACE.exists(), reason=f"no shared trace at {TRACE}")
async def test_the_example_serves_a_trace_slice_folded_into_the_vocabulary() -> None:
    ex = example()
    rep = await ex.main(ex.parse(["--verify", "--trace", str(TRACE), "--requests", "6",
                                  "--max-tokens", "256", "--layers", "2", "--hidden", "64"]))
    assert rep["verified"] is True
    assert rep["with_cache"]["requests"] == 6
    assert rep["with_cache"]["prefill_tokens"] < rep["without_cache"]["prefill_tokens"]


def test_the_example_runs_as_a_script_with_json() -> None:
    out = subprocess.run([sys.executable, str(EXAMPLE), "--json", "--conversations", "2",
                          "--turns", "2", "--layers", "2", "--hidden", "64", "--verify"],
                         capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert json.loads(out.stdout)["verified"] is True
