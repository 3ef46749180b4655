"""`ngram-map-k4v`: llama.cpp's common_ngram_map with values (common/ngram-map.cpp, PR 18471),
ported as it is.

A key is the last n tokens. Where it occurred before, llama.cpp keeps statistics of up to four
different m-token continuations (values) that followed it, with how often each was seen, and
drafts only when one of them was seen at least twice as often as the others together. What it
drafts is then the m tokens that followed the occurrence the lookup found, at most as many as
the target accepted the last time this value drafted.

The rules, as ngram-map.cpp has them (some odd, kept for parity):
  - An occurrence is found through a hash table of n-gram -> position (2^18 slots, a 32-bit
    LCG hash, the first position stored in a slot stays), else by a scan of the positions not
    hashed yet: the prompt's first, then those generated since, each from the latest back. A
    key's occurrence must leave room for m tokens after it and one more before the present.
  - A key's hit count grows with every lookup that finds it; with fewer than min-hits, no draft.
  - The values are counted over the occurrences from where the last count stopped (the last
    found position counts again), so a value's count also grows with lookups.
  - A value whose draft was rejected at the first token is never drafted again (0 tokens).
The map lives for one request (llama-server keeps it per slot and prunes what a shorter next
prompt dropped; speculate starts each request with a new one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from speculative.decoding.drafter import Draft, Drafter, Outcome

MAX_VALUES = 4           # COMMON_NGRAM_MAX_VALUES
HASH_SLOTS = 262144      # COMMON_NGRAM_HASH_MAP_SIZE
MAX_COUNT = 16380        # COMMON_NGRAM_MAX_VALUE_COUNT
LCG_FACTOR = 2654435761  # ngram-map.cpp's 32-bit LCG multiplier


@dataclass
class Value:
    """common_ngram_map_value: an m-gram seen after a key."""
    idx: int = 0         # where it starts in the history (0: the slot is unused)
    count: int = 0
    n_accepted: int = 0  # how long its next draft may be


@dataclass
class Key:
    """common_ngram_map_key: a key's statistics."""
    stat_idx: int = 0    # occurrences from here on are not counted yet
    hits: int = 0
    values: list[Value] = field(default_factory=list)


class NgramMapK4v(Drafter):
    """common_ngram_map (key_only = false). llama.cpp drafts after `inp` (the tokens in the
    cache) and `sampled`; here `context` is both: context[:-1] and context[-1]."""

    name = "ngram-map-k4v"
    free = True

    def __init__(self, n: int = 12, m: int = 48, min_hits: int = 1):
        self.n, self.m, self.min_hits = n, m, min_hits
        self.keys: dict[tuple[int, ...], Key] = {}
        self.key_map = np.zeros(HASH_SLOTS, dtype=np.int64)  # hash slot -> position (0: none)
        self.key_map_last = 0    # positions up to here are hashed (or skipped)
        self.size_begin = 0      # the prompt's length (llama.cpp's size_last_begin)
        self.last: tuple[Key, Value] | None = None  # what the last draft came from

    def prefill(self, prompt: Sequence[int]) -> None:
        """common_ngram_map_begin on a fresh map."""
        self.size_begin = len(prompt)

    def propose(self, context: Sequence[int], k: int) -> Draft:
        self.last = None
        n, m = self.n, self.m
        inp, cur_len = context, len(context) - 1  # every position read below is < cur_len
        # llama.cpp drafts from the first sampled token on; here the prompt's last token is the
        # first "sampled" one, one step before (its map would abort on cur_len < size_begin)
        if cur_len < 2 * n + m or cur_len < self.size_begin:
            return self.nothing()
        key = tuple(context[-n:])
        match = self._find(inp, key, cur_len)
        self._hash_new(inp, cur_len)
        if match == 0:
            return self.nothing()
        stats = self.keys.setdefault(key, Key(values=[Value(n_accepted=m) for _ in range(MAX_VALUES)]))
        stats.hits = min(stats.hits + 1, MAX_COUNT)
        if stats.hits < self.min_hits:
            return self.nothing()
        self._count_values(inp, key, stats, match)
        chosen = _most_frequent(stats.values)
        if chosen is None:
            return self.nothing()
        self.last = (stats, chosen)
        length = min(m, chosen.n_accepted)
        return Draft(list(inp[match + n : match + n + length][:k]), self.name)

    def _find(self, inp: Sequence[int], key: tuple[int, ...], cur_len: int) -> int:
        """An earlier position of the key (0: none; llama.cpp never finds position 0)."""
        n, limit = self.n, cur_len - self.n - self.m - 1
        at = int(self.key_map[_hash(key) % HASH_SLOTS])
        if at != 0 and at < limit and tuple(inp[at : at + n]) == key:
            return at
        for top, bottom in self._unhashed(cur_len):
            for j in range(top, bottom, -1):
                if tuple(inp[j : j + n]) == key:
                    return j
        return 0

    def _unhashed(self, cur_len: int) -> list[tuple[int, int]]:
        """The positions not in the hash table yet, as (from, down to but excluding) ranges in
        llama.cpp's order: the prompt's, then the generated ones (each from the latest back)."""
        n, m, last = self.n, self.m, self.key_map_last
        ranges = []
        if self.size_begin > n + m + 1:
            ranges.append((self.size_begin - n - m - 1, last))
        ranges.append((cur_len - n - m - 1, max(self.size_begin, last)))
        return ranges

    def _hash_new(self, inp: Sequence[int], cur_len: int) -> None:
        """Add the positions not hashed yet to the hash table, from the latest back; a slot
        keeps the first position stored in it."""
        for top, bottom in self._unhashed(cur_len):
            if top <= bottom:
                continue
            positions = np.arange(top, bottom, -1)
            tokens = np.asarray(inp[bottom + 1 : top + self.n], dtype=np.int64).astype(np.uint32)
            hashes = np.zeros(len(positions), dtype=np.uint32)
            for j in range(self.n):  # uint32 arithmetic wraps as the C code's does
                hashes = hashes * np.uint32(LCG_FACTOR) + tokens[positions - bottom - 1 + j]
            slots, first = np.unique(hashes % np.uint32(HASH_SLOTS), return_index=True)
            free = self.key_map[slots] == 0
            self.key_map[slots[free]] = positions[first[free]]
        self.key_map_last = max(cur_len - self.n - self.m - 1, self.key_map_last)

    def _count_values(self, inp: Sequence[int], key: tuple[int, ...], stats: Key, match: int) -> None:
        """Count the m-grams after the key's occurrences in [stat_idx, match], up to four kinds."""
        n, m = self.n, self.m
        for i in range(stats.stat_idx, match + 1):
            if inp[i] != key[0] or tuple(inp[i : i + n]) != key:
                continue
            after = inp[i + n : i + n + m]
            for value in stats.values:
                if value.idx == 0:  # a new kind of continuation, in a free slot
                    value.idx, value.count, value.n_accepted = i + n, 0, m
                elif inp[value.idx : value.idx + m] != after:
                    continue
                value.count = min(value.count + 1, MAX_COUNT)
                break
        stats.stat_idx = match

    def accept(self, outcome: Outcome) -> None:
        """The value just drafted may draft as many tokens as were accepted, next time."""
        if outcome.draft.source == self.name and outcome.draft.tokens and self.last is not None:
            self.last[1].n_accepted = outcome.n_accepted


def _most_frequent(values: list[Value]) -> Value | None:
    """The value seen most often (the first of equals), if seen at least twice as often as
    all the others together; else None."""
    best = values[0]
    for value in values:
        if value.count > best.count:
            best = value
    others = sum(v.count for v in values if v is not best)
    if others > 0 and best.count < 2 * others:
        return None
    return best


def _hash(tokens: Sequence[int]) -> int:
    """common_ngram_map_hash: a 32-bit LCG over the tokens."""
    h = 0
    for t in tokens:
        h = (h * LCG_FACTOR + t) & 0xFFFFFFFF
    return h
