"""One model's KV cache and what it holds: the only code that changes a cache.

A Cache wraps a loaded model (a Backend) and knows, for each sequence, the tokens
it holds from position 0. The loop, the draft-model drafter, calibration and the
engine all go through it: to extend sequence 0, keep the prefix a new context
shares with it, roll back to a length, fork draft-tree branches and fold one back
into sequence 0, and save or restore it for the prompt cache file. Positions follow
from what a sequence holds, so no caller computes one.

What a model's cache can undo is decided here too. `Backend.rollback_limit` is None
when any suffix can be removed (attention caches), k when only the latest k tokens
can (recurrent state kept as k snapshots), 0 when nothing can. A rollback beyond it
clears the cache and replays the kept tokens: slower, exact for any model.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .backend import Backend, Outputs


class Cache:
    def __init__(self, model: Backend):
        self.model = model
        self._seqs: dict[int, list[int]] = {0: []}  # sequence -> its tokens from position 0
        self._dirty = False  # a decode was interrupted: cells past what _seqs lists may exist

    def __len__(self) -> int:
        """Tokens sequence 0 holds."""
        return len(self._seqs[0])

    def tokens(self) -> tuple[int, ...]:
        """What sequence 0 holds (a copy)."""
        return tuple(self._seqs[0])

    def shared_prefix(self, tokens: Sequence[int], limit: int | None = None) -> int:
        """How many leading tokens of `tokens` (at most `limit`) sequence 0 already holds."""
        held = self._seqs[0]
        n = min(len(held), len(tokens), len(tokens) if limit is None else limit)
        head = tokens[:n] if isinstance(tokens, list) else list(tokens[:n])  # no second copy per step
        if held[:n] == head:  # the usual case, compared at C speed
            return n
        return next(i for i in range(n) if held[i] != tokens[i])

    # -- changing it ---------------------------------------------------------

    def keep_prefix(self, tokens: Sequence[int], limit: int | None = None) -> int:
        """Roll back to the longest prefix shared with `tokens` (at most `limit`); its length."""
        n = self.shared_prefix(tokens, limit)
        self.rollback(n)
        return n

    def extend(self, tokens: Sequence[int], outputs: Outputs = "none") -> list[np.ndarray]:
        """Decode `tokens` after what sequence 0 holds (Backend.decode's rows)."""
        self._settle()
        self._dirty = True
        rows = self.model.decode(tokens, len(self._seqs[0]), outputs)
        self._dirty = False
        self._seqs[0].extend(tokens)
        return rows

    def sync(self, tokens: Sequence[int], outputs: Outputs = "none") -> list[np.ndarray]:
        """Make sequence 0 hold exactly `tokens`, decoding only what it does not share with
        them (for "last", at least the last token, whose logits are wanted)."""
        n = self.keep_prefix(tokens, len(tokens) - 1 if outputs == "last" else None)
        return self.extend(tokens[n:], outputs) if len(tokens) > n else []

    def rollback(self, n: int) -> None:
        """Hold positions 0..n-1 only, in every sequence."""
        self._settle()
        held = self._seqs[0]
        if all(len(s) <= n for s in self._seqs.values()):
            return
        if not self._can_undo(len(held) - n):
            self._replay(held[:n])
            return
        self.model.trim(n)
        for seq in self._seqs.values():
            del seq[n:]

    def forget(self) -> None:
        """Hold nothing (before the model is used for something else)."""
        self.rollback(0)

    def decode_tree(self, tokens: Sequence[int], seqs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Score draft-tree tokens in one batch: token i goes into every sequence of seqs[i],
        right after what they hold, and sees what its first one holds before it. One row
        of logits per token."""
        self._settle()
        length = {s: len(held) for s, held in self._seqs.items()}
        positions = []
        for ids in seqs:
            positions.append(length.setdefault(ids[0], 0))
            for s in ids:
                length[s] = positions[-1] + 1
        self._dirty = True
        rows = self.model.decode_branches(tokens, positions, seqs)
        self._dirty = False
        for token, ids in zip(tokens, seqs):
            for s in ids:
                self._seqs.setdefault(s, []).append(token)
        return rows

    def fork(self, src: int, dst: int) -> None:
        """Sequence dst holds what sequence src holds (a new draft-tree branch)."""
        self.model.copy_branch(src, dst)
        self._seqs[dst] = list(self._seqs[src])

    def keep_branch(self, seq: int, n: int) -> None:
        """Sequence seq's first n tokens become sequence 0; every other branch is dropped."""
        self._settle()
        kept = self._seqs[seq][:n]
        if not self._can_undo(len(self._seqs[seq]) - n):
            self._replay(kept)
            return
        self.model.keep_branch(seq, n)
        self._seqs = {0: kept}

    # -- the prompt cache file -------------------------------------------------

    def save(self) -> bytes:
        """Sequence 0's state as llama.cpp serialises it (it holds self.tokens())."""
        return self.model.save_state()

    def restore(self, state: bytes, tokens: Sequence[int]) -> bool:
        """Replace the cache with a saved state holding `tokens`; False (and an empty cache)
        when the model cannot load it."""
        self._settle()
        loaded = self.model.load_state(state, len(tokens))
        self._seqs = {0: list(tokens) if loaded else []}
        return loaded

    # -- keeping the bookkeeping true ------------------------------------------

    def _settle(self) -> None:
        """After an interrupted decode the model may hold cells this object does not list:
        they go before anything else happens."""
        if self._dirty:
            self._dirty = False
            self._seqs = {0: self._seqs[0]}
            self.model.keep_branch(0, len(self._seqs[0]))

    def _can_undo(self, n_tokens: int) -> bool:
        """Whether the model can drop its latest `n_tokens` (the one place this is decided)."""
        limit = self.model.rollback_limit
        return n_tokens <= 0 or limit is None or n_tokens <= limit

    def _replay(self, tokens: list[int]) -> None:
        """Clear the cache and decode `tokens` again: the rollback every model can do."""
        self.model.trim(0)
        self._seqs = {0: []}
        self.extend(tokens)
