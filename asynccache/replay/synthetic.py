"""The built-in synthetic workload: shared system prompts, documents and multi-turn chats.

Seeded and deterministic. Each conversation starts from one of a few system prompts, often
quotes one of a set of shared documents, and then grows turn by turn: every turn's prompt is the
previous prompt plus the previous answer plus a new user message, as a chat engine sends it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from asynccache.replay.formats import TraceRequest


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    conversations: int = 120
    system_prompts: int = 4
    system_tokens: tuple[int, int] = (300, 1200)
    documents: int = 12
    document_tokens: tuple[int, int] = (500, 3000)
    document_share: float = 0.5
    turns: tuple[int, int] = (1, 6)
    user_tokens: tuple[int, int] = (20, 300)
    answer_tokens: tuple[int, int] = (30, 400)
    rate_per_s: float = 20.0  # conversation starts per second (Poisson)
    think_s: tuple[float, float] = (0.5, 5.0)
    seed: int = 0


def synthetic_trace(spec: SyntheticSpec | None = None) -> Iterator[TraceRequest]:
    spec = spec or SyntheticSpec()
    rng = np.random.default_rng(spec.seed)
    vocab = 50_000

    def span(bounds: tuple[int, int]) -> np.ndarray:
        return rng.integers(0, vocab, size=int(rng.integers(bounds[0], bounds[1] + 1))).astype(np.uint32)

    prompts = [span(spec.system_tokens) for _ in range(spec.system_prompts)]
    docs = [span(spec.document_tokens) for _ in range(spec.documents)]
    reqs: list[TraceRequest] = []
    start = 0.0
    for c in range(spec.conversations):
        start += float(rng.exponential(1.0 / spec.rate_per_s))
        ctx = prompts[int(rng.integers(len(prompts)))]
        if rng.random() < spec.document_share:
            ctx = np.concatenate([ctx, docs[int(rng.integers(len(docs)))]])
        t = start
        for turn in range(int(rng.integers(spec.turns[0], spec.turns[1] + 1))):
            ctx = np.concatenate([ctx, span(spec.user_tokens)])
            answer = span(spec.answer_tokens)
            reqs.append(TraceRequest(f"syn-{c}-{turn}", t, ctx, len(answer)))
            ctx = np.concatenate([ctx, answer])
            t += float(rng.uniform(*spec.think_s))
    reqs.sort(key=lambda r: r.arrival)
    return iter(reqs)
