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

Requests at once (serve's and batch's -np) ask one more thing of the build and the
configuration: that a request's logits stay the same with other requests' tokens in its
batches and, in a unified KV cache, their cells among its own (attention's reductions run
over the cells in order). `sequence_invariance` measures that.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from speculative.decoding.cache import Cache
from speculative.decoding.scheduler import run
from speculative.llamacpp.decode import Part
from speculative.llamacpp.model import LlamaModel

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


def batch_invariance(cache: Cache, batches=BATCHES, depths=DEPTHS, seed: int = 0,
                     progress: Callable[[str], None] | None = None) -> list[Check]:
    """Score positions one at a time and inside each batch, at each cache depth that fits;
    `progress` hears which, as each begins."""
    model = cache.model
    rng = np.random.default_rng(seed)
    say = progress or (lambda text: None)
    checks = []
    for cached in depths:
        if cached + max(batches) > model.n_ctx:
            continue
        tokens = probe_tokens(rng, model.n_vocab, cached + max(batches))
        say(f"{cached} cached, {max(batches)} positions one at a time")
        cache.forget()
        run(cache.extend(tokens[:cached]))
        cache.checkpoint()  # a recurrent state comes back here after each batch
        alone = np.array([run(cache.extend([t], "last"))[0].copy()  # rows are views until the next decode
                          for t in tokens[cached : cached + max(batches)]])
        for i, b in enumerate(batches, 1):
            say(f"{cached} cached, a batch of {b} ({i}/{len(batches)})")
            cache.rollback(cached)
            rows = np.array(run(cache.extend(tokens[cached : cached + b], "all")))
            checks.append(Check(cached, b, float(np.abs(rows - alone[:b]).max())))
    cache.forget()
    return checks


@dataclass(frozen=True)
class SequenceCheck:
    others: int           # other requests' sequences in the cache and in every batch
    positions: int        # positions of the probed sequence compared
    max_abs_diff: float   # largest |logit alone - logit among the others|; 0.0: bit-identical

    def to_dict(self) -> dict:
        return asdict(self)


def sequence_invariance(model: LlamaModel, cached: int = 32, probed: int = 8, seed: int = 1,
                        progress: Callable[[str], None] | None = None) -> SequenceCheck:
    """Whether a request's logits stay the same whatever else runs (requests at once, slots.py):
    slot 0's prompt and tokens are scored alone in the cache, then again with every other slot's
    prompt decoded in the same batches (so its cells sit among theirs, as in a unified pool) and
    a token of each other slot beside each of its own. `model` has its n_slots (> 1); `progress`
    hears which of the two runs."""
    rng = np.random.default_rng(seed)
    streams = [probe_tokens(rng, model.n_vocab, cached + probed) for _ in range(model.n_slots)]
    say = progress or (lambda text: None)
    say("alone")
    alone = _slot0_rows(model, streams[:1], cached)
    say("among the others")
    among = _slot0_rows(model, streams, cached)
    model.clear()
    return SequenceCheck(model.n_slots - 1, probed, float(np.abs(alone - among).max()))


def _slot0_rows(model: LlamaModel, streams: list[list[int]], cached: int) -> np.ndarray:
    """Slot 0's rows for its tokens after `cached`, one at a time, with the other streams (slots
    1..) decoded beside it: the prompts token by token interleaved, then a token each per batch."""
    model.clear()

    def part(slot: int, start: int, end: int, outputs: str) -> Part:
        seq = model.memory.slots[slot].base
        return Part(streams[slot][start:end], list(range(start, end)), [(seq,)] * (end - start), outputs, slot)

    for i in range(cached):  # one token of every stream per batch: their cells interleave
        model.decode_parts([part(s, i, i + 1, "none") for s in range(len(streams))])
    rows = []
    for i in range(cached, len(streams[0])):
        out = model.decode_parts([part(s, i, i + 1, "last") for s in range(len(streams))])
        rows.append(out[0][0].copy())  # a view until the next decode
    return np.array(rows)
