"""Buffer-only host mode: host memory as transient staging between device and storage.

Modules: ``pipeline`` (:class:`BufferModePipeline`: write intents, staging budgets and the
storage writes), ``reads`` (prefetches into parked host bounces and their load-backs), ``swa``
(the SWA side of FULL+SWA caches). Prefetch rules, pages and existence beliefs come from
:mod:`asynccache.l3`.
"""

from asynccache.buffer.pipeline import BufferModePipeline
from asynccache.buffer.reads import BufferFetch, StagedReads
from asynccache.buffer.swa import SWABuffer

__all__ = ["BufferFetch", "BufferModePipeline", "SWABuffer", "StagedReads"]
