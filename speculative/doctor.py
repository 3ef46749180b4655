"""`speculate doctor`: is this llama.cpp build exact for greedy speculation?

Greedy speculative output equals target-only output token for token exactly when
the target scores a position the same alone and inside a verify batch. That is a
property of the build and its settings (kernels chosen by batch size, flash
attention; see README, "Exactness and the CPU build"), so it is measured: a token
is scored alone, then as the first row of batches of 2..16 tokens, after a short
cache and after one past 256 tokens (where the attention window becomes 512 cells
and CPU flash attention changes its path), and the logits are compared bit for bit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .cache import Cache

BATCHES = range(2, 17)
DEPTHS = (16, 300)


@dataclass(frozen=True)
class Check:
    cached: int           # tokens in the cache before the scored position
    batch: int            # the batch the position was first of
    max_abs_diff: float   # largest |logit alone - logit in the batch|; 0.0: bit-identical

    def to_dict(self) -> dict:
        return asdict(self)


def batch_invariance(cache: Cache, batches=BATCHES, depths=DEPTHS, seed: int = 0) -> list[Check]:
    """Score one position alone and inside each batch, at each cache depth that fits."""
    model = cache.model
    rng = np.random.default_rng(seed)
    checks = []
    for cached in depths:
        if cached + max(batches) > model.n_ctx:
            continue
        tokens = rng.integers(100, model.n_vocab - 100, cached + max(batches)).tolist()
        cache.forget()
        cache.extend(tokens[:cached])
        alone = cache.extend([tokens[cached]], "last")[0].copy()
        for b in batches:
            cache.rollback(cached)
            (row, *_) = cache.extend(tokens[cached : cached + b], "all")
            checks.append(Check(cached, b, float(np.abs(row - alone).max())))
    cache.forget()
    return checks
