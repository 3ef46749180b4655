"""N-gram drafters: propose what followed the last n tokens earlier in the text.

No model at all: the history (prompt + output) is its own draft. This pays when
the output repeats its input, as when code is edited, text is quoted or a table
is filled from a document. The index is updated incrementally, one entry per new
token, so a lookup never rescans the history.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from speculative.decoding.drafter import LONG, MEDIUM, RESUMED, SHORT, Draft, Drafter, Outcome

RECENT_OCCURRENCES = 16  # how many earlier occurrences of a key are weighed
MAX_CONTEXT = 32         # how far back a match is compared to rank occurrences


def shared_suffix(source: Sequence[int], end: int, context: Sequence[int], n: int, limit: int = MAX_CONTEXT) -> int:
    """How many tokens before `end` in `source` equal the last tokens of `context`, the n
    known to match included (up to `limit`)."""
    length = n
    while (length < limit and end - length - 1 >= 0 and len(context) - length - 1 >= 0
           and source[end - length - 1] == context[-length - 1]):
        length += 1
    return length


def context_match(history: Sequence[int], end: int, n: int, limit: int = MAX_CONTEXT) -> int:
    """How many tokens before `end` (an earlier occurrence of the last n-gram ends there)
    equal the last tokens of the history, the n-gram itself included."""
    return shared_suffix(history, end, history, n, limit)


ALIGNED_SLACK = 8        # an occurrence this close to where the last copied passage went on


def match_class(length: int, aligned: bool = False) -> int:
    """Classes of proposals, for acceptance estimates: the longer the history agrees
    with an earlier passage, the likelier the passage goes on (0 short, 1 medium,
    2 long); 3: a short match that resumes the passage copied before, as after a
    renamed identifier in otherwise copied code. Length comes first: a medium match
    predicts a long run whether it resumes a passage or not."""
    if length >= 16:
        return LONG
    if length >= 8:
        return MEDIUM
    return RESUMED if aligned else SHORT


class NgramIndex:
    """n-gram -> positions right after each of its occurrences, in order."""

    def __init__(self, n: int):
        self.n = n
        self.after: dict[tuple[int, ...], list[int]] = {}
        self._next = n  # the next position whose preceding n-gram is not indexed yet

    def sync(self, history: Sequence[int]) -> None:
        """Index every n-gram whose following token is known. History only grows."""
        n = self.n
        for i in range(self._next, len(history)):
            self.after.setdefault(tuple(history[i - n : i]), []).append(i)
        self._next = max(self._next, len(history))

    def occurrences(self, history: Sequence[int]) -> list[int]:
        """Earlier occurrences of the history's last n-gram (where their continuation starts)."""
        self.sync(history)
        if len(history) < self.n:
            return []
        return self.after.get(tuple(history[-self.n :]), [])


class NgramDrafter(Drafter):
    """What the n-gram drafters share: an index of the history, n, m and min-hits."""

    free = True

    def __init__(self, n: int = 12, m: int = 48, min_hits: int = 1):
        self.index = NgramIndex(n)
        self.m = m
        self.min_hits = min_hits


class NgramSimple(NgramDrafter):
    """`ngram-simple`: the m tokens that followed an earlier occurrence of the last
    n-gram (llama.cpp's common_ngram_simple_draft, indexed). Where the n-gram occurs
    several times, llama.cpp takes the most recent; here the most recent among those
    whose preceding context matches longest (up to MAX_CONTEXT tokens), which is the
    same for a unique n-gram and picks the right passage in repetitive code."""

    name = "ngram-simple"

    def __init__(self, n: int = 12, m: int = 48, min_hits: int = 1):
        super().__init__(n, m, min_hits)
        self._offset: int | None = None  # len(context) - source position of the last proposal

    def propose(self, context: Sequence[int], k: int) -> Draft:
        found = self.index.occurrences(context)
        if len(found) < self.min_hits:
            return self.nothing()
        n, offset = self.index.n, self._offset

        def aligned(i: int) -> bool:  # resumes the passage the last proposal came from
            return offset is not None and abs(len(context) - i - offset) <= ALIGNED_SLACK

        start = max(found[-RECENT_OCCURRENCES:],
                    key=lambda i: (context_match(context, i, n) + ALIGNED_SLACK * aligned(i), i))
        kind = match_class(context_match(context, start, n), aligned(start))
        self._offset = len(context) - start
        return Draft(list(context[start : start + min(self.m, k)]), self.name, kind)


class NgramMapK(NgramDrafter):
    """`ngram-map-k`: a map from n-grams to what followed them. The continuation
    whose first token followed the key most often (at least min-hits times, among
    its recent occurrences) is proposed, from its most recent occurrence; after a
    draft from a key, the next one from that key is at most one token longer than
    what the target accepted (llama.cpp's per-key n_accepted)."""

    name = "ngram-map-k"

    def __init__(self, n: int = 12, m: int = 48, min_hits: int = 1):
        super().__init__(n, m, min_hits)
        self.limit: dict[tuple[int, ...], int] = {}
        self._last_key: tuple[int, ...] | None = None

    def propose(self, context: Sequence[int], k: int) -> Draft:
        self._last_key = None
        found = self.index.occurrences(context)[-RECENT_OCCURRENCES:]
        if not found:
            return self.nothing()
        votes = Counter(context[i] for i in found)
        latest = {context[i]: i for i in found}  # found is in order: the last one wins
        token = max(votes, key=lambda t: (votes[t], latest[t]))
        if votes[token] < self.min_hits:
            return self.nothing()
        start = latest[token]
        key = tuple(context[-self.index.n :])
        length = min(self.m, k, self.limit.get(key, self.m))
        self._last_key = key
        match = match_class(context_match(context, start, self.index.n))
        return Draft(list(context[start : start + length]), self.name, match)

    def accept(self, outcome: Outcome) -> None:
        if outcome.draft.source == self.name and self._last_key is not None:
            self.limit[self._last_key] = outcome.n_accepted + 1
