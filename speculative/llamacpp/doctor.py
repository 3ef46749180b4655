"""`speculate doctor`: is this llama.cpp build exact for greedy speculation?

Greedy speculative output equals target-only output token for token exactly when
the target scores a position the same alone and inside a verify batch. That is a
property of the build and its settings (kernels chosen by batch size, flash
attention; see docs/exactness-and-builds.md), so it is measured: tokens
are scored one at a time, then as batches of 2..16 tokens, after a short cache and
after one past 256 tokens (where the attention window becomes 512 cells and CPU
flash attention changes its path), and every position's logits are compared bit
for bit. Every position, not just the first: a recurrent layer carries its state
through the batch, and some (Qwen3.5's gated delta-net) switch to a chunked kernel
for batches.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from speculative.decoding.cache import Cache

BATCHES = range(2, 17)
DEPTHS = (16, 300)


@dataclass(frozen=True)
class Check:
    cached: int           # tokens in the cache before the scored position
    batch: int            # tokens scored in one batch
    max_abs_diff: float   # largest |logit one at a time - logit in the batch| over its positions; 0.0: bit-identical

    def to_dict(self) -> dict:
        return asdict(self)


def probe_tokens(rng: np.random.Generator, n_vocab: int, n: int) -> list[int]:
    """n random tokens away from both ends of the vocabulary (where special tokens are)."""
    margin = min(100, n_vocab // 4)
    return rng.integers(margin, n_vocab - margin, n).tolist()


def batch_invariance(cache: Cache, batches=BATCHES, depths=DEPTHS, seed: int = 0) -> list[Check]:
    """Score positions one at a time and inside each batch, at each cache depth that fits."""
    model = cache.model
    rng = np.random.default_rng(seed)
    checks = []
    for cached in depths:
        if cached + max(batches) > model.n_ctx:
            continue
        tokens = probe_tokens(rng, model.n_vocab, cached + max(batches))
        cache.forget()
        cache.extend(tokens[:cached])
        cache.checkpoint()  # a recurrent state comes back here after each batch
        alone = np.array([cache.extend([t], "last")[0].copy()  # rows are views until the next decode
                          for t in tokens[cached : cached + max(batches)]])
        for b in batches:
            cache.rollback(cached)
            rows = np.array(cache.extend(tokens[cached : cached + b], "all"))
            checks.append(Check(cached, b, float(np.abs(rows - alone[:b]).max())))
    cache.forget()
    return checks
