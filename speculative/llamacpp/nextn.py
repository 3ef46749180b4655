"""The target's NextN hidden states, by position: what an MTP head drafts from.

A model with NextN (multi-token prediction) layers drafts with them (`--spec-type
draft-mtp`): the MTP head's entry at position p is the token at p with the target's
hidden state at p - 1 (its last hidden state, the row llama.cpp calls h_nextn). llama.cpp
hands those rows out only until the next decode, so the target copies them here after
each one (llamacpp.model.LlamaModel); cache.HeadCache reads them when it brings the MTP head up
to date. A row stays valid while the target's cache still holds the tokens it was
computed from, so every change to that cache goes through here too: a decode at p
replaces the rows from p on, a rollback to n drops those from n on, a restored cache
drops them all, unless the prompt cache file held them too (engine.persist.NEXTN_ROLE).
"""

from __future__ import annotations

import numpy as np


class NextnRows:
    """Rows for positions start..end-1 of what the target's cache holds."""

    def __init__(self, n_embd: int):
        self.n_embd = n_embd
        self._rows = np.zeros((0, n_embd), dtype=np.float32)  # row p: position p
        self.start = self.end = 0

    def put(self, pos: int, rows: np.ndarray) -> None:
        """The target decoded positions pos..pos+len(rows)-1 (its cache held pos before)."""
        end = pos + len(rows)
        if end == pos:
            return
        if end > len(self._rows):
            grown = np.zeros((max(end, 2 * len(self._rows)), self.n_embd), dtype=np.float32)
            grown[: self.end] = self._rows[: self.end]
            self._rows = grown
        self._rows[pos:end] = rows
        if not self.start <= pos <= self.end:  # a gap before it: rows the target never gave
            self.start = pos
        self.end = end

    def cut(self, n: int) -> None:
        """The target's cache holds positions 0..n-1 only."""
        self.end = min(self.end, n)
        if self.end <= self.start:
            self.start = self.end = 0

    def get(self, start: int, end: int) -> np.ndarray | None:
        """Rows for positions start..end-1 (position -1, before the first token: zeros, as
        llama.cpp pairs a sequence's first token), or None when any is not known."""
        if end <= start:
            return np.zeros((0, self.n_embd), dtype=np.float32)
        first = max(start, 0)
        if end > self.end or (first < self.start and first < end):
            return None
        rows = self._rows[first:end]
        if start < 0:
            rows = np.concatenate([np.zeros((-start, self.n_embd), dtype=np.float32), rows])
        return rows
