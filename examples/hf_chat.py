"""An async scheduler serving multi-turn chats with a real transformers model over asynccache.

Every turn goes admit -> prefetch (L3 -> L2, with --storage) -> load-back (L2 -> L1, layer by
layer: the prefill of layer i waits only for layer i of the copy) -> prefill of the uncached
suffix over the cached prefix's KV -> the suffix's KV written into the request's slots -> greedy
decode -> cache_finished_req. The same turns are then served without the cache (a full prefill
each), and both are reported side by side: prefill tokens computed and wall time to the first
token's logits.

    pip install -c constraints.txt -e '.[hf]'
    python examples/hf_chat.py                         # synthetic chats, a seeded random tiny Llama
    python examples/hf_chat.py --json --verify         # JSON report; check logits and outputs
    python examples/hf_chat.py --model ./my-llama      # a local checkpoint directory (no download)
    python examples/hf_chat.py --storage /tmp/kv       # with a directory as L3 (run it twice)
    python examples/hf_chat.py --trace ../shared/traces/mooncake/conversation_trace.jsonl

Trace requests (Mooncake JSONL) are folded into the model's vocabulary (token % vocab) and cut
to --max-tokens; each is a one-turn conversation (the trace's shared prefixes give the hits).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from contextlib import AsyncExitStack
from typing import Any

import numpy as np
import torch

from asynccache import HierarchicalCache, PoolExhaustedError, StoragePolicy
from asynccache.integrations import hf
from asynccache.storage.file import FileBackend

TOL = 1e-5


def synthetic(args: argparse.Namespace, vocab: int) -> list[list[list[int]]]:
    """Conversations sharing one system prompt; each turn a user message of random length."""
    rng = np.random.default_rng(args.seed)
    system = rng.integers(0, vocab, args.system_tokens).tolist()
    convs = []
    for _ in range(args.conversations):
        turns = [rng.integers(0, vocab, int(rng.integers(args.user_min, args.user_max + 1))).tolist()
                 for _ in range(args.turns)]
        turns[0] = system + turns[0]
        convs.append(turns)
    return convs


def from_trace(args: argparse.Namespace, vocab: int) -> list[list[list[int]]]:
    from asynccache.replay.formats import read_mooncake

    convs = []
    for i, r in enumerate(read_mooncake(args.trace)):
        if i >= args.requests:
            break
        toks = (r.tokens[: args.max_tokens].astype(np.int64) % vocab).tolist()
        convs.append([toks])
    return convs


async def serve_all(cache: HierarchicalCache, runner: hf.ModelRunner,
                    convs: list[list[list[int]]], args: argparse.Namespace,
                    ) -> list[tuple[list[int], hf.TurnResult]]:
    """Turn by turn: the chats' next turns run concurrently (at most --concurrency at once), so
    other chats' requests come between two turns of one chat (and evict it to host)."""
    sem = asyncio.Semaphore(args.concurrency)
    history: list[list[int]] = [[] for _ in convs]
    done: list[tuple[list[int], hf.TurnResult]] = []
    running = 0
    finished = asyncio.Condition()

    async def turn(c: int, t: int) -> None:
        nonlocal running
        async with sem:
            prompt = history[c] + convs[c][t]
            while True:
                running += 1
                try:
                    r = await hf.serve_turn(cache, runner, prompt, new_tokens=args.new_tokens,
                                            layerwise=not args.no_layerwise)
                    break
                except PoolExhaustedError:
                    if running == 1:
                        raise  # alone and still no room: the device pool is too small
                finally:
                    running -= 1
                    async with finished:
                        finished.notify_all()
                async with finished:  # no room now: retry when another request finishes
                    await finished.wait()
            history[c] = prompt + r.output
            done.append((prompt, r))

    for t in range(max(len(c) for c in convs)):
        async with asyncio.TaskGroup() as tg:
            for c in range(len(convs)):
                if t < len(convs[c]):
                    tg.create_task(turn(c, t))
    return done


async def baseline(runner: hf.ModelRunner, prompts: list[list[int]], args: argparse.Namespace,
                   ) -> list[tuple[hf.PrefillResult, list[int]]]:
    """The same prompts without the cache: full prefill (timed) + greedy decode, same
    concurrency."""
    sem = asyncio.Semaphore(args.concurrency)

    def one(p: list[int]) -> tuple[hf.PrefillResult, list[int]]:
        res = runner.prefill_uncached(p)
        return res, runner.decode(res.model_cache, res.logits[-1], args.new_tokens)

    async def run(p: list[int]) -> tuple[hf.PrefillResult, list[int]]:
        async with sem:
            return await asyncio.to_thread(one, p)

    return list(await asyncio.gather(*(run(p) for p in prompts)))


async def main(args: argparse.Namespace) -> dict[str, Any]:
    tiny = hf.tiny_llama_config(num_layers=args.layers, hidden_size=args.hidden,
                                num_heads=args.heads, num_kv_heads=args.kv_heads)
    model = hf.load_model(args.model, seed=args.seed, config=None if args.model else tiny)
    runner = hf.ModelRunner(model)
    convs = from_trace(args, runner.vocab_size) if args.trace else synthetic(args, runner.vocab_size)
    cfg = hf.cache_config(model, page_size=args.page_size, device_tokens=args.device_tokens,
                          host_tokens=args.host_tokens, write_policy="write_through",
                          load_back_threshold=1)
    cache = HierarchicalCache(cfg)
    t0 = time.perf_counter()
    async with AsyncExitStack() as stack:
        if args.storage:
            backend = await stack.enter_async_context(FileBackend(args.storage,
                                                                  cache.storage_layout()))
        await stack.enter_async_context(cache)
        if args.storage:
            cache.attach_storage(backend, StoragePolicy(prefetch_threshold=args.page_size,
                                                        prefetch_policy="wait_complete"))
        served = await serve_all(cache, runner, convs, args)
    cached_wall = time.perf_counter() - t0
    prompts = [p for p, _ in served]
    t0 = time.perf_counter()
    base = await baseline(runner, prompts, args)
    base_wall = time.perf_counter() - t0

    results = [r for _, r in served]
    with_tok = sum(r.computed for r in results)
    without_tok = sum(len(p) for p in prompts)
    with_ttft = sum(r.ttft_s for r in results)
    without_ttft = sum(b.seconds for b, _ in base)
    n = len(results)
    report: dict[str, Any] = {
        "model": args.model or "tiny seeded Llama (random weights)",
        "model_shape": dict(zip(("num_layers", "num_kv_heads", "head_dim"),
                                hf.model_kv_shape(model), strict=True)),
        "workload": args.trace or "synthetic",
        "cache": {"page_size": args.page_size, "device_tokens": args.device_tokens,
                  "host_tokens": args.host_tokens, "storage": args.storage,
                  "layerwise_load_back": not args.no_layerwise},
        "with_cache": {
            "requests": n, "prompt_tokens": without_tok, "prefill_tokens": with_tok,
            "device_hit_tokens": sum(r.device_hit for r in results),
            "loaded_tokens": sum(r.loaded for r in results),
            "fetched_tokens": sum(r.fetched for r in results),
            "layerwise_loads": sum(r.layerwise for r in results),
            "ttft_s": with_ttft, "ttft_mean_ms": 1e3 * with_ttft / max(n, 1), "wall_s": cached_wall,
        },
        "without_cache": {
            "requests": len(base), "prompt_tokens": without_tok, "prefill_tokens": without_tok,
            "ttft_s": without_ttft, "ttft_mean_ms": 1e3 * without_ttft / max(n, 1),
            "wall_s": base_wall,
        },
        "prefill_tokens_saved": 1 - with_tok / max(without_tok, 1),
        "ttft_speedup": without_ttft / with_ttft if with_ttft else None,
    }
    if args.verify:
        diff = max(float((r.logits - b.logits[r.model_prefix:]).abs().max())
                   for r, (b, _) in zip(results, base, strict=True))
        same = all(r.output == out for r, (_, out) in zip(results, base, strict=True))
        report["max_logit_diff"] = diff
        report["outputs_identical"] = same
        report["verified"] = same and diff <= TOL
    return report


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--model", help="a local checkpoint directory (default: a tiny seeded Llama)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=4, help="tiny model: decoder layers")
    ap.add_argument("--hidden", type=int, default=128, help="tiny model: hidden size")
    ap.add_argument("--heads", type=int, default=4, help="tiny model: attention heads")
    ap.add_argument("--kv-heads", type=int, default=2, help="tiny model: KV heads")
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--user-min", type=int, default=16)
    ap.add_argument("--user-max", type=int, default=64)
    ap.add_argument("--trace", help="a Mooncake JSONL trace instead of the synthetic chats")
    ap.add_argument("--requests", type=int, default=16, help="trace requests to serve")
    ap.add_argument("--max-tokens", type=int, default=1024, help="cut trace prompts to this")
    ap.add_argument("--new-tokens", type=int, default=4, help="greedy tokens per turn")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--device-tokens", type=int, default=640,
                    help="device (L1) pool; small, so chats are evicted to host between turns")
    ap.add_argument("--host-tokens", type=int, default=16384)
    ap.add_argument("--storage", help="a directory as the L3 tier")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1),
                    help="torch CPU threads")
    ap.add_argument("--no-layerwise", action="store_true",
                    help="wait for the whole load-back before the prefill")
    ap.add_argument("--verify", action="store_true",
                    help="check logits (within 1e-5) and greedy outputs against the uncached run")
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def show(r: dict[str, Any]) -> str:
    w, wo = r["with_cache"], r["without_cache"]
    lines = [
        f"{r['with_cache']['requests']} requests, {w['prompt_tokens']} prompt tokens "
        f"({r['workload']}, {r['model']})",
        f"{'':16}{'with cache':>14}{'without':>14}",
        f"{'prefill tokens':16}{w['prefill_tokens']:>14}{wo['prefill_tokens']:>14}",
        f"{'TTFT total (s)':16}{w['ttft_s']:>14.3f}{wo['ttft_s']:>14.3f}",
        f"{'TTFT mean (ms)':16}{w['ttft_mean_ms']:>14.2f}{wo['ttft_mean_ms']:>14.2f}",
        f"cache: {w['device_hit_tokens']} tokens device hits, {w['loaded_tokens']} loaded back "
        f"({w['layerwise_loads']} layer-wise loads), {w['fetched_tokens']} from storage",
    ]
    if "verified" in r:
        lines.append(f"verified: {r['verified']} (max logit diff {r['max_logit_diff']:.2e}, "
                     f"outputs identical: {r['outputs_identical']})")
    return "\n".join(lines)


if __name__ == "__main__":
    a = parse()
    torch.set_num_threads(a.threads)
    rep = asyncio.run(main(a))
    print(json.dumps(rep, indent=2) if a.json else show(rep))
    sys.exit(0 if rep.get("verified", True) else 1)
