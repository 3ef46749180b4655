"""What every drafting head's context shares: a context of its own beside the target's, whose
entry at position p is a token with a row of the target's hidden states (decoding.backend.Head).

The kinds of head each say what they are and which contract they fulfil:
  mtp.py     MtpHead: the target's NextN (MTP) layers, an MTP head file, or a Gemma-4
             assistant; token by token (Head)
  eagle3.py  EagleHead: an EAGLE-3 drafter, its entries one KV position down; token by token
  dflash.py  DflashHead: a DFlash or DSpark drafter, the target's rows injected; a block a
             decode (BlockHead)

With several requests at once (slots.py) a head's context has a sequence per slot, as the
target's has; the slots' entries of one step go in one decode (decode_parts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import llama_cpp as ll
import numpy as np

from speculative.llamacpp import ext
from speculative.llamacpp.decode import Context
from speculative.llamacpp.nextn import NextnRows


@dataclass(frozen=True)
class HeadPart:
    """One slot's entries in a decode of several (HeadContext.decode_parts): tokens at positions
    pos, pos+1, ... with their hidden rows."""
    tokens: Sequence[int]
    pos: int
    rows: np.ndarray
    slot: int
    head: int | None = None  # chained heads: the one head that decodes it; None: every head


HeadOutputs = tuple[np.ndarray, np.ndarray]  # an entry's logits and hidden row


def decode_chunks(run: Callable[[HeadPart], HeadOutputs | None], tokens: Sequence[int], pos: int,
                  rows: np.ndarray, slot: int, size: int, head: int | None = None) -> HeadOutputs | None:
    """Entries for tokens[i] with rows[i] at positions pos, pos+1, ... in slot's sequence, a chunk
    of at most `size` per `run` (a decode of its own): the last entry's outputs, or None at the
    first chunk that fails."""
    out = None
    for start in range(0, len(tokens), size):
        end = min(len(tokens), start + size)
        out = run(HeadPart(tokens[start:end], pos + start, rows[start:end], slot, head))
        if out is None:
            return None
    return out


class HeadContext(Context):
    """A head's context and what its kinds share: decoding entries (each a token and a row, the
    last one's logits and row read back), rolling back, the target's rows it drafts from, and
    its own weights, freed after the context on them. A kind sets, before its first decode,
    `_ctx`, `_mem`, `_batch`, `_rows` (a NextnRows per slot), `_own` (its own weights, or None),
    and the attributes of decoding.backend.Head."""

    kind = ""             # the --spec-type it drafts for
    n_heads = 1           # NextN layers chained, one per drafted token (1: one drafts every token)
    max_draft: int | None = None  # the longest draft it makes (None: as long as asked)
    shared_memory = False  # reads the target's cache instead of keeping its own (holds nothing)
    every_output = False  # whether a decode must ask for every entry's outputs to get the last one's
    _seqs_per_slot = 1    # its sequences per slot (the target's, where it shares the target's memory)
    _rows: Sequence[NextnRows]
    _own = None

    def target_rows(self, start: int, end: int, slot: int = 0) -> np.ndarray | None:
        """The target's rows for positions start..end-1 of slot's cache (-1: zeros), None where
        unknown."""
        return self._rows[slot].get(start, end)

    def decode(self, tokens: Sequence[int], pos: int, rows: np.ndarray, head: int | None = None) -> HeadOutputs | None:
        """Entries for tokens[i] with rows[i] at positions pos, pos+1, ... after the pos the
        cache holds (with chained heads: in every head's layer, or in `head`'s alone): the last
        entry's logits and row (views, valid until the next decode), or None when llama.cpp
        fails (the cache may then hold some of them)."""
        return decode_chunks(lambda part: self.decode_parts([part])[0], tokens, pos, rows, 0, self.n_batch, head)

    def decode_parts(self, parts: Sequence[HeadPart]) -> list[HeadOutputs | None]:
        """Several slots' entries in one decode (together no more than n_batch): each part's last
        entry's logits and row, as `decode` gives them (None for every part when llama.cpp fails)."""
        batch, end = self._batch, 0
        ends = []
        for part in parts:
            start, end = end, end + len(part.tokens)
            batch.tok[start:end] = part.tokens
            batch.pos[start:end] = np.arange(part.pos, part.pos + len(part.tokens))
            batch.embd[start:end] = part.rows
            batch.out[start:end] = self.every_output
            batch.out[end - 1] = 1
            ends.append(end - 1)
        batch.set_seqs([(part.slot * self._seqs_per_slot,) for part in parts for _ in part.tokens])
        if batch.run(end) != 0:
            return [None] * len(parts)
        return [self._outputs(i) for i in ends]

    def _outputs(self, i: int) -> HeadOutputs:
        """The logits and row of the latest decode's entry i."""
        hidden = ext.get_embeddings_nextn_ith(self._ctx, i)
        return self._batch.logits(i), np.ctypeslib.as_array(hidden, shape=(self.n_embd,))

    def trim(self, n_keep: int, slot: int = 0) -> None:
        if not self.shared_memory:  # the target's cells are the target's to roll back
            self._roll_back(slot, n_keep)

    def close(self) -> None:
        self._free_context()
        if self._own:  # its own weights: freed after the context on them
            ll.llama_model_free(self._own)
            self._own = None
