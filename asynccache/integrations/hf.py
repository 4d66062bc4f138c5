"""Hugging Face ``transformers`` causal LMs over asynccache's KV (``pip install 'asynccache[hf]'``).

A request's cached prefix is never recomputed: its KV is read from the cache's device pool
(layout ``(layers, 2, n, kv_heads, head_dim)``, the keys after RoPE, as the model caches them)
into the model's own cache object, and the model prefills only the uncached suffix; the
suffix's KV is then written into the request's slots. See ``docs/integrations.md``.

* :func:`load_model`: a local checkpoint directory (``from_pretrained``, no download) or, with no
  path, a small Llama built from a seeded :class:`~transformers.LlamaConfig`; fp32, eval mode.
* :func:`cache_config`: a :class:`~asynccache.CacheConfig` whose KV shape matches the model.
* :class:`ModelRunner`: the prefill over pages (layer ``i`` waits for layer ``i`` of a load-back
  only), greedy decoding, and the full recompute it is checked against.
* :func:`serve_turn`: one request through the cache: admit -> prefetch -> load-back -> prefill
  of the suffix -> write its KV -> greedy decode -> ``cache_finished_req``.

transformers is imported when a function needs it, so importing this module without it works.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from asynccache import CacheConfig, HierarchicalCache

__all__ = [
    "LayerLoad",
    "ModelRunner",
    "PrefillResult",
    "TurnResult",
    "cache_config",
    "load_model",
    "serve_turn",
    "tiny_llama_config",
]

#: How long the model's thread waits for one layer's prefix KV before giving up (a guard
#: against a scheduler that never delivers it, not a tuning knob).
LAYER_WAIT_S = 120.0


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "asynccache.integrations.hf needs transformers: pip install 'asynccache[hf]'"
        ) from exc
    return transformers


# ---------------------------------------------------------------------------- the model


def tiny_llama_config(*, num_layers: int = 2, hidden_size: int = 64, num_heads: int = 4,
                      num_kv_heads: int = 2, vocab_size: int = 512, **overrides: Any) -> Any:
    """A CPU-sized Llama config (grouped-query attention: ``num_kv_heads`` < ``num_heads``)."""
    tf = _transformers()
    kw: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": hidden_size, "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    kw.update(overrides)
    return tf.LlamaConfig(**kw)


def load_model(source: str | Path | None = None, *, seed: int = 0, config: Any = None,
               attn_implementation: str = "eager") -> Any:
    """A causal LM in fp32 and eval mode.

    ``source``: a local checkpoint directory (``save_pretrained`` layout; nothing is downloaded).
    Without it, a model built from ``config`` (default :func:`tiny_llama_config`) with weights
    drawn from ``seed`` (the global torch RNG is left as it was).
    """
    tf = _transformers()
    if source is not None:
        model = tf.AutoModelForCausalLM.from_pretrained(
            str(source), dtype=torch.float32, local_files_only=True,
            attn_implementation=attn_implementation)
    else:
        cfg = config if config is not None else tiny_llama_config()
        cfg._attn_implementation = attn_implementation
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model.eval()


def _text_config(model: Any) -> Any:
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def model_kv_shape(model: Any) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of ``model``'s KV cache."""
    cfg = _text_config(model)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return int(cfg.num_hidden_layers), int(kv_heads), int(head_dim)


def cache_config(model: Any, **overrides: Any) -> CacheConfig:
    """A :class:`~asynccache.CacheConfig` whose KV shape is ``model``'s, in float32, with
    ``max_token_id`` at the top of its vocabulary; ``overrides`` set everything else."""
    from asynccache import CacheConfig

    layers, heads, dim = model_kv_shape(model)
    kw: dict[str, Any] = {"num_layers": layers, "num_heads": heads, "head_dim": dim,
                          "dtype": "float32",
                          "max_token_id": int(_text_config(model).vocab_size) - 1}
    kw.update(overrides)
    return CacheConfig(**kw)


# ---------------------------------------------------------------------------- prefill over pages


class LayerLoad(Protocol):
    """What the prefill waits on: :class:`asynccache.engine.loadback.LoadBack` is one."""

    def layer(self, i: int) -> Any: ...


@dataclass
class PrefillResult:
    logits: torch.Tensor  # (suffix tokens, vocab)
    kv: torch.Tensor  # the suffix's KV, (layers, 2, n, kv_heads, head_dim)
    model_cache: Any  # the model's cache object, holding prefix + suffix (decode continues it)
    seconds: float  # from the call to the logits (waits for loads included)


def _paged_layer_class() -> type:
    """A ``DynamicLayer`` that reports the prefix length from the start (so the model builds
    the right mask and positions) and takes the prefix's KV only when the layer's attention
    first uses it: that is where layer ``i`` waits for layer ``i`` of a load-back."""
    from transformers import cache_utils

    base: Any = cache_utils.DynamicLayer

    class PagedPrefixLayer(base):  # type: ignore[misc]
        def __init__(self, prefix_len: int,
                     fetch: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None) -> None:
            super().__init__()
            self._prefix_len = prefix_len
            self._fetch = fetch if prefix_len else None

        def get_seq_length(self) -> int:
            if self._fetch is not None:
                return self._prefix_len
            return int(super().get_seq_length())

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if self._fetch is not None:
                k, v = self._fetch()
                self._fetch = None
                self.device = key_states.device
                self.keys = k.to(device=key_states.device, dtype=key_states.dtype)
                self.values = v.to(device=value_states.device, dtype=value_states.dtype)
                self.is_initialized = True
            out: tuple[torch.Tensor, torch.Tensor] = super().update(
                key_states, value_states, *args, **kwargs)
            return out

    return PagedPrefixLayer


class ModelRunner:
    """Runs ``model`` over KV held by a :class:`~asynccache.HierarchicalCache`.

    The forward runs in a worker thread (the event loop keeps serving other requests and
    completing copies); the loop hands it layer ``i``'s prefix KV as soon as that layer has
    landed on the device.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.num_layers, self.num_kv_heads, self.head_dim = model_kv_shape(model)
        self.vocab_size = int(_text_config(model).vocab_size)
        params = inspect.signature(model.forward).parameters
        # transformers >= 5.x names it ``cache``; earlier versions ``past_key_values``.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._layer_cls: type | None = None

    # -- plain forwards (the reference) ---------------------------------------------------------
    def _forward(self, ids: Sequence[int], model_cache: Any) -> Any:
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.model.device)
        with torch.no_grad():
            return self.model(input_ids=x, use_cache=True, **{self._cache_kw: model_cache})

    def new_model_cache(self) -> Any:
        return _transformers().DynamicCache(config=self.model.config)

    def full_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """Logits of every position of ``tokens``, computed from scratch (no asynccache)."""
        x = torch.tensor([list(tokens)], dtype=torch.long, device=self.model.device)
        with torch.no_grad():
            logits: torch.Tensor = self.model(input_ids=x, use_cache=False).logits
        return logits[0].float().cpu()

    def prefill_uncached(self, tokens: Sequence[int]) -> PrefillResult:
        """Full prefill of ``tokens`` without asynccache (the baseline): every token computed."""
        t0 = time.perf_counter()
        mc = self.new_model_cache()
        logits = self._forward(tokens, mc).logits[0].float().cpu()
        kv = torch.stack([self._layer_kv(mc, i, 0) for i in range(self.num_layers)])
        return PrefillResult(logits, kv, mc, time.perf_counter() - t0)

    def generate_uncached(self, tokens: Sequence[int], new_tokens: int,
                          ) -> tuple[torch.Tensor, list[int]]:
        """Full prefill of ``tokens`` (no asynccache), then greedy decoding: (prefill logits,
        the ``new_tokens`` generated ids)."""
        res = self.prefill_uncached(tokens)
        return res.logits, self.decode(res.model_cache, res.logits[-1], new_tokens)

    def decode(self, model_cache: Any, last_logits: torch.Tensor, new_tokens: int) -> list[int]:
        """Greedy: ``new_tokens`` ids continuing ``model_cache`` from ``last_logits``."""
        out: list[int] = []
        logits = last_logits
        for i in range(new_tokens):
            tok = int(torch.argmax(logits).item())
            out.append(tok)
            if i + 1 < new_tokens:
                logits = self._forward([tok], model_cache).logits[0, -1].float().cpu()
        return out

    # -- prefill over the cache's pages ---------------------------------------------------------
    def _read_layer(self, cache: HierarchicalCache, idx: torch.Tensor | None,
                    i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s prefix KV as the model caches it: (1, kv_heads, n, head_dim) each.

        The cache's public ``read_kv`` reads every layer at once; one layer is read from the
        device pool's tensor (``cache.device_pool.kv``: layers x K/V x slots x heads x dim)."""
        assert idx is not None
        kv = cache.device_pool.kv[i].index_select(1, idx.to(cache.device_pool.kv.device))
        k, v = kv[0].transpose(0, 1).unsqueeze(0), kv[1].transpose(0, 1).unsqueeze(0)
        dev = self.model.device
        return k.to(dev, copy=True), v.to(dev, copy=True)

    async def prefill(self, cache: HierarchicalCache, prefix_slots: Any, suffix: Sequence[int],
                      *, load: LayerLoad | None = None,
                      on_layer: Callable[[int], None] | None = None) -> PrefillResult:
        """Prefill ``suffix`` after the prefix whose KV sits in device ``prefix_slots``.

        ``load``: a load-back still copying part of the prefix (``await load.layer(i)`` before
        layer ``i``'s KV is read); ``None`` when the prefix is already on the device.
        ``on_layer(i)``: called (in the model's thread) when layer ``i`` takes its prefix KV.
        """
        t0 = time.perf_counter()
        if not len(suffix):
            raise ValueError("prefill needs at least one token to compute")
        slots = np.asarray(prefix_slots, dtype=np.int64)
        p = len(slots)
        idx = torch.tensor(slots) if p else None
        L = self.num_layers
        futs: list[concurrent.futures.Future[tuple[torch.Tensor, torch.Tensor]]] = [
            concurrent.futures.Future() for _ in range(L)]
        if self._layer_cls is None:
            self._layer_cls = _paged_layer_class()
        cls = self._layer_cls

        def fetch(i: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
            def get() -> tuple[torch.Tensor, torch.Tensor]:
                kv = futs[i].result(timeout=LAYER_WAIT_S)
                if on_layer is not None:
                    on_layer(i)
                return kv
            return get

        from transformers.cache_utils import Cache

        model_cache = Cache(layers=[cls(p, fetch(i)) for i in range(L)])
        work = asyncio.ensure_future(asyncio.to_thread(self._forward, list(suffix), model_cache))
        try:
            if p:
                for i in range(L):
                    if load is not None:
                        await load.layer(i)
                    futs[i].set_result(self._read_layer(cache, idx, i))
            out = await asyncio.shield(work)  # (a cancel must not orphan the model's thread)
        except BaseException as exc:
            for f in futs:
                if not f.done():
                    f.set_exception(RuntimeError(f"prefix KV not delivered: {exc!r}"))
            if not work.done():  # the thread ends now that every layer has its KV or an error
                await asyncio.wait([work])
            if not work.cancelled():
                work.exception()  # (retrieved: the error raised here is the one that counts)
            raise
        logits = out.logits[0].float().cpu()
        kv = torch.stack([self._layer_kv(model_cache, i, p) for i in range(L)])
        return PrefillResult(logits, kv, model_cache, time.perf_counter() - t0)

    @staticmethod
    def _layer_kv(model_cache: Any, i: int, start: int) -> torch.Tensor:
        layer = model_cache.layers[i]
        k = layer.keys[0, :, start:].transpose(0, 1)
        v = layer.values[0, :, start:].transpose(0, 1)
        return torch.stack([k, v]).float().cpu()  # (2, n, heads, dim)


# ---------------------------------------------------------------------------- one request


@dataclass
class TurnResult:
    tokens: int  # prompt length
    device_hit: int  # prefix found on the device at admission
    fetched: int  # tokens prefetched from storage (L3 -> L2)
    loaded: int  # tokens loaded back host -> device (L2 -> L1)
    model_prefix: int  # tokens whose KV the model read from the cache
    computed: int  # tokens the model prefilled
    logits: torch.Tensor  # prefill logits of the computed tokens
    output: list[int]  # greedy tokens
    ttft_s: float  # admission to the first token's logits
    layerwise: bool  # the prefill overlapped a load-back layer by layer


async def serve_turn(cache: HierarchicalCache, runner: ModelRunner, tokens: Sequence[int], *,
                     new_tokens: int = 4, layerwise: bool = True,
                     prefetch_policy: str | None = None) -> TurnResult:
    """Serve one prompt through ``cache``: admit -> prefetch (when storage is attached) ->
    load-back -> prefill of the uncached suffix over the cached prefix's KV -> write the
    suffix's KV into the request's slots -> greedy decode -> ``cache_finished_req``.

    ``layerwise``: start the host hit's load-back and let layer ``i`` of the prefill wait for
    layer ``i`` of the copy only (``cache.begin_load_back_request``, then
    ``finish_load_back_request``); otherwise wait for the whole load
    (``cache.load_back_request``). A request whose whole prompt is cached recomputes its last
    token (the model needs its logits) without writing its KV again.
    """
    toks = [int(t) for t in tokens]
    t0 = time.perf_counter()
    req = cache.admit(toks)
    lb: Any = None
    try:
        device_hit = req.prefix_len
        fetched = 0
        if cache.storage is not None:
            fetched = await cache.prefetch_request(req, policy=prefetch_policy)
        before = req.prefix_len
        if layerwise:
            lb = cache.begin_load_back_request(req)  # req.prefix_len covers the load now
        overlapped = lb is not None
        if lb is None:
            await cache.load_back_request(req)
        loaded = req.prefix_len - before
        prefix = req.prefix_len
        model_prefix = min(prefix, len(toks) - 1)
        res = await runner.prefill(cache, req.slots[:model_prefix], toks[model_prefix:], load=lb)
        if lb is not None:
            await cache.finish_load_back_request(req, lb)  # committed: the prefix is pinned
            lb = None
        new = await cache.extend(req, len(toks) - prefix)
        ttft = time.perf_counter() - t0
        if len(new):
            cache.write_kv(new, res.kv[:, :, prefix - model_prefix:])
        output = await asyncio.to_thread(runner.decode, res.model_cache, res.logits[-1],
                                         new_tokens)
    except BaseException:
        if lb is not None:
            cache.release_load(lb)
        if not req.finished:
            cache.abort_req(req)
        raise
    cache.cache_finished_req(req)
    return TurnResult(tokens=len(toks), device_hit=device_hit, fetched=fetched, loaded=loaded,
                      model_prefix=model_prefix, computed=len(toks) - model_prefix,
                      logits=res.logits, output=output, ttft_s=ttft, layerwise=overlapped)
