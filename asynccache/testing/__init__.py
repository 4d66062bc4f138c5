"""Testing tools for code that uses asynccache: a pytest plugin and the helpers behind it.

The plugin (``asynccache.testing.plugin``, registered as ``asynccache`` through the
``pytest11`` entry point) provides the ``asynccache_*`` fixtures; see ``docs/testing.md``.
The helpers work without pytest too:

* :func:`faults` wraps a storage backend so that it injects I/O errors, delays, corruption;
* :func:`stuck_pages` makes reads of some pages of a file backend hang (FIFOs at their names);
* :class:`TcpProxy` passes, delays or black-holes the traffic to a server (an S3 endpoint);
* :func:`crafted_namespace` builds the crafted-namespace probe (a default-namespace prompt
  whose first page is a namespace's key-seed preimage); :func:`storage_keys` names a
  prompt's storage pages;
* :func:`cancel_at` / :func:`sweep_cancellations` cancel a coroutine at its k-th await;
* :class:`KVFactory` makes deterministic prompts and KV and checks served KV bit for bit;
* :func:`assert_quiescent` / :func:`find_leaks` / :func:`close_and_check` are the teardown
  checks, callable in the middle of a test;
* :func:`small_config` / :data:`DEFAULT_CONFIG`: the small pools the fixtures use.

The namespace is lazy: importing it (as pytest does at start-up) loads neither torch nor the
engine.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "CHECKS",
    "DEFAULT_CONFIG",
    "CacheFactory",
    "CancelOutcome",
    "CraftedNamespace",
    "FaultInjectingBackend",
    "FaultKind",
    "FaultRule",
    "KVFactory",
    "KVMismatchError",
    "LeakError",
    "S3Server",
    "Served",
    "StuckPages",
    "TcpProxy",
    "assert_quiescent",
    "cancel_at",
    "close_and_check",
    "crafted_namespace",
    "faults",
    "find_leaks",
    "small_config",
    "storage_keys",
    "stuck_pages",
    "sweep_cancellations",
]

_WHERE = {
    "CHECKS": "asynccache.testing.leaks",
    "CraftedNamespace": "asynccache.testing.keys",
    "TcpProxy": "asynccache.testing.netproxy",
    "crafted_namespace": "asynccache.testing.keys",
    "DEFAULT_CONFIG": "asynccache.testing.configs",
    "CacheFactory": "asynccache.testing.plugin",
    "CancelOutcome": "asynccache.testing.cancel",
    "FaultInjectingBackend": "asynccache.storage.faults",
    "FaultKind": "asynccache.storage.faults",
    "FaultRule": "asynccache.storage.faults",
    "KVFactory": "asynccache.testing.kv",
    "KVMismatchError": "asynccache.testing.kv",
    "LeakError": "asynccache.testing.leaks",
    "S3Server": "asynccache.testing.s3",
    "Served": "asynccache.testing.kv",
    "assert_quiescent": "asynccache.testing.leaks",
    "cancel_at": "asynccache.testing.cancel",
    "close_and_check": "asynccache.testing.leaks",
    "faults": "asynccache.testing.faultwrap",
    "find_leaks": "asynccache.testing.leaks",
    "small_config": "asynccache.testing.configs",
    "StuckPages": "asynccache.testing.stuck",
    "storage_keys": "asynccache.testing.keys",
    "stuck_pages": "asynccache.testing.stuck",
    "sweep_cancellations": "asynccache.testing.cancel",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'asynccache.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
