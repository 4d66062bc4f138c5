"""The tree benchmark workload, shared by bench_tree.py and its SGLang comparator.

20,000 sequences of 1,000 tokens: one of 16 system prompts (200 tokens) + one of 16 documents
per prompt (300) + a unique random tail (500), from a fixed seed. Pure numpy so it runs in any
environment.
"""

from __future__ import annotations

import numpy as np

VOCAB = 32000


def make_sequences(num: int = 20_000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, VOCAB, size=(16, 200))
    docs = rng.integers(0, VOCAB, size=(16, 16, 300))
    tails = rng.integers(0, VOCAB, size=(num, 500))
    p = rng.integers(0, 16, size=num)
    d = rng.integers(0, 16, size=num)
    seqs = np.concatenate([prompts[p], docs[p, d], tails], axis=1)
    return seqs.astype(np.int64)
