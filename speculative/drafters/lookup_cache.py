"""-lcs/-lcd FILE: llama.cpp's n-gram cache files (common_ngram_cache_save/_load in
common/ngram-cache.cpp), read and written so that llama-lookup, llama-lookup-create,
llama-lookup-merge and llama-server read ours and we read theirs.

The file is a sequence of records, little-endian int32 throughout (llama.cpp writes its
machine's order: little-endian on x86 and ARM), with no header:

    n-gram     4 tokens: an n-gram of 1 to 4 tokens, padded with -1 (LLAMA_TOKEN_NULL)
    ntokens    how many different tokens followed it (> 0)
    ntokens x  (token, count > 0)

Nothing in it says which tokenizer its tokens belong to, and nothing checks it is whole:
llama.cpp asserts on a file cut short (the process aborts). Here a file is read whole and
checked before it is used: one that is cut short, holds impossible values (a count of 0, a
negative token, an n-gram twice), is larger than MAX_BYTES, or names a token the target's
vocabulary does not have is Unusable, with the reason and byte offset for a notice. What is
read is bounded by the file's size, which is bounded: a hostile file cannot make us allocate
more than a few times MAX_BYTES.

In memory a file is a Table: its n-grams sorted, each with its tokens and counts, looked up by
binary search (a Python dict per n-gram would take ten times the file's size); what a lookup
finds becomes a dict, and the latest ones are kept, up to RECENT_ENTRIES entries in all.
"""

from __future__ import annotations

import os
from array import array
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from speculative.errors import UsageError
from speculative.files import check_ours, write_atomic

NGRAM_MAX = 4            # LLAMA_NGRAM_MAX: the n-gram field's width
NULL = -1                # LLAMA_TOKEN_NULL, the padding
MAX_BYTES = 64 << 20     # a larger file is not read (reading one takes a few times its size)
MAX_TOKEN = 1 << 24      # token ids at or above this are impossible in any vocabulary
RECENT_ENTRIES = 1 << 18 # looked-up parts kept as dicts, in entries (about 100 bytes each)
HEAD = NGRAM_MAX + 1     # int32 words before a record's pairs
KEY = np.dtype([("hi", "<u8"), ("lo", "<u8")])  # an n-gram as one sortable value


class Unusable(Exception):
    """The file cannot be used; the message says why (for a notice)."""


class NotACache(Unusable):
    """The file is clearly not an n-gram cache: its very first record is not one."""


class OtherVocabulary(Unusable):
    """A cache whose tokens the target's vocabulary does not have: another model's."""


class Table:
    """A read-only n-gram cache: n-gram -> {token: count}, as llama.cpp's common_ngram_cache.
    Record r is the n-gram grams[r] (sorted, unique), followed by the tokens and counts at
    starts[r] : starts[r] + lengths[r] (in the order the file had them)."""

    def __init__(self, grams: np.ndarray, starts: np.ndarray, lengths: np.ndarray, tokens: np.ndarray,
                 counts: np.ndarray):
        self.grams = grams.reshape(-1, NGRAM_MAX)
        self.starts, self.lengths = starts, lengths
        self.tokens, self.counts = tokens, counts
        self._keys = _keys(self.grams)
        self._recent: OrderedDict[int, dict[int, int]] = OrderedDict()  # record -> part, the latest last
        self._recent_entries = 0

    @classmethod
    def empty(cls) -> "Table":
        nothing = np.zeros(0, np.int32)
        return cls(np.zeros((0, NGRAM_MAX), np.int32), nothing, nothing, nothing, nothing)

    @classmethod
    def from_pairs(cls, grams: np.ndarray, tokens: np.ndarray, counts: np.ndarray) -> "Table":
        """A table from (padded n-gram, token, count) rows; rows of one n-gram and token add up
        (llama.cpp's common_ngram_cache_merge), a count at most the int32 limit."""
        if not len(tokens):
            return cls.empty()
        order = np.lexsort((tokens, *grams.T[::-1]))
        grams, tokens, counts = grams[order], tokens[order], counts[order].astype(np.int64)
        same_pair = np.r_[False, (grams[1:] == grams[:-1]).all(axis=1) & (tokens[1:] == tokens[:-1])]
        starts = np.flatnonzero(~same_pair)
        counts = np.minimum(np.add.reduceat(counts, starts), np.iinfo(np.int32).max).astype(np.int32)
        grams, tokens = grams[starts], tokens[starts]
        firsts = np.flatnonzero(np.r_[True, (grams[1:] != grams[:-1]).any(axis=1)])
        return cls(grams[firsts], firsts, np.diff(np.r_[firsts, len(tokens)]), tokens, counts)

    def __len__(self) -> int:
        return len(self.grams)

    def part(self, gram: Sequence[int]) -> dict[int, int] | None:
        """The tokens that followed `gram` (1 to 4 tokens) and how often; None if it never occurred."""
        query = _keys(np.array([_padded(gram)], dtype=np.int64))
        i = int(np.searchsorted(self._keys, query)[0])
        if i == len(self._keys) or self._keys[i] != query[0]:
            return None
        part = self._recent.pop(i, None)
        if part is None:
            lo, hi = self.starts[i], self.starts[i] + self.lengths[i]
            # a token listed twice: the first count counts, as in llama.cpp's loader (emplace)
            part = dict(zip(self.tokens[lo:hi][::-1].tolist(), self.counts[lo:hi][::-1].tolist()))
            self._recent_entries += len(part)
        self._recent[i] = part
        while self._recent_entries > RECENT_ENTRIES and len(self._recent) > 1:
            self._recent_entries -= len(self._recent.popitem(last=False)[1])
        return part

    def pairs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every (padded n-gram, token, count) row, record by record."""
        at = _ranges(self.starts, self.lengths)
        return np.repeat(self.grams, self.lengths, axis=0), self.tokens[at], self.counts[at]

    def merged(self, parts: Mapping[tuple[int, ...], Mapping[int, int]]) -> "Table":
        """This table with more counts added (n-gram -> {token: count})."""
        rows = [(_padded(gram), token, count) for gram, part in parts.items() for token, count in part.items()]
        if not rows:
            return self
        grams, tokens, counts = self.pairs()
        more = np.array([g for g, _, _ in rows], dtype=np.int32).reshape(-1, NGRAM_MAX)
        return Table.from_pairs(np.concatenate([grams, more]),
                                np.concatenate([tokens, np.array([t for _, t, _ in rows], dtype=np.int32)]),
                                np.concatenate([counts, np.array([c for _, _, c in rows], dtype=np.int64)]))

    def to_bytes(self) -> bytes:
        """The records in llama.cpp's format."""
        _, tokens, counts = self.pairs()
        firsts = _before(self.lengths)                                    # each record's first pair
        heads = HEAD * np.arange(len(self)) + 2 * firsts                  # each record's first word
        words = np.empty(HEAD * len(self) + 2 * len(tokens), dtype="<i4")
        words[heads[:, None] + np.arange(NGRAM_MAX)] = self.grams
        words[heads + NGRAM_MAX] = self.lengths
        pair = np.repeat(heads + HEAD, self.lengths) + 2 * (np.arange(len(tokens)) - np.repeat(firsts, self.lengths))
        words[pair] = tokens
        words[pair + 1] = counts
        return words.tobytes()


def read(path: Path, n_vocab: int | None = None) -> Table:
    """The cache in `path`, checked whole. Raises FileNotFoundError, OSError, or Unusable
    (NotACache, OtherVocabulary) with the reason."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_BYTES:
            raise Unusable(f"{size >> 20} MiB, larger than the {MAX_BYTES >> 20} MiB speculate reads")
        words = np.frombuffer(f.read(size - size % 4), dtype="<i4")
    heads = _walk(words, size)
    header = heads[:, None] + np.arange(HEAD)
    grams, lengths = words[header[:, :NGRAM_MAX]], words[header[:, NGRAM_MAX]]
    is_pair = np.ones(len(words), dtype=bool)
    is_pair[header] = False
    pairs = words[is_pair].reshape(-1, 2)
    tokens, counts = pairs[:, 0], pairs[:, 1]
    starts = _before(lengths)
    _check_values(grams, tokens, counts, starts, heads)
    order = _sorted_records(grams, heads)
    largest = max(int(grams.max(initial=NULL)), int(tokens.max(initial=NULL)))
    if n_vocab is not None and largest >= n_vocab:
        raise OtherVocabulary(f"token {largest} is not in the target's vocabulary of {n_vocab} tokens "
                              "(a cache written for another tokenizer?)")
    return Table(grams[order], starts[order], lengths[order], tokens, counts)


def _walk(words: np.ndarray, size: int) -> np.ndarray:
    """Where each record starts (in words); Unusable where the records do not add up."""
    view, n, pos = memoryview(words.astype("=i4", copy=False)), len(words), 0
    heads = array("q")
    while pos < n:
        if pos + HEAD > n:
            _bad(len(heads), pos, "cut short")
        count = view[pos + NGRAM_MAX]
        if count <= 0 or count > MAX_TOKEN:
            _bad(len(heads), pos, f"impossible number of tokens {count}")
        if pos + HEAD + 2 * count > n:
            _bad(len(heads), pos, "cut short")
        heads.append(pos)
        pos += HEAD + 2 * count
    if size % 4:
        _bad(len(heads), pos, "cut short")
    return np.frombuffer(heads, dtype=np.int64) if heads else np.zeros(0, np.int64)


def _check_values(grams, tokens, counts, starts, heads) -> None:
    """Every n-gram is 1 to 4 tokens padded with NULL, every token in [0, MAX_TOKEN), every count > 0."""
    real = (grams >= 0) & (grams < MAX_TOKEN)
    pad = grams == NULL
    bad_gram = ~(real | pad).all(axis=1) | ~real[:, 0] | (pad[:, :-1] & real[:, 1:]).any(axis=1)
    if bad_gram.any():
        r = int(np.argmax(bad_gram))
        _bad(r, heads[r], f"impossible n-gram {grams[r].tolist()}")
    bad_pair = (tokens < 0) | (tokens >= MAX_TOKEN) | (counts <= 0)
    if bad_pair.any():
        i = int(np.argmax(bad_pair))
        r = int(np.searchsorted(starts, i, side="right")) - 1
        _bad(r, heads[r], f"impossible token {tokens[i]} with count {counts[i]}")


def _sorted_records(grams, heads) -> np.ndarray:
    """The records' order by n-gram; an n-gram twice (which llama.cpp never writes) is Unusable."""
    order = np.lexsort(grams.T[::-1])
    same = (grams[order[1:]] == grams[order[:-1]]).all(axis=1)
    if same.any():
        r = int(np.maximum(order[1:], order[:-1])[same].min())  # the first repeat in the file
        _bad(r, heads[r], f"n-gram {grams[r].tolist()} appears twice")
    return order


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The indices starts[i] .. starts[i] + lengths[i] - 1, for every i in turn."""
    firsts = _before(lengths)
    return np.repeat(starts, lengths) + (np.arange(int(np.sum(lengths, dtype=np.int64))) - np.repeat(firsts, lengths))


def _before(lengths: np.ndarray) -> np.ndarray:
    """Where each of consecutive runs of these lengths starts."""
    return np.cumsum(lengths, dtype=np.int64) - lengths


def _bad(record: int, word: int, what: str) -> None:
    where = f"at byte {4 * int(word)}"
    if record == 0:
        raise NotACache(f"not an n-gram cache ({what} {where})")
    raise Unusable(f"damaged: {what} {where}")


def check_static(path: Path) -> None:
    """-lcs FILE must be a file that can be read (llama.cpp refuses to start otherwise)."""
    if path.is_dir():
        raise UsageError(f"-lcs/--lookup-cache-static {path}: is a directory")
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise UsageError(f"-lcs/--lookup-cache-static {path}: cannot read it: {e.strerror or e}") from None


def check_writable(path: Path) -> None:
    """Refuse, before any model loads, to later replace a -lcd file that is not an n-gram cache.
    A missing file is fine (it is created), so is an empty one (an empty cache)."""
    check_ours(path, "-lcd/--lookup-cache-dynamic", _stranger)


def _stranger(f) -> str | None:
    head = f.read(4 * HEAD)
    size = os.fstat(f.fileno()).st_size
    try:
        if head:
            _first_record(head, f, size)
    except NotACache as e:
        return str(e)
    return None


def _first_record(head: bytes, f, size: int) -> None:
    """NotACache unless the file starts with a whole, plausible record (its first 4096 pairs read)."""
    if len(head) < 4 * HEAD:
        _bad(0, 0, "cut short")
    words = np.frombuffer(head, dtype="<i4").astype(np.int32)
    count = int(words[NGRAM_MAX])
    if count <= 0 or 4 * HEAD + 8 * count > size:
        _bad(0, 0, f"impossible number of tokens {count}")
    pairs = np.frombuffer(f.read(8 * min(count, 4096)), dtype="<i4").astype(np.int32)
    _check_values(words[None, :NGRAM_MAX], pairs[0::2], pairs[1::2], np.zeros(len(pairs) // 2, np.int64),
                  np.zeros(1, np.int64))


def write(path: Path, table: Table) -> None:
    """Replace the file with `table`, atomically (a temporary file beside it, renamed)."""
    write_atomic(path, [table.to_bytes()])


def _padded(gram: Iterable[int]) -> list[int]:
    gram = list(gram)
    return gram + [NULL] * (NGRAM_MAX - len(gram))


def _keys(grams: np.ndarray) -> np.ndarray:
    """Each padded n-gram as one value that sorts and compares like the n-gram."""
    shifted = (grams.astype(np.int64) + 1).astype(np.uint64)  # NULL -> 0, tokens < 2^24 -> 25 bits
    keys = np.empty(len(grams), dtype=KEY)
    keys["hi"] = (shifted[:, 0] << np.uint64(32)) | shifted[:, 1]
    keys["lo"] = (shifted[:, 2] << np.uint64(32)) | shifted[:, 3]
    return keys
