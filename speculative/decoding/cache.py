"""One model's KV cache and what it holds: the only code that changes a cache.

A Cache wraps a loaded model (a Backend) and knows, for each sequence, the tokens
it holds from position 0. The loop, the draft-model drafter, calibration and the
engine all go through it: to extend sequence 0, keep the prefix a new context
shares with it, roll back to a length, fork draft-tree branches and fold one back
into sequence 0, and save or restore it for the prompt cache file and --cache-ram
(what a restored state would keep, too: ram_cache.py chooses by it). Positions follow
from what a sequence holds, so no caller computes one.

What a model's cache can undo is decided here too. `Backend.rollback_limit` is None
when any suffix can be removed (attention caches). A recurrent state (Mamba, RWKV,
the recurrent layers of hybrids such as LFM2 or Qwen3.5) is one value per sequence,
overwritten by every token: llama.cpp can undo at most the latest `rollback_limit`
tokens of the latest decode, and not all of them, once (its n_rs_seq snapshots; 0
where the architecture has none). Beyond that, a rollback goes back to a checkpoint (a copy of the
recurrent state taken when the caller said drafted tokens were coming, see
`checkpoint`, or at the end of a prompt, see `mark`: the latest MARKS of those are kept from
one run to the next, so a conversation's next turn or a regenerated answer comes back to the
end of its prompt) and decodes the kept tokens after it again; without one it clears the
cache and decodes everything kept again. Slower, exact for any model: a recurrent
state cannot be cut to any prefix, so what is exact is kept and the rest recomputed.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from speculative.decoding import scheduler
from speculative.decoding.backend import Backend, Decode, Head, HeadDecode, Outputs, Work

MARKS = 2  # a recurrent state's copies at prompt ends kept (this turn's, and the one before)


def _common_prefix(held: list[int], tokens: Sequence[int], n: int) -> int:
    """How many of the first n tokens of `held` and `tokens` agree."""
    head = tokens[:n] if isinstance(tokens, list) else list(tokens[:n])  # no second copy per step
    if held[:n] == head:  # the usual case, compared at C speed
        return n
    return next(i for i in range(n) if held[i] != tokens[i])


def _latest(checkpoints: Sequence[tuple[int, bytes]], n: float = float("inf")) -> tuple[int, bytes]:
    """The checkpoint at the greatest length up to n, or (0, b"") where none is: nothing kept."""
    return max((c for c in checkpoints if c[0] <= n), key=lambda c: c[0], default=(0, b""))


class Cache:
    def __init__(self, model: Backend):
        self.model = model
        self._seqs: dict[int, list[int]] = {0: []}  # sequence -> its tokens from position 0
        self._dirty = False  # a decode was interrupted: cells past what _seqs lists may exist
        # What a model with a rollback_limit can still undo: its snapshots are the states after
        # each token of the latest decode but the last, not the state before that decode.
        self._undoable = 0
        self._checkpoint: tuple[int, bytes] | None = None  # (length, recurrent state at that length)
        self._marks: list[tuple[int, bytes]] = []  # the same at prompt ends, oldest first (mark)
        self.load = (0, 0)  # what other requests put in its latest pass: their tokens, and those scored

    def __len__(self) -> int:
        """Tokens sequence 0 holds."""
        return len(self._seqs[0])

    def tokens(self) -> tuple[int, ...]:
        """What sequence 0 holds (a copy)."""
        return tuple(self._seqs[0])

    def shared_prefix(self, tokens: Sequence[int], limit: int | None = None) -> int:
        """How many leading tokens of `tokens` (at most `limit`) sequence 0 already holds."""
        held = self._seqs[0]
        return _common_prefix(held, tokens, min(len(held), len(tokens), len(tokens) if limit is None else limit))

    # -- changing it ---------------------------------------------------------

    def keep_prefix(self, tokens: Sequence[int], limit: int | None = None) -> int:
        """Roll back to the longest prefix shared with `tokens` (at most `limit`), or to less
        where a recurrent state cannot be cut there (the caller decodes the rest); the length
        kept."""
        n = self.shared_prefix(tokens, limit)
        self._settle()
        if self._can_undo(len(self) - n):
            self.rollback(n)
        else:
            self._rewind(n, redecode=False)
        return len(self)

    def keepable(self, tokens: Sequence[int], limit: int | None = None) -> int:
        """What keep_prefix(tokens, limit) would keep, changing nothing (unless a checkpoint
        it would come back to cannot be loaded)."""
        self._settle()
        return self._kept(self._seqs[0], tokens, limit, self._undoable, self._checkpoints())

    def _kept(self, held: list[int], tokens: Sequence[int], limit: int | None, undoable: int,
              checkpoints: Sequence[tuple[int, bytes]]) -> int:
        """What keep_prefix keeps of a cache holding `held` (its latest `undoable` tokens
        undoable, with `checkpoints`): the shared prefix, or for a recurrent state that cannot
        be cut there, the latest checkpoint at or before it, else nothing."""
        n = _common_prefix(held, tokens, min(len(held), len(tokens), len(tokens) if limit is None else limit))
        if self._can_undo(len(held) - n, undoable):
            return n
        return _latest(checkpoints, n)[0]

    def _checkpoints(self) -> list[tuple[int, bytes]]:
        """Every recurrent state copy it can come back to."""
        return [*self._marks, *([self._checkpoint] if self._checkpoint is not None else [])]

    def extend(self, tokens: Sequence[int], outputs: Outputs = "none") -> Work[list[np.ndarray]]:
        """Decode `tokens` after what sequence 0 holds (Backend.decode's rows)."""
        self._settle()
        if not tokens:
            return []
        n = len(self._seqs[0])
        need = Decode(self.model, tokens, range(n, n + len(tokens)), None, outputs)
        yield need
        rows = self._decoded(need)
        self._seqs[0].extend(tokens)
        if tokens:  # an empty decode changes nothing, what can be undone included
            self._undoable = len(tokens) - 1
        return rows

    def _decoded(self, need: Decode) -> list[np.ndarray]:
        """A decode's rows; where it failed, the model may hold cells of it, which go before
        anything else happens (_settle). What other requests put in its pass is `load`."""
        self._dirty = True
        rows = need.result()
        self._dirty = False
        self.load = (need.others, need.others_scored)
        return rows

    def checkpoint(self, ahead: int | None = None) -> None:
        """Drafted tokens are about to be decoded: make a later rollback to what sequence 0
        holds now cheap. `ahead`: how many of them a rollback may drop, when they come in one
        decode (None: several decodes). A model that cannot undo that many copies its
        recurrent state here (Backend.save_state(partial=True)); attention caches need nothing."""
        limit = self.model.rollback_limit
        if limit is None or (ahead is not None and ahead <= limit):
            return
        self._settle()
        if all(length != len(self) for length, _ in self._checkpoints()):
            self._checkpoint = (len(self), self.model.save_state(partial=True))

    def mark(self) -> None:
        """A prompt is in: a model that cannot undo tokens copies its recurrent state here, and
        keeps the copy across runs (the latest MARKS), since the next run's prompt may share this
        one and not the output (a conversation's next turn, a regenerated answer)."""
        if self.model.rollback_limit is None:
            return
        self._settle()
        if all(length != len(self) for length, _ in self._marks):
            self._marks = [*self._marks, (len(self), self.model.save_state(partial=True))][-MARKS:]

    def sync(self, tokens: Sequence[int], outputs: Outputs = "none") -> Work[list[np.ndarray]]:
        """Make sequence 0 hold exactly `tokens`, decoding only what it does not share with
        them (for "last", at least the last token, whose logits are wanted)."""
        n = self.keep_prefix(tokens, len(tokens) - 1 if outputs == "last" else None)
        return (yield from self.extend(tokens[n:], outputs)) if len(tokens) > n else []

    def rollback(self, n: int) -> None:
        """Hold positions 0..n-1 only, in every sequence."""
        self._settle()
        held = self._seqs[0]
        if all(len(s) <= n for s in self._seqs.values()):
            return
        if not self._can_undo(len(held) - n):
            self._rewind(n)
            return
        self.model.trim(n)
        self._undoable = 0  # llama.cpp's recurrent rollback is single-use
        self._drop_checkpoints_past(n)
        for seq in self._seqs.values():
            del seq[n:]

    def forget(self) -> None:
        """Hold nothing (before the model is used for something else)."""
        self.rollback(0)

    def decode_tree(self, tokens: Sequence[int], seqs: Sequence[Sequence[int]],
                    ahead: int | None = None) -> Work[list[np.ndarray]]:
        """Score draft-tree tokens in one batch: token i goes into every sequence of seqs[i],
        right after what they hold, and sees what its first one holds before it. One row
        of logits per token. `ahead`: `checkpoint(ahead)` first (drafted tokens among them)."""
        if ahead:
            self.checkpoint(ahead)
        self._settle()
        length = {s: len(held) for s, held in self._seqs.items()}
        positions = []
        for ids in seqs:
            positions.append(length.setdefault(ids[0], 0))
            for s in ids:
                length[s] = positions[-1] + 1
        need = Decode(self.model, tokens, positions, seqs, "all")
        yield need
        rows = self._decoded(need)
        for token, ids in zip(tokens, seqs):
            for s in ids:
                self._seqs.setdefault(s, []).append(token)
        self._undoable = len(tokens) - 1
        return rows

    def fork(self, src: int, dst: int) -> None:
        """Sequence dst holds what sequence src holds (a new draft-tree branch)."""
        self.model.copy_branch(src, dst)
        self._seqs[dst] = list(self._seqs[src])

    def keep_branch(self, seq: int, n: int) -> None:
        """Sequence seq's first n tokens become sequence 0; every other branch is dropped."""
        self._settle()
        if len(self._seqs) == 1:  # a chain: a rollback (which a recurrent state may need)
            self.rollback(n)
            return
        kept = self._seqs[seq][:n]
        self.model.keep_branch(seq, n)
        self._seqs = {0: kept}

    # -- the prompt cache file and --cache-ram -----------------------------------

    def save(self) -> bytes:
        """Sequence 0's state as llama.cpp serialises it (it holds self.tokens())."""
        return self.model.save_state()

    def restore(self, state: bytes, tokens: Sequence[int], checkpoint: tuple[int, bytes] | None = None) -> bool:
        """Replace the cache with a saved state holding `tokens` (and a recurrent model's
        `checkpoint`, saved_checkpoint()'s, to come back to); False (and an empty cache) when
        the model cannot load it."""
        self._settle()
        loaded = self.model.load_state(state, len(tokens))
        self._seqs = {0: list(tokens) if loaded else []}
        self._undoable, self._checkpoint, self._marks = 0, checkpoint if loaded else None, []
        return loaded

    def saved_checkpoint(self) -> tuple[int, bytes] | None:
        """The latest checkpoint a recurrent model's cache can come back to (length, state), if any."""
        checkpoints = self._checkpoints()
        return _latest(checkpoints) if checkpoints else None

    def keepable_after_restore(self, held: Sequence[int], tokens: Sequence[int], limit: int | None = None,
                               checkpoint: tuple[int, bytes] | None = None) -> int:
        """What keep_prefix(tokens, limit) would keep right after restore(state, held, checkpoint):
        for a recurrent state, all of `held` or the checkpoint (nothing of it can be undone)."""
        return self._kept(list(held), tokens, limit, 0, [checkpoint] if checkpoint is not None else [])

    # -- keeping the bookkeeping true ------------------------------------------

    def _settle(self) -> None:
        """After an interrupted decode the model may hold cells this object does not list:
        they go before anything else happens."""
        if self._dirty:
            self._dirty = False
            self._seqs = {0: self._seqs[0]}
            if self.model.rollback_limit is None:
                self.model.keep_branch(0, len(self._seqs[0]))
            else:  # the recurrent state went past what is listed, by an unknown number of tokens
                self._undoable = 0
                self._rewind(len(self._seqs[0]))

    def _drop_checkpoints_past(self, n: int) -> None:
        """Checkpoints that hold tokens this cache no longer does go."""
        if self._checkpoint is not None and self._checkpoint[0] > n:
            self._checkpoint = None
        self._marks = [m for m in self._marks if m[0] <= n]

    def _can_undo(self, n_tokens: int, undoable: int | None = None) -> bool:
        """Whether the model can drop its latest `n_tokens` (the one place this is decided);
        `undoable`: of a cache whose latest decode left that many undoable (default: this one)."""
        limit = self.model.rollback_limit
        undoable = self._undoable if undoable is None else undoable
        return n_tokens <= 0 or limit is None or n_tokens <= min(limit, undoable)

    def _rewind(self, n: int, redecode: bool = True) -> None:
        """Hold positions 0..n-1 where the model cannot simply drop the rest: from the
        checkpoint when it lies at or before n, else from nothing; the kept tokens after
        that point are decoded again (`redecode`), or left for the caller to decode."""
        held = self._seqs[0]
        kept = held[:n]
        start, state = _latest(self._checkpoints(), n)
        if start and not self.model.load_state(state, start, partial=True):
            start = 0
        if start == 0:
            self.model.trim(0)
        self._drop_checkpoints_past(start)
        self._seqs = {0: held[:start]}
        self._undoable = 0
        if redecode and n > start:  # alone, at once: rare (past what llama.cpp can undo)
            scheduler.run(self.extend(kept[start:]))


class HeadCache:
    """A drafting head's KV cache (backend.Head: an MTP head, EAGLE-3, DFlash, ...) and what it
    holds: its one owner.

    Position p holds the head's entry for the token at p and a hidden row.
    Entries made from the target's NextN rows are exact: the one at p depends on the
    tokens up to p only, so, like the target's cache, they are kept from one step and
    one run to the next as far as the context still starts with them (`sync`). Drafted
    entries, each with the head's own row of the entry before, come after them and go at
    the next sync. Where the target's rows for the entries it lacks are not known (its
    cache came from a prompt cache file written without them, or was forked into draft
    branches), the head cannot follow the target exactly: it keeps what it has, and sync
    says so.

    With chained heads (head.n_heads > 1) the i-th drafted token comes from head i, which
    decodes the draft region again from the last exact entry (`draft`); that entry is then in
    head i's layer only, so the next sync decodes it again in every head's.

    The drafters of a file of their own that follow the target's layer inputs have entries of
    this shape too (EAGLE-3's decoder, DFlash's injected rows: llamacpp/eagle3.py, dflash.py). A
    head that reads the target's cache instead (head.shared_memory: a Gemma-4 assistant) holds
    nothing: each entry is decoded alone at the position of the context's last token.
    """

    def __init__(self, head: Head):
        self.head = head
        self._held: list[int] = []  # the token of each entry, from position 0
        self._exact = 0  # leading entries made from the target's rows
        self._seed: tuple[int, np.ndarray] | None = None  # the last exact entry's token and row (chained heads),
        self._seed_pos = 0                                  # and its position
        self._drafted: list[tuple[int, np.ndarray]] = []  # since: each drafted token and the row before it

    def shared_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` it holds exact entries for (a head that reads
        the target's cache: all of them, having none of its own)."""
        if self.head.shared_memory:
            return len(tokens)
        return _common_prefix(self._held, tokens, min(self._exact, len(tokens)))

    def can_follow(self, tokens: Sequence[int]) -> bool:
        """Whether `sync(tokens)` has the target's rows it needs."""
        if self.head.shared_memory:
            return self.head.target_rows(len(tokens) - 2, len(tokens) - 1) is not None
        return self.head.target_rows(self._kept(tokens, True) - 1, len(tokens) - 1) is not None

    def sync(self, tokens: Sequence[int], last: bool = True) -> Work[tuple[np.ndarray, np.ndarray] | None]:
        """Hold exact entries for `tokens`, of which the target's cache holds all but the last,
        decoding those it lacks (with `last`, at least the last one, whose outputs are wanted):
        the last entry's logits and NextN row, or None when nothing was decoded or the target's
        rows for them are not known. A head that reads the target's cache decodes the last
        entry alone, at its position."""
        if self.head.shared_memory:
            rows = self.head.target_rows(len(tokens) - 2, len(tokens) - 1) if last else None
            self._seed_pos = len(tokens) - 1
            return None if rows is None else (yield from self._decode(tokens[-1:], self._seed_pos, rows))
        n = self._kept(tokens, last)
        self.rollback(n)
        rows = self.head.target_rows(n - 1, len(tokens) - 1)
        if n == len(tokens) or rows is None:
            return None
        out = yield from self.extend(tokens[n:], rows)
        if out is not None:
            self._exact = len(self._held)
            self._seed, self._seed_pos, self._drafted = (tokens[-1], rows[-1].copy()), len(self._held) - 1, []
        return out

    def draft(self, token: int, row: np.ndarray) -> Work[tuple[np.ndarray, np.ndarray] | None]:
        """The entry of a drafted token after the last sync and the drafts since, with the head's
        row of the entry before: its logits and NextN row, or None (nothing held) on failure.
        Chained heads: the i-th drafted token's entry comes from head i, which decodes the last
        exact entry and the drafted ones again."""
        if self.head.shared_memory:  # at the last token's position, as llama.cpp's driver decodes it
            return (yield from self._decode([token], self._seed_pos, row[None]))
        if self.head.n_heads == 1:
            return (yield from self.extend([token], row[None]))
        self._drafted.append((token, row.copy()))
        pos0 = self._seed_pos  # the last exact entry: only there does every head's layer hold it
        self.rollback(pos0)
        entries = [self._seed, *self._drafted]
        out = yield from self._decode([t for t, _ in entries], pos0, np.stack([r for _, r in entries]),
                                      len(self._drafted))
        if out is None:
            self.head.trim(0)
            self._held, self._exact = [], 0
            return None
        self._held.extend(t for t, _ in entries)
        return out

    def _kept(self, tokens: Sequence[int], last: bool) -> int:
        """The entries sync keeps: those it shares with `tokens`, less the last one for `last`."""
        return max(0, min(self.shared_prefix(tokens), len(tokens) - 1 if last else len(tokens)))

    def extend(self, tokens: Sequence[int], rows: np.ndarray) -> Work[tuple[np.ndarray, np.ndarray] | None]:
        """Entries for `tokens` with `rows` after what it holds (drafted ones, unless sync makes
        them): the last one's logits and NextN row, or None (and nothing held) when the head
        fails."""
        out = yield from self._decode(tokens, len(self._held), rows)
        if out is None:  # the head may hold some of them: start again from nothing
            self.head.trim(0)
            self._held, self._exact = [], 0
            return None
        self._held.extend(tokens)
        return out

    def _decode(self, tokens: Sequence[int], pos: int, rows: np.ndarray,
                index: int | None = None) -> Work[tuple[np.ndarray, np.ndarray] | None]:
        """The head's decode of these entries (Head.decode), as a step needs it."""
        need = HeadDecode(self.head, tokens, pos, rows, index)
        yield need
        return need.result()

    def rollback(self, n: int) -> None:
        """Hold positions 0..n-1 only."""
        if len(self._held) > n:
            self.head.trim(n)
            del self._held[n:]
        self._exact = min(self._exact, n)

    def forget(self) -> None:
        self.rollback(0)
