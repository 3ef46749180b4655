"""--cache-ram MiB: earlier conversations' caches kept in host memory (llama-server's prompt cache).

One generation runs at a time on one cache per model (cache.py), so two clients taking turns
would cut each other's conversation out of it and have it processed again on every turn.
Before a request is processed, the engine (Engine.run) asks this cache:

- for the entry whose restored caches would keep the longest prefix of the new prompt: if
  that is MIN_TOKENS or more beyond what the caches keep as they are, the caches are saved
  here and the entry is restored into them (copied: it stays, now the most recently used);
- otherwise, when the request drops MIN_TOKENS or more of the tokens the caches hold (it does
  not continue their conversation), the caches are saved here before they are cut.

An entry is every model's sequence state as llama.cpp serialises it (the target's, the draft
model's, the target's NextN rows for an MTP head, and a recurrent model's checkpoint), under
the tokens the target's cache holds. What a restore would keep is the target cache's own
rule (Cache.keepable_after_restore): the shared prefix, or for a recurrent state all of the
entry or its checkpoint. An entry that already gives back all of a state being saved takes
its place (nothing is copied); entries that the new one gives back in full go. The budget
counts state bytes; the least recently used entries go to make room, and a state larger
than the whole budget is not kept.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

log = logging.getLogger("speculate.cache_ram")

DEFAULT_MIB = 8192  # llama-server's --cache-ram
MIN_TOKENS = 16  # a save or a restore must be worth at least this many tokens of prompt processing


@dataclass(frozen=True)
class State:
    """One model's cache: `data` (llama.cpp's bytes) holds `tokens` from position 0."""
    tokens: tuple[int, ...]
    data: bytes
    checkpoint: tuple[int, bytes] | None = None  # a recurrent state's (length, partial state)

    @property
    def nbytes(self) -> int:
        return len(self.data) + (len(self.checkpoint[1]) if self.checkpoint else 0)


@dataclass(frozen=True)
class Entry:
    parts: dict[str, State]  # role -> state; "target" is always there

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.parts["target"].tokens

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts.values())


# How many tokens of `tokens` (at most `limit`) a target cache restored from a state keeps.
Reuse = Callable[[State, Sequence[int], "int | None"], int]


class RamCache:
    def __init__(self, limit_mib: int, reuse: Reuse):
        """`limit_mib`: the budget in MiB (-1: none); `reuse`: the target cache's rule."""
        if limit_mib == 0 or limit_mib < -1:
            raise ValueError(f"a RAM cache of {limit_mib} MiB")
        self.limit = None if limit_mib < 0 else limit_mib << 20  # bytes
        self._reuse = reuse
        self._entries: list[Entry] = []  # least recently used first

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries)

    def entries(self) -> list[Entry]:
        """Least recently used first (a copy)."""
        return list(self._entries)

    def best(self, prompt: Sequence[int], limit: int | None = None) -> tuple[Entry | None, int]:
        """The entry whose restore keeps the most of `prompt` (at most `limit` tokens), and how
        many; (None, 0) when none keeps anything. Ties go to the most recently used."""
        found, kept = None, 0
        for entry in reversed(self._entries):
            n = self._reuse(entry.parts["target"], prompt, limit)
            if n > kept:
                found, kept = entry, n
        return found, kept

    def use(self, entry: Entry) -> None:
        """`entry` is being restored: it becomes the most recently used."""
        self._entries.remove(entry)
        self._entries.append(entry)

    def add(self, parts: dict[str, State]) -> bool:
        """Keep `parts` (what every cache holds now) as the most recently used entry, making
        room by evicting the least recently used; False when nothing new was kept (an entry
        gives all of it back already, or it is larger than the whole budget)."""
        new = Entry(parts)
        n = len(new.tokens)
        for entry in self._entries:
            if self._reuse(entry.parts["target"], new.tokens, None) == n:
                self.use(entry)
                return False
        if self.limit is not None and new.nbytes > self.limit:
            log.warning("cache-ram: a state of %d tokens (%s) is larger than --cache-ram %s; not kept",
                        n, _mib(new.nbytes), _mib(self.limit))
            return False
        kept = []
        for entry in self._entries:  # the new entry gives these back in full
            if self._reuse(new.parts["target"], entry.tokens, None) == len(entry.tokens):
                log.info("cache-ram: %d tokens (%s) superseded by the new entry", len(entry.tokens),
                         _mib(entry.nbytes))
            else:
                kept.append(entry)
        self._entries = kept
        while self.limit is not None and self._entries and self.nbytes + new.nbytes > self.limit:
            old = self._entries.pop(0)
            log.info("cache-ram: evicted %d tokens (%s), the least recently used", len(old.tokens),
                     _mib(old.nbytes))
        self._entries.append(new)
        log.info("cache-ram: saved %d tokens (%s); %d entries, %s of %s", n, _mib(new.nbytes),
                 len(self._entries), _mib(self.nbytes), "no limit" if self.limit is None else _mib(self.limit))
        return True


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"
