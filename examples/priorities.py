"""Priorities, sessions and preemption: the README's scheduler loop, driven on a small CPU cache.

A low-priority chat request is running when an urgent request arrives that does not fit: the chat
is preempted (its KV parked in host memory), the urgent request runs and finishes, then the chat
is restored, bit for bit, and finishes too.

    python examples/priorities.py

tests/test_readme.py checks that the part between the two marker comments is the README's
example, character for character, and runs this file.
"""
# ruff: noqa: I001  (the README's example keeps its own imports, below the driver's)

import asyncio

import torch

from asynccache import CacheConfig, HierarchicalCache

# --- README.md, "Priorities, sessions and preemption" (verbatim) ---
from dataclasses import dataclass

from asynccache import CacheRequest, PoolExhaustedError

@dataclass(eq=False)
class Item:                                                  # your scheduler's request
    tokens: list[int]
    priority: int = 0
    chat_id: str | None = None
    req: CacheRequest | None = None                          # admitted (or preempted) request

async def step(cache, waiting, running):
    waiting.sort(key=lambda it: -it.priority)                # your admission order
    for item in list(waiting):
        try:
            if item.req is None:
                item.req = cache.admit(item.tokens, session_id=item.chat_id, priority=item.priority)
                await cache.load_back_request(item.req)
                await cache.extend(item.req, len(item.tokens) - item.req.prefix_len)
            else:
                await cache.restore(item.req)                # preempted before: KV back from host
        except PoolExhaustedError:                           # no room: preempt a lower priority
            if item.req.retracted is None:                   # (a failed restore keeps its KV on host)
                cache.abort_req(item.req)
                item.req = None
            victims = [r for r in running if r.priority < item.priority]
            if victims:
                victim = min(victims, key=lambda r: r.priority)
                await cache.retract(victim.req)              # its KV -> host, its slots freed
                running.remove(victim)
                waiting.append(victim)
            break                                            # `item` goes first at the next step
        waiting.remove(item)
        running.append(item)
    # forward pass over `running`; a finished item: cache.cache_finished_req(item.req), inserted
    # with its priority (and, for a chat, referenced by its session: evicted after the rest)
# --- end of the README's example ---


def kv_of(cache, tokens):
    """Stand-in KV of ``tokens`` (a function of the token ids, so it can be checked later)."""
    c = cache.config
    ids = torch.tensor(tokens, dtype=torch.float32).view(1, 1, -1, 1, 1)
    return ids.expand(c.num_layers, 2, len(tokens), c.num_heads, c.head_dim)  # (layers, 2, n, heads, head_dim)


def forward(cache, running, computed):
    """Stand-in forward pass: write the KV of each running item's uncached tokens, once."""
    for item in running:
        if item not in computed:
            start = item.req.prefix_len
            cache.write_kv(item.req.slots[start:], kv_of(cache, item.tokens[start:]))
            computed.add(item)


def finish(cache, running, item):
    cache.cache_finished_req(item.req)  # inserted with its priority
    running.remove(item)


async def main():
    # 16 device pages of 16 tokens: two 160-token requests do not fit side by side.
    config = CacheConfig(page_size=16, num_layers=2, num_heads=2, head_dim=32,
                         device_tokens=256, host_tokens=1024, eviction_policy="priority",
                         enable_sessions=True, retraction_backup=True)
    chat = Item(list(range(100, 260)), priority=0, chat_id="chat-1")
    urgent = Item(list(range(300, 460)), priority=5)
    waiting, running, computed = [chat], [], set()
    async with HierarchicalCache(config) as cache:
        await step(cache, waiting, running)           # the chat is admitted and computed
        forward(cache, running, computed)
        assert running == [chat]
        waiting.append(urgent)
        await step(cache, waiting, running)           # no room for urgent: the chat is preempted
        assert running == [] and chat.req.retracted is not None
        print("preempted chat-1:", chat.req.retracted.num_tokens, "tokens parked in host memory")
        await step(cache, waiting, running)           # urgent runs
        assert running == [urgent]
        forward(cache, running, computed)
        finish(cache, running, urgent)
        await step(cache, waiting, running)           # the chat comes back (evicting urgent's KV)
        assert running == [chat] and chat.req.retracted is None
        finish(cache, running, chat)
        m = cache.match_prefix(chat.tokens)
        assert m.device_prefix_len == len(chat.tokens)
        assert torch.equal(cache.read_kv(m.device_indices),
                           kv_of(cache, chat.tokens).to(cache.config.torch_dtype))
        print("restored chat-1: its", m.device_prefix_len, "cached tokens hold the KV it computed")


if __name__ == "__main__":
    asyncio.run(main())
