"""Adapters for code asynccache does not own (model libraries, serving engines).

Each submodule needs its own optional dependency and imports it lazily:

* ``asynccache.integrations.hf`` (``pip install 'asynccache[hf]'``): Hugging Face transformers
  models prefilling over KV held by a :class:`~asynccache.HierarchicalCache`.
* ``asynccache.integrations.sglang``: asynccache's storage backends as SGLang's HiCache L3.
"""
