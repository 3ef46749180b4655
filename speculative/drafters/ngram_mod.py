"""`ngram-mod`: llama.cpp's common_ngram_mod (common/ngram-mod.cpp, PR 19164) and the draft
procedure common/speculative.cpp runs with it, ported as they are.

The table is a fixed array of 4M int32 entries (16 MiB). An n_match-gram's slot is its hash

    res = res * 6364136223846793005 + token   (over its tokens, in 64-bit unsigned arithmetic)

modulo the table size, and the slot holds the token that last followed an n_match-gram with
that slot: collisions overwrite, and nothing checks that a slot's n-gram is the one looked up.
A draft starts from the last n_match tokens and continues as long as the slot of the last
n_match tokens (drafted ones included) is filled, up to n_max tokens; one that stops before
n_min tokens is dropped.

What llama.cpp keeps between steps and requests, kept here too:
  - the table, shared by every request of the engine (ModTable): a request's prompt is added
    at its start, and the table is emptied then when more than a quarter of it is in use;
  - generated text is added in chunks, once more than 32 tokens are not in the table yet;
  - five drafts in a row of which less than a quarter was accepted empty the table, and the
    next draft adds the whole history again.

numpy computes the hashes of many positions at once (uint64 arithmetic wraps as C's does).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from speculative.decoding.drafter import Draft, Drafter, Outcome

TABLE_SIZE = 4 * 1024 * 1024  # entries; llama.cpp's common_speculative_impl_ngram_mod
EMPTY = -1
MULTIPLIER = 6364136223846793005
MASK = (1 << 64) - 1
OCCUPANCY_RESET = 0.25  # a new prompt that leaves the table fuller than this empties it
CHUNK = 32              # generated tokens are added once more than this many wait
LOW_ACCEPTANCE = 0.25   # a draft of which less than this share was accepted is a low one
LOW_STREAK = 5          # this many low drafts in a row empty the table


class ModTable:
    """common_ngram_mod: n-gram hash -> the token that followed it, in a fixed array."""

    def __init__(self, n: int, size: int = TABLE_SIZE):
        self.n = n
        self.entries = np.full(size, EMPTY, dtype=np.int32)
        self.used = 0     # slots filled
        self.n_low = 0    # drafts in a row with low acceptance (llama.cpp's is per sequence: one here)

    def reset(self) -> None:
        self.entries.fill(EMPTY)
        self.used = 0

    def slot(self, tokens: Sequence[int]) -> int:
        """The slot of the n tokens (llama.cpp's idx)."""
        res = 0
        for t in tokens:
            res = (res * MULTIPLIER + t) & MASK
        return res % len(self.entries)

    def add_all(self, tokens: Sequence[int]) -> None:
        """llama.cpp's add() for every n-gram of `tokens` that a token of `tokens` follows, in
        order: a later one overwrites an earlier one's slot, as one add after another would."""
        n, count = self.n, len(tokens) - self.n
        if count <= 0:
            return
        tokens = np.asarray(tokens, dtype=np.int64).astype(np.uint64)  # C adds an int32 to a size_t
        hashes = np.zeros(count, dtype=np.uint64)
        for j in range(n):
            hashes = hashes * np.uint64(MULTIPLIER) + tokens[j : j + count]
        slots = hashes % np.uint64(len(self.entries))
        values = tokens[n:].astype(np.int32)
        # the last write to a slot wins: keep each slot's last position
        unique, first_from_end = np.unique(slots[::-1], return_index=True)
        last = len(slots) - 1 - first_from_end
        unique = unique.astype(np.int64)
        self.used += int(np.count_nonzero(self.entries[unique] == EMPTY))
        self.entries[unique] = values[last]

    def occupancy(self) -> float:
        return self.used / len(self.entries)


class NgramMod(Drafter):
    """The draft procedure of llama.cpp's common_speculative_impl_ngram_mod over a shared ModTable.

    In llama.cpp a draft follows `prompt` (the tokens in the cache) and `id_last` (the token
    just sampled); here `context` is both: context[:-1] and context[-1]."""

    name = "ngram-mod"
    free = True

    def __init__(self, table: ModTable, n_min: int = 48, n_max: int = 64):
        self.table = table
        self.n_min = n_min
        self.n_max = n_max
        self.i_last = 0        # positions before this are in the table
        self.n_draft_last = 0  # the last draft's length (0: none)

    def prefill(self, prompt: Sequence[int]) -> None:
        """llama.cpp's begin(): the prompt's n-grams go into the table, which is emptied when
        that leaves it more than a quarter full."""
        self.i_last = 0
        self.n_draft_last = 0
        n = self.table.n
        if len(prompt) < n:
            return
        self.table.add_all(prompt)
        self.i_last = len(prompt) - n
        if self.table.occupancy() > OCCUPANCY_RESET:
            self.table.reset()

    def propose(self, context: Sequence[int], k: int) -> Draft:
        self.n_draft_last = 0
        n = self.table.n
        cur_len = len(context) - 1  # llama.cpp's prompt.size(): context[-1] is its id_last
        if cur_len < n:
            return self.nothing()
        if self.i_last + CHUNK < cur_len:
            self.table.add_all(context[self.i_last : cur_len])
            self.i_last = cur_len - n
        drafted = self._continue(list(context[-n:]))
        if len(drafted) < self.n_min and len(drafted) < self.n_max:
            return self.nothing()  # the table ran out before n_min tokens
        self.n_draft_last = len(drafted)
        return Draft(drafted[:k], self.name)

    def _continue(self, window: list[int]) -> list[int]:
        """Tokens while the slot of the last n tokens is filled, up to n_max."""
        entries, size, n = self.table.entries, len(self.table.entries), self.table.n
        top = pow(MULTIPLIER, n - 1, 1 << 64)  # the first token's weight in the hash
        res = 0
        for t in window:
            res = (res * MULTIPLIER + t) & MASK
        drafted: list[int] = []
        while len(drafted) < self.n_max:
            token = int(entries[res % size])
            if token == EMPTY:
                break
            drafted.append(token)
            res = ((res - window[len(drafted) - 1] * top) * MULTIPLIER + token) & MASK  # slide by one
            window.append(token)
        return drafted

    def accept(self, outcome: Outcome) -> None:
        """Five drafts in a row with less than a quarter accepted empty the table. The share is
        of the tokens verified (llama.cpp: of the tokens drafted before the step's cap, which
        differ only when the context or -n leaves less room than the draft)."""
        if outcome.draft.source != self.name or not outcome.draft.tokens or not self.n_draft_last:
            return
        if outcome.n_accepted / len(outcome.draft.tokens) < LOW_ACCEPTANCE:
            self.table.n_low += 1
            if self.table.n_low >= LOW_STREAK:
                self.table.reset()
                self.table.n_low = 0
                self.i_last = 0
        else:
            self.table.n_low = 0
