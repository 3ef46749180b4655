"""What earlier generations wrote, to draft from (`ngram-pool`, and auto where it has content).

Scripts run speculate over many inputs of one kind (a docstring per function, the same JSON
fields from each log excerpt), and `batch` and `serve` answer many similar requests: much of
each answer repeats earlier answers, not the request's own prompt. The pool keeps the outputs
of earlier runs, indexed by their n-grams, and proposes what followed the longest match of
the current context's end, as vLLM's suffix decoding does over earlier outputs. It is bounded
(POOL_TOKENS; the oldest outputs go first) and learns only outputs, after a run ends.

In one process (`batch`, `serve`) the engine keeps one pool across requests. `--spec-pool
FILE` keeps it across processes, in its own format:

    b"SPECPOOL" u32 version, 32-byte tokenizer fingerprint, u32 n, u32 outputs,
    u32 length of each output, i32 tokens, then the sha256 of all of the above

A file is saved atomically and merged with what another process saved meanwhile (under a
lock), is ignored with a notice when damaged, and is never used, nor overwritten, for a model
with another tokenizer. A file that is not a pool is refused before the models load.
"""

from __future__ import annotations

import hashlib
import struct
from collections import deque
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from speculative.decoding.drafter import AGREED, Draft, Drafter
from speculative.decoding.settings import POOL_TOKENS
from speculative.drafters.ngram import ALIGNED_SLACK, RECENT_OCCURRENCES, match_class, shared_suffix
from speculative.files import check_ours, locked, write_atomic

MAGIC = b"SPECPOOL"
VERSION = 1
POOL_N = 4              # n-gram length looked up (an output of another request needs more than
                        # the 3 tokens that find a passage in the current one)
MIN_OUTPUT = 8          # shorter outputs teach nothing
_HEAD = struct.Struct("<8sI32sII")

Notice = Callable[[str], None]


class Pool:
    """Earlier outputs and an index from each n-gram to where it occurred in them."""

    def __init__(self, n: int = POOL_N, max_tokens: int = POOL_TOKENS):
        self.n = n
        self.max_tokens = max_tokens
        self.outputs: deque[list[int]] = deque()
        self.tokens = 0
        self.added: list[list[int]] = []   # learnt in this process, not saved yet
        self._index: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self._first = 0  # serial number of outputs[0]: index entries name outputs by serial

    def __len__(self) -> int:
        return len(self.outputs)

    def add(self, output: Sequence[int], new: bool = True) -> None:
        """Learn one output (a run's generated tokens); the oldest go when over the bound."""
        output = [int(t) for t in output][-self.max_tokens:]
        if len(output) < max(MIN_OUTPUT, self.n + 1):
            return
        self.outputs.append(output)
        self.tokens += len(output)
        if new:
            self.added.append(output)
        serial = self._first + len(self.outputs) - 1
        for i in range(self.n, len(output)):
            self._index.setdefault(tuple(output[i - self.n:i]), []).append((serial, i))
        if self.tokens > self.max_tokens:
            self._evict()

    def _evict(self) -> None:
        """Drop the oldest outputs down to 90% of the bound (so eviction is rare), then re-index."""
        while self.tokens > 0.9 * self.max_tokens and len(self.outputs) > 1:
            self.tokens -= len(self.outputs.popleft())
            self._first += 1
        first = self._first
        self._index = {key: kept for key, where in self._index.items()
                       if (kept := [(s, i) for s, i in where if s >= first])}

    def output(self, serial: int) -> list[int]:
        return self.outputs[serial - self._first]

    def occurrences(self, context: Sequence[int]) -> list[tuple[int, int]]:
        """(output serial, position after) of the context's last n-gram, oldest first."""
        if len(context) < self.n:
            return []
        return self._index.get(tuple(context[-self.n:]), [])


class PoolDrafter(Drafter):
    """`ngram-pool`: the continuation, in an earlier output, of the longest match of the
    context's end (among the recent occurrences of its last n-gram); a match that resumes
    the output the last proposal came from counts as aligned, as in ngram-simple. The kind
    (match_class) lets auto learn how far such matches are worth drafting."""

    name = "ngram-pool"
    free = True

    def __init__(self, pool: Pool, m: int = 48):
        self.pool = pool
        self.m = m
        self._last: tuple[int, int] | None = None  # (output serial, len(context) - position)

    def can_draft(self, context: Sequence[int]) -> bool:
        return len(self.pool) > 0

    def propose(self, context: Sequence[int], k: int) -> Draft:
        found = self.pool.occurrences(context)[-RECENT_OCCURRENCES:]
        if not found:
            return self.nothing()
        last = self._last

        def aligned(serial: int, i: int) -> bool:  # resumes the output the last proposal came from
            return last is not None and serial == last[0] and abs(len(context) - i - last[1]) <= ALIGNED_SLACK

        def score(where: tuple[int, int]) -> tuple[int, int]:
            serial, i = where
            return (shared_suffix(self.pool.output(serial), i, context, self.pool.n)
                    + ALIGNED_SLACK * aligned(serial, i), serial)

        serial, i = max(found, key=score)
        output = self.pool.output(serial)
        self._last = (serial, len(context) - i)
        tokens = output[i:i + min(self.m, k)]
        if len(found) >= 2:  # several earlier outputs: draft only as far as they agree (suffix
            # decoding's frequency): the shared skeleton of a JSON answer, not one answer's values
            alike = [self.pool.output(s)[j:j + len(tokens)] for s, j in found if (s, j) != (serial, i)]
            n = 0
            while n < len(tokens) and (alike := [o for o in alike if len(o) > n and o[n] == tokens[n]]):
                n += 1
            return Draft(tokens[:n], self.name, AGREED)
        return Draft(tokens, self.name, match_class(shared_suffix(output, i, context, self.pool.n), aligned(serial, i)))


# -- the file ---------------------------------------------------------------------------


def fingerprint(vocab_tokens: Iterable[bytes], kind: str, bos: int | None, eos: int | None) -> bytes:
    """The tokenizer's identity: its type, token texts and BOS/EOS ids."""
    digest = hashlib.sha256(f"{kind}\0{bos}\0{eos}\0".encode())
    for token in vocab_tokens:
        digest.update(len(token).to_bytes(4, "little") + token)
    return digest.digest()


def check_pool_file(path: Path) -> None:
    """Refuse, before any model loads, a --spec-pool FILE that exists and is not a pool
    (or cannot be written): it would be overwritten at the end."""
    check_ours(path, "--spec-pool", lambda f: None if f.read(len(MAGIC)) == MAGIC else "not a speculate pool file",
               needs_folder=True, directory="a directory, not a pool file", unreadable="cannot read it ({})",
               refusal="{}; refusing to overwrite it")


class PoolFile:
    """A pool kept in FILE across processes: read at start, saved (merged) at the end."""

    def __init__(self, path: Path, tokenizer: bytes, notice: Notice):
        self.path = Path(path)
        self.tokenizer = tokenizer
        self.notice = notice
        self.usable = True  # False: the file is another tokenizer's: neither used nor overwritten

    def load(self, pool: Pool) -> None:
        if not self.path.exists():
            return
        try:
            outputs = self._read()
        except _Foreign:
            self.usable = False
            self.notice(f"--spec-pool {self.path}: written for another tokenizer; not used, and left as it is")
            return
        except (OSError, ValueError) as e:
            self.notice(f"--spec-pool {self.path}: ignored ({e}); it will be rewritten")
            return
        for output in outputs:
            pool.add(output, new=False)

    def save(self, pool: Pool) -> None:
        """Write the file's outputs (as they are now: another process may have added some),
        then this process's, newest last, within the bound; atomically, under a lock."""
        if not self.usable or not pool.added:
            return
        with locked(self.path, waiting=lambda: self.notice(f"--spec-pool {self.path}: another process is saving it; "
                                                           "waiting to merge with what it saves")):
            try:
                outputs = self._read() if self.path.exists() else []
            except (OSError, ValueError, _Foreign):
                outputs = []  # damaged (noticed at load) or replaced since: ours is what is left
            outputs += pool.added
            kept, total = [], 0
            for output in reversed(outputs):
                if total + len(output) > pool.max_tokens:
                    break
                kept.append(output)
                total += len(output)
            write_atomic(self.path, [self._encode(pool.n, kept[::-1])])
        pool.added = []

    def _encode(self, n: int, outputs: list[list[int]]) -> bytes:
        body = _HEAD.pack(MAGIC, VERSION, self.tokenizer, n, len(outputs))
        body += np.array([len(o) for o in outputs], dtype="<u4").tobytes()
        body += np.array([t for o in outputs for t in o], dtype="<i4").tobytes()
        return body + hashlib.sha256(body).digest()

    def _read(self) -> list[list[int]]:
        data = self.path.read_bytes()
        if len(data) < _HEAD.size + 32 or data[:len(MAGIC)] != MAGIC:
            raise ValueError("not a pool file, or cut short")
        body, digest = data[:-32], data[-32:]
        if hashlib.sha256(body).digest() != digest:
            raise ValueError("its checksum does not match: damaged")
        magic, version, tokenizer, n, count = _HEAD.unpack_from(body)
        if version != VERSION:
            raise ValueError(f"format version {version}, this speculate reads {VERSION}")
        if tokenizer != self.tokenizer:
            raise _Foreign()
        lengths = np.frombuffer(body, dtype="<u4", count=count, offset=_HEAD.size)
        tokens = np.frombuffer(body, dtype="<i4", offset=_HEAD.size + 4 * count)
        if int(lengths.sum()) != len(tokens):
            raise ValueError("its lengths do not add up")
        ends = np.cumsum(lengths)
        return [tokens[end - length:end].tolist() for length, end in zip(lengths, ends)]


class _Foreign(Exception):
    """The file was written for another tokenizer."""
