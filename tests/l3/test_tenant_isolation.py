"""Namespaces never share storage objects, even against crafted token ids (issue 23 item 1).

A default-namespace prompt whose first page is a namespace's seed preimage (read as uint32
token ids, ~1.6e9) used to get that page's digest equal to the namespace's seed; from then on
its pages had the namespace's storage keys, and a prefetch served the other tenant's KV. The
served KV here is a function of (token, position), so KV from the wrong object fails the check.
"""

from __future__ import annotations

import asyncio
import struct

from asynccache.l3 import StoragePolicy
from asynccache.tree import RadixKey

PS = 16
TAG = b"sglang-cache-namespace-v1"


def _crafted_prefix(extra_key: str) -> list[int]:
    raw = extra_key.encode()
    pre = TAG + b"\x01" + len(raw).to_bytes(8, "little") + raw + b"\x00"
    assert len(pre) == 4 * PS
    return list(struct.unpack(f"<{PS}I", pre))


async def test_crafted_default_prompt_gets_no_tenant_kv(kit, make_cache, make_file_backend) -> None:
    extra = "t" * (4 * PS - len(TAG) - 10)  # fills the page exactly
    prefix = _crafted_prefix(extra)
    body = [int(t) for t in kit.tokens(3, 3 * PS)]
    policy = StoragePolicy(prefetch_threshold=PS)
    a = await make_cache(page_size=PS)
    a.attach_storage(await make_file_backend(a), policy)
    # The tenant's prompt and the attacker's first page both reach storage.
    await kit.write_sequences(a, [RadixKey(body, extra_key=extra), prefix])
    # A fresh cache on the same store serves the crafted prompt: only its own first page comes
    # from storage, and every token it serves is verified against its own positions.
    b = await make_cache(page_size=PS)
    b.attach_storage(await make_file_backend(b), policy)
    r = await kit.serve(b, [*prefix, *body])
    assert (r.fetched, r.loaded) == (PS, PS)
    await asyncio.wait_for(b.flush(), kit.TIMEOUT)
    await asyncio.wait_for(b.storage.drain(), kit.TIMEOUT)
    # The same process, with the first page cached in its tree: it fetches the crafted prompt's
    # own later pages (B just wrote them under their own keys), verified bit for bit by serve;
    # under the old chain those keys were the tenant's, B skipped them as stored, and A read the
    # tenant's KV here.
    r = await kit.serve(a, [*prefix, *body])
    assert (r.device, r.fetched) == (PS, 3 * PS)
    tenant_keys = kit.page_keys(body, PS, namespace=extra)
    assert not set(tenant_keys) & set(kit.page_keys([*prefix, *body], PS))
