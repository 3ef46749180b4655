"""What the engine's caches keep beyond one process and one conversation.

With a prompt cache file (--prompt-cache, prompt_cache.py's format), the first run starts from
the caches a previous process saved there, and every run saves its prompt's caches for the
next process (--prompt-cache-ro: restored, never written). With a RAM cache (--cache-ram,
ram_cache.py), a prompt that would cut the caches saves them in host memory first, and one
that an earlier saved conversation continues better restores that. Neither ever fails a run:
what cannot be read, written or restored is left out, with a notice or a log line.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

from speculative.decoding.cache import Cache, HeadCache
from speculative.engine import prompt_cache, ram_cache
from speculative.errors import GenerationError, UsageError

NEXTN_ROLE = "target-nextn"  # the prompt cache part of the target's NextN rows (draft-mtp)


class CachePersistence:
    """The prompt cache file and the RAM cache of one engine's caches (role -> Cache, and the
    target's MTP head, whose rows are saved with the target's part)."""

    def __init__(self, caches: dict[str, Cache], head_cache: HeadCache | None,
                 notify: Callable[[str], None] | None = None, file: Path | None = None, read_only: bool = False,
                 ram_mib: int = 0):
        self.caches, self.head_cache, self.notify = caches, head_cache, notify
        self.target = caches["target"].model
        self.file = file
        self.read_only = read_only
        self.restore_pending = file is not None  # the first run restores it
        self._file_holds: dict[str, tuple[int, ...]] = {}  # role -> tokens the cache file holds
        # --cache-ram: earlier conversations' caches in host memory (0: none; -1: no size limit)
        target_cache = caches["target"]
        self.ram_cache = ram_cache.RamCache(ram_mib, lambda state, tokens, limit: (
            target_cache.keepable_after_restore(state.tokens, tokens, limit, state.checkpoint))
        ) if ram_mib else None
        self._ram_lock = threading.Lock()  # requests that run at once share the RAM cache

    def view(self, caches: dict[str, Cache], head_cache: HeadCache | None) -> "CachePersistence":
        """The persistence of another request's caches on the same models (parallel.py): the
        same RAM cache, and no prompt cache file (a file holds one conversation)."""
        view = CachePersistence(caches, head_cache, self.notify)
        view.ram_cache, view._ram_lock = self.ram_cache, self._ram_lock
        return view

    def swap_ram(self, prompt: list[int]) -> float:
        """--cache-ram (ram_cache.py): keep the caches in host memory when this prompt would cut
        them, and restore the entry that keeps more of it; the seconds it took."""
        if self.ram_cache is None:
            return 0.0
        with self._ram_lock:
            return self._swap_ram(prompt)

    def _swap_ram(self, prompt: list[int]) -> float:
        t0 = time.perf_counter()
        target = self.caches["target"]
        limit = len(prompt) - 1  # the prompt's last token is always decoded (loop.prefill)
        kept = target.keepable(prompt, limit)
        entry, reused = self.ram_cache.best(prompt, limit)
        swap = entry is not None and reused >= kept + ram_cache.MIN_TOKENS
        if swap:
            self.ram_cache.use(entry)  # first: making room for what the caches hold evicts others
        if len(target) and (swap or len(target) - kept >= ram_cache.MIN_TOKENS):
            self.save_to_ram()
        if swap:  # (evicted by now if the budget holds only one entry: restored all the same)
            for role, state in entry.parts.items():
                if not self._load_state(role, state.tokens, state.data, state.checkpoint):
                    ram_cache.log.warning("cache-ram: could not restore the %s part of %d tokens", role,
                                          len(state.tokens))
            ram_cache.log.info("cache-ram: restored %d tokens, %d of them this prompt's", len(entry.tokens),
                               target.keepable(prompt, limit))
        return time.perf_counter() - t0

    def keep(self) -> None:
        """Keep what the caches hold now in the RAM cache (none without one), where later runs on
        these models find it: before the caches are emptied, the conversation they hold (as
        llama-server does), for a request that continues it; a request's first choice's prompt,
        for its other n choices to restore."""
        if self.ram_cache is not None and len(self.caches["target"]) >= ram_cache.MIN_TOKENS:
            with self._ram_lock:
                self.save_to_ram()

    def save_to_ram(self) -> None:
        """Keep what every cache holds now in the RAM cache (ram_cache.RamCache.add)."""
        try:
            self.ram_cache.add({role: ram_cache.State(tokens, copy(), self.caches[role].saved_checkpoint()
                                                      if role in self.caches else None)
                                for role, (tokens, copy) in self._cache_states().items()})
        except (GenerationError, MemoryError) as e:  # a cache problem never fails the request
            ram_cache.log.warning("cache-ram: could not save the caches: %s", e or "out of memory")

    def restore_file(self) -> float:
        """Load every part of the prompt cache file that these models can use; the seconds
        it took. What cannot be used is left out with a notice, never an error."""
        self.restore_pending = False
        t0 = time.perf_counter()
        try:
            parts, notices = prompt_cache.read(self.file, self._cache_identities())
        except FileNotFoundError:
            if self.read_only:
                self._notice("does not exist; nothing restored")
            return 0.0
        except (prompt_cache.Unusable, OSError) as e:
            self._notice(f"ignored: {getattr(e, 'strerror', None) or e}")
            return 0.0
        for notice in notices:
            self._notice(notice)
        for part in parts:
            if self._load_state(part.role, part.tokens, part.state):
                self._file_holds[part.role] = part.tokens
            else:
                self._notice(f"could not load the {part.role} part (-c smaller than its {len(part.tokens)} "
                             "tokens?); ignored")
        return time.perf_counter() - t0

    def save_file(self) -> float:
        """Write the caches for the prompt just processed (the target holds all of it but its
        last token) to the prompt cache file, unless it holds them already; the seconds it took."""
        if self.read_only:
            return 0.0
        t0 = time.perf_counter()
        states = self._cache_states()
        holds = {role: tokens for role, (tokens, _) in states.items()}
        if holds == self._file_holds:
            return 0.0
        identities = self._cache_identities()
        try:
            prompt_cache.write(self.file, [
                prompt_cache.Part(role, identities[role], tokens, state()) for role, (tokens, state) in states.items()])
        except (OSError, UsageError, GenerationError) as e:  # a cache problem never fails the run
            self._notice(f"not written: {getattr(e, 'strerror', None) or e}")
            return 0.0
        self._file_holds = holds
        return time.perf_counter() - t0

    def _cache_identities(self) -> dict[str, dict]:
        """What produced each part the prompt cache file may hold (LlamaModel.cache_identity)."""
        identities = {role: cache.model.cache_identity() for role, cache in self.caches.items()}
        if self.head_cache is not None:
            identities[NEXTN_ROLE] = {**identities["target"], "nextn_rows": self.head_cache.head.rows_key}
        return identities

    def _load_state(self, role: str, tokens: tuple[int, ...], state: bytes,
                    checkpoint: tuple[int, bytes] | None = None) -> bool:
        """Restore one part that _cache_states gave (the prompt cache file's or --cache-ram's);
        False (and that cache empty) when it cannot be loaded."""
        if role == NEXTN_ROLE:  # the rows of the tokens the target part restored
            return self.caches["target"].tokens() == tokens and self.target.load_nextn_state(state, len(tokens))
        return self.caches[role].restore(state, tokens, checkpoint)

    def _cache_states(self) -> dict[str, tuple[tuple[int, ...], Callable[[], bytes]]]:
        """What each cache holding anything holds, and how to copy its state: role -> (tokens,
        copy), the target first, then the target's NextN rows where all are known."""
        states = {role: (cache.tokens(), cache.save) for role, cache in self.caches.items() if len(cache)}
        rows = self.target.nextn_state(len(self.caches["target"])) if "target" in states else None
        if rows is not None:  # an MTP head follows a restored target from these
            states[NEXTN_ROLE] = (states["target"][0], lambda: rows)
        return states

    def _notice(self, message: str) -> None:
        if self.notify:
            self.notify(f"prompt cache {self.file}: {message}")
