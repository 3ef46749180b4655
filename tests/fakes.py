"""A fake backend for the fast tests of the pure algorithm.

ToyModel is a deterministic "language model" over a tiny vocabulary: the logits
of the next token are a fixed random function of the last two tokens. The fake
backend keeps a real list as its KV cache and fails loudly on any decode that is
not contiguous with it, so a wrong rollback cannot go unnoticed. With a
`rollback_limit` it behaves as llama.cpp's recurrent state does: a trim may drop at
most that many of the latest decode's tokens but not all of them, once, or everything; checkpoints
(save_state(partial=True)) restore only over the cells kept before them.
"""

from __future__ import annotations

import json
from typing import Iterator

import numpy as np

from speculative.decoding import loop
from speculative.decoding.scheduler import run_alone

EOG = 0


class ToyModel:
    def __init__(self, vocab: int = 24, seed: int = 0, eog_bias: float = -4.0):
        rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.table = rng.normal(scale=4.0, size=(vocab * vocab, vocab)).astype(np.float32)
        self.table[:, EOG] += eog_bias  # end-of-generation is rare, not impossible

    def logits(self, context: list[int]) -> np.ndarray:
        a = context[-2] if len(context) > 1 else 1
        return self.table[a * self.vocab + context[-1]].copy()

    def perturbed(self, fraction: float, seed: int) -> "ToyModel":
        """A draft that agrees with this model on about (1 - fraction) of contexts."""
        other = ToyModel.__new__(ToyModel)
        other.vocab = self.vocab
        other.table = self.table.copy()
        rng = np.random.default_rng(seed)
        rows = rng.random(len(self.table)) < fraction
        other.table[rows] = rng.normal(scale=4.0, size=(int(rows.sum()), self.vocab))
        return other


class FakeBackend:
    rollback_limit: int | None = None  # set to test a cache that can undo only so much

    def __init__(self, model: ToyModel, n_ctx: int = 256, n_batch: int = 64, name: str = "fake", n_seq: int = 1):
        self.model = model
        self.name = name
        self.n_vocab = model.vocab
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.n_seq = n_seq
        self.cache: list[int] = []   # sequence 0
        self.branches: dict[int, list[int]] = {}  # sequences 1..n_seq-1
        self.batches: list[int] = []   # sizes of the batches scored with all outputs
        self.max_pos = -1
        self.undoable = 0  # with a rollback_limit: tokens of the latest decode a trim may drop
        self.checkpoints = {"saved": 0, "restored": 0}

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        return [1 + (b % (self.n_vocab - 1)) for b in text.encode()]

    def token_bytes(self, token: int) -> bytes:
        return bytes([96 + token])

    def is_eog(self, token: int) -> bool:
        return token == EOG

    def eog_tokens(self) -> np.ndarray:
        return np.array([EOG])

    def decode(self, tokens, pos, outputs):
        tokens = list(tokens)
        assert pos == len(self.cache), f"decode at {pos} but the cache holds {len(self.cache)}"
        assert pos + len(tokens) <= self.n_ctx, "decode past the context"
        if outputs == "all":
            assert len(tokens) <= self.n_batch
            self.batches.append(len(tokens))
        rows = []
        for t in tokens:
            self.cache.append(t)
            rows.append(self.model.logits(self.cache))
        self.max_pos = max(self.max_pos, len(self.cache) - 1)
        self.undoable = len(tokens) - 1  # the state before the decode is not kept
        return {"all": rows, "last": rows[-1:], "none": []}[outputs]

    def trim(self, n_keep: int) -> None:
        assert 0 <= n_keep <= len(self.cache)
        if self.rollback_limit is not None and 0 < n_keep < len(self.cache):
            drop = len(self.cache) - n_keep
            assert drop <= min(self.rollback_limit, self.undoable), \
                f"a recurrent state cannot drop {drop} tokens (limit {self.rollback_limit}, {self.undoable} undoable)"
            self.undoable = 0
        for seq in (self.cache, *self.branches.values()):
            del seq[n_keep:]

    def _seq(self, s: int) -> list[int]:
        assert 0 <= s < self.n_seq, f"sequence {s} of {self.n_seq}"
        return self.cache if s == 0 else self.branches.setdefault(s, [])

    def decode_branches(self, tokens, positions, seqs):
        assert len(tokens) == len(positions) == len(seqs) <= self.n_batch
        self.batches.append(len(tokens))
        rows = []
        for token, pos, ss in zip(tokens, positions, seqs):
            for s in ss:
                assert pos == len(self._seq(s)), f"sequence {s}: decode at {pos} but it holds {len(self._seq(s))}"
            assert pos < self.n_ctx, "decode past the context"
            rows.append(self.model.logits(self._seq(ss[0]) + [token]))
            for s in ss:
                self._seq(s).append(token)
            self.max_pos = max(self.max_pos, pos)
        self.undoable = len(tokens) - 1
        return rows

    def copy_branch(self, src: int, dst: int) -> None:
        assert dst != 0
        self._seq(dst)[:] = self._seq(src)

    def save_state(self, partial: bool = False) -> bytes:
        self.checkpoints["saved"] += partial
        return json.dumps(self.cache).encode()

    def load_state(self, data: bytes, n_tokens: int, partial: bool = False) -> bool:
        tokens = json.loads(data)
        assert len(tokens) == n_tokens
        if partial:  # the attention cells before it were kept: they must be the same
            assert self.cache[:n_tokens] == tokens, "a checkpoint restored over other tokens"
            self.checkpoints["restored"] += 1
        self.cache[:] = tokens
        self.undoable = 0
        return True

    def keep_branch(self, seq: int, n_keep: int) -> None:
        kept = self._seq(seq)[:n_keep]
        assert len(kept) == n_keep
        self.cache[:] = kept
        self.branches.clear()


def plain_decode(model: ToyModel, prompt: list[int], n: int, sampler, n_ctx: int = 256) -> list[int]:
    """Target-only decoding without any of speculate's machinery: the reference."""
    tokens = list(prompt)
    out: list[int] = []
    while len(out) < n and len(tokens) < n_ctx:
        token = sampler.sample(model.logits(tokens), tokens)
        if token == EOG:
            break
        tokens.append(token)
        out.append(token)
    return out


class Clock:
    """Time that passes only while a fake model works, as long as the test says (patched in
    for the `time` of the loop, auto and calibration, it makes every timing they take exact,
    whatever else runs on the machine): scoring a batch of b tokens (a verify) takes
    verify_costs[b - 1] (or verify_costs(b), a function); with `redecode`, so does decoding b
    tokens without drafts (the prompt, and a recurrent state's accepted tokens decoded again
    after a restore); copying a recurrent state into a checkpoint takes `save`, restoring one
    `restore`."""

    def __init__(self, verify_costs, save: float = 0.0, restore: float = 0.0, redecode: bool = False):
        self.now = 0.0
        self.verify_costs = verify_costs
        self.save, self.restore, self.redecode = save, restore, redecode

    def cost(self, b: int) -> float:
        return self.verify_costs(b) if callable(self.verify_costs) else self.verify_costs[b - 1]

    def perf_counter(self) -> float:
        return self.now

    def timed(self, backend: FakeBackend) -> FakeBackend:
        decode, decode_branches = backend.decode, backend.decode_branches
        save_state, load_state = backend.save_state, backend.load_state

        def verify(tokens, positions, seqs):
            self.now += self.cost(len(tokens))
            return decode_branches(tokens, positions, seqs)

        def decoded(tokens, pos, outputs):
            self.now += self.cost(len(tokens)) if self.redecode and len(tokens) else 0.0
            return decode(tokens, pos, outputs)

        def saved(partial=False):
            self.now += self.save if partial else 0.0
            return save_state(partial)

        def restored(data, n_tokens, partial=False):
            self.now += self.restore if partial else 0.0
            return load_state(data, n_tokens, partial)

        backend.decode_branches, backend.decode = verify, decoded
        backend.save_state, backend.load_state = saved, restored
        return backend


def generate(*args, **kwargs) -> Iterator:
    """The loop's events (loop.generate), its decodes run through a scheduler of its own
    (scheduler.run_alone), as a request alone runs."""
    return run_alone(loop.generate(*args, **kwargs))
