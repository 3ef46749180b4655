"""`ngram-cache`: llama.cpp's common_ngram_cache (common/ngram-cache.cpp) as llama-lookup drafts
with it, ported as it is.

Three caches map each n-gram of 1 to 4 tokens to the tokens that followed it and how often:
  context  the prompt and the output of this request, updated with every new token;
  dynamic  earlier requests' (-lcd FILE, plus what this engine's requests learned);
  static   a corpus's 2-grams (-lcs FILE, written by llama-lookup-create), never changed.

Each drafted token is the first that passes, trying the context cache (4-grams down to
1-grams, lax thresholds), then the dynamic one (strict thresholds), then the static 2-gram
alone. In the first two, a candidate's count is weighed by 100 x its static count (1 where
the static cache never saw it after the last 2 tokens), and the best must have been seen
often enough, and often enough relative to the others, for its n-gram size:

    n-gram size            1    2    3    4
    lax:    min. seen      2    2    1    1     min. share   66%  50%  50%  50%
    strict: min. seen      4    3    2    2     min. share   75%  66%  66%  66%

and the static fallback needs 2 and 50%. Drafting goes on with the drafted tokens as context,
up to the step's length. At the end of a request, its context cache is merged into the dynamic
one (llama-lookup merges and saves it; the engine saves -lcd when it closes).

Where llama.cpp leaves something to chance, this picks: of tokens with equal weighted counts
the lowest id wins (llama.cpp: whichever its std::unordered_map visits first), and n-grams
longer than the history are not looked up (llama.cpp reads before the first token).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping, Protocol, Sequence

from speculative.decoding.drafter import Draft, Drafter
from speculative.drafters import lookup_cache

NGRAM_MIN, NGRAM_MAX, NGRAM_STATIC = 1, 4, 2  # LLAMA_NGRAM_MIN, _MAX, _STATIC
# n-gram size -> (least times seen, least share in percent) for the best token
LAX = {1: (2, 66), 2: (2, 50), 3: (1, 50), 4: (1, 50)}
STRICT = {1: (4, 75), 2: (3, 66), 3: (2, 66), 4: (2, 66)}

Part = Mapping[int, int]  # token -> how often it followed an n-gram


class Source(Protocol):
    def part(self, gram: Sequence[int]) -> Part | None: ...


class Counts:
    """An n-gram cache in memory, as it grows (llama.cpp's common_ngram_cache)."""

    def __init__(self):
        self.parts: dict[tuple[int, ...], dict[int, int]] = {}

    def update(self, tokens: Sequence[int], start: int) -> None:
        """common_ngram_cache_update(tokens, nnew = len(tokens) - start): count each token from
        `start` on after each of the 1- to 4-grams before it."""
        for i in range(start, len(tokens)):
            token = tokens[i]
            for size in range(NGRAM_MIN, min(NGRAM_MAX, i) + 1):
                part = self.parts.setdefault(tuple(tokens[i - size : i]), {})
                part[token] = part.get(token, 0) + 1

    def merge(self, other: "Counts") -> None:
        """common_ngram_cache_merge: add another cache's counts."""
        for gram, part in other.parts.items():
            mine = self.parts.setdefault(gram, {})
            for token, count in part.items():
                mine[token] = mine.get(token, 0) + count

    def part(self, gram: Sequence[int]) -> Part | None:
        return self.parts.get(tuple(gram))


class Layered:
    """Several caches read as one (a loaded file and what was learned since): counts add up."""

    def __init__(self, *sources: Source):
        self.sources = sources

    def part(self, gram: Sequence[int]) -> Part | None:
        found = [p for p in (s.part(gram) for s in self.sources) if p]
        if len(found) <= 1:
            return found[0] if found else None
        total: dict[int, int] = {}
        for p in found:
            for token, count in p.items():
                total[token] = total.get(token, 0) + count
        return total


def draft(history: Sequence[int], n_draft: int, context: Source, dynamic: Source, static: Source) -> list[int]:
    """common_ngram_cache_draft: up to n_draft tokens after `history`."""
    if len(history) < NGRAM_STATIC:
        return []
    seq = list(history[-NGRAM_MAX:])
    drafted: list[int] = []
    while len(drafted) < n_draft:
        static_part = static.part(seq[-NGRAM_STATIC:]) or {}
        grams = {size: seq[-size:] for size in range(NGRAM_MIN, min(NGRAM_MAX, len(seq)) + 1)}
        token = _pick(context, grams, static_part, LAX)
        if token is None:
            token = _pick(dynamic, grams, static_part, STRICT)
        if token is None:
            token = _pick_static(static_part)
        if token is None:
            break
        drafted.append(token)
        seq.append(token)
    return drafted


def _pick(cache: Source, grams: dict[int, Sequence[int]], static_part: Part,
          thresholds: dict[int, tuple[int, int]]) -> int | None:
    """try_draft on a primary cache: the longest n-gram whose best continuation passes."""
    def weight(token: int) -> int:
        return 100 * static_part[token] if token in static_part else 1

    for size in sorted(grams, reverse=True):
        part = cache.part(grams[size])
        if not part:
            continue
        token, count = max(part.items(), key=lambda tc: (tc[1] * weight(tc[0]), -tc[0]))
        total = sum(part.values())
        least, share = thresholds[size]
        if total >= least and 100 * count >= share * total:
            return token
    return None


def _pick_static(part: Part) -> int | None:
    """try_draft on the static cache alone: its most frequent token after the last 2-gram."""
    if not part:
        return None
    token, count = max(part.items(), key=lambda tc: (tc[1], -tc[0]))
    total = sum(part.values())
    least, share = LAX[NGRAM_STATIC]
    return token if total >= least and 100 * count >= share * total else None


class LookupFiles:
    """An engine's -lcs and -lcd caches: read once, shared by its requests. What the requests
    generate is learned into the dynamic cache, and `save` writes it back to -lcd (llama-lookup:
    merge the context into the dynamic cache, then save it)."""

    def __init__(self, static: Path | None, dynamic: Path | None, n_vocab: int, notify: Callable[[str], None]):
        self.notify = notify
        self.static = self._load("-lcs", static, n_vocab) if static else lookup_cache.Table.empty()
        self.dynamic_path = dynamic  # None: nothing to write
        self._file = self._load("-lcd", dynamic, n_vocab) if dynamic else lookup_cache.Table.empty()
        self.learned = Counts()
        self.dynamic = Layered(self._file, self.learned)

    def _load(self, flag: str, path: Path, n_vocab: int) -> lookup_cache.Table:
        try:
            return lookup_cache.read(path, n_vocab)
        except FileNotFoundError:
            if flag == "-lcs":
                self.notify(f"{flag} {path}: does not exist; ignored")
            return lookup_cache.Table.empty()  # -lcd: written at the end
        except (lookup_cache.Unusable, OSError) as e:
            keep = isinstance(e, (lookup_cache.NotACache, lookup_cache.OtherVocabulary))
            if flag == "-lcs":
                outcome = "ignored"
            elif keep:
                outcome, self.dynamic_path = "ignored, and left as it is", None
            else:
                outcome = "ignored; what this run generates will replace it"
            self.notify(f"{flag} {path}: {getattr(e, 'strerror', None) or e}; {outcome}")
            return lookup_cache.Table.empty()

    def learn(self, counts: Counts) -> None:
        """A request's context cache joins the dynamic one (when there is a -lcd file to keep it)."""
        if self.dynamic_path is not None:
            self.learned.merge(counts)

    def save(self) -> None:
        """Write the dynamic cache, with what was learned, to -lcd; a failure is a notice."""
        if self.dynamic_path is None or not self.learned.parts:
            return
        try:
            lookup_cache.write(self.dynamic_path, self._file.merged(self.learned.parts))
        except OSError as e:
            self.notify(f"-lcd {self.dynamic_path}: not written: {e.strerror or e}")


class NgramCache(Drafter):
    """The llama-lookup draft loop: the context cache follows the history, and each step drafts
    from the three caches (as common_speculative_impl_ngram_cache, which drafts 8 tokens)."""

    name = "ngram-cache"
    free = True

    def __init__(self, files: LookupFiles):
        self.files = files
        self.context = Counts()
        self.seen = 0  # tokens of the history counted in the context cache

    def prefill(self, prompt: Sequence[int]) -> None:
        self._follow(prompt)

    def propose(self, context: Sequence[int], k: int) -> Draft:
        self._follow(context)
        return Draft(draft(context, k, self.context, self.files.dynamic, self.files.static), self.name)

    def finish(self, context: Sequence[int]) -> None:
        self._follow(context)
        self.files.learn(self.context)

    def _follow(self, history: Sequence[int]) -> None:
        self.context.update(history, self.seen)
        self.seen = len(history)
