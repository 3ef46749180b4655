"""Generation under a grammar: which tokens it admits, exactly, at the cost of a few checks.

The constrained distribution is the target's logits with every token the grammar does not admit
removed, then the sampler chain (sampling.py): what output follows, greedy and sampled, and what
a draft model drafts from. Checking one token against a grammar state costs microseconds, masking
a 150k vocabulary milliseconds, so nothing here masks the whole vocabulary unless it must:

  the best k    the k best admissible tokens by a score are found among the best 64 by
                that score (in a permissive state, then the best 1,024), and only when those
                hold fewer than k, among all
                (`best`): exact, since a token outside the best n scores below all of them;
  all of them   tokens whose first byte (and, where few first bytes are possible, second
                byte) the grammar cannot take next are dropped before the grammar sees them
                (`VocabIndex.could_follow`);
  forced text   where the grammar admits exactly one next byte, and the next, ..., that text is
                forced (`forced_text`); the tokens it admits are then those that spell a prefix
                of it or begin with it, a short list, and when that list holds one admissible
                token that token is certain (kind a); otherwise the text is tokenized and
                drafted like any proposal (kind b; drafters/forced.py).

A draft is checked position by position against a copy of the state stepped along it; the real
state advances only along what the target accepted (loop.py). A grammar state is the
llama.cpp sampler llamacpp/grammar.py wraps; this module only asks it `admitted(ids)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from speculative.decoding.drafter import Draft
from speculative.errors import GenerationError

ROUNDS = (64, 1024)  # the best tried by score before every admissible token (1,024: in permissive states)
FEW_FIRST_BYTES = 16  # up to this many possible first bytes, tokens are sifted by their second too
FORCED_MAX = 48             # bytes of forced text looked ahead


class GrammarDeadEnd(GenerationError):
    """The grammar admits no token of the vocabulary here: the request cannot go on."""


class GrammarState(Protocol):
    """Where a grammar stands after the tokens it accepted (llamacpp.grammar.Grammar)."""
    index: "VocabIndex"
    timer: list[float]  # seconds its checks took, shared by its copies

    def copy(self) -> "GrammarState": ...
    def accept(self, token: int) -> None: ...         # the token must be admitted
    def admitted(self, ids: np.ndarray) -> np.ndarray: ...  # one bool per id
    def tokenize(self, text: bytes) -> list[int]: ...  # text as the model tokenizes it alone


class VocabIndex:
    """A vocabulary's token texts (as llama.cpp's grammar reads them: special tokens spelled out),
    grouped for the grammar: by first byte, by text, sorted; and one token per single byte."""

    def __init__(self, pieces: Sequence[bytes], eog: np.ndarray):
        self.n_vocab = len(pieces)
        self.pieces = pieces
        self.eog = np.asarray(eog, dtype=np.int32)
        first = np.fromiter((p[0] if p else 0 for p in pieces), dtype=np.int32, count=len(pieces))
        text = first > 0  # an empty piece, or one that starts with NUL, is never admitted
        text[self.eog] = False
        ids = np.flatnonzero(text).astype(np.int32)
        ids = ids[np.argsort(first[ids], kind="stable")]
        cuts = np.searchsorted(first[ids], np.arange(1, 256))
        self.by_first = np.split(ids, cuts)
        # each token's second byte + 1 (0: it has none), aligned with by_first
        second = np.fromiter((pieces[t][1] + 1 if len(pieces[t]) > 1 else 0 for t in ids.tolist()),
                             dtype=np.int32, count=len(ids))
        self.second_by_first = np.split(second, cuts)
        self._begins = np.array([len(group) > 0 for group in self.by_first])  # bytes a token begins with
        self.single = np.full(256, -1, dtype=np.int32)  # byte -> a token that is that byte alone
        lone = ids[np.fromiter((len(pieces[t]) == 1 for t in ids), dtype=bool, count=len(ids))]
        self.single[first[lone[::-1]]] = lone[::-1]  # the lowest id of each byte
        # forced text can be read off the grammar: every byte a token starts with is a token too
        self.every_byte = all(self.single[b] >= 0 or not len(self.by_first[b]) for b in range(256))
        self._texts: tuple[np.ndarray, np.ndarray] | None = None  # made when first spelt

    def could_follow(self, state: GrammarState) -> np.ndarray:
        """Every token whose first byte the grammar could take next, and, where it could take few
        first bytes (between the tokens of JSON: a quote, a space, a newline), whose first two
        bytes it could take; and the end-of-generation tokens. A superset of what it admits (a
        byte with no token of its own is kept)."""
        firsts = np.flatnonzero(self._next_bytes(state))
        if len(firsts) > FEW_FIRST_BYTES:
            return np.concatenate([self.eog, *(self.by_first[b] for b in firsts)])
        parts = [self.eog]
        for b in firsts:
            if self.single[b] < 0:
                parts.append(self.by_first[b])
                continue
            after = state.copy()
            after.accept(int(self.single[b]))
            second = np.concatenate([[True], self._next_bytes(after)])  # index: second byte + 1
            parts.append(self.by_first[b][second[self.second_by_first[b]]])
        return np.concatenate(parts)

    def _next_bytes(self, state: GrammarState) -> np.ndarray:
        """Which bytes that begin a token the grammar could take next (True where no token is that
        byte alone)."""
        known = self.single >= 0
        ok = self._begins.copy()
        ok[known] &= state.admitted(self.single[known])
        return ok

    def spelling(self, text: bytes) -> np.ndarray:
        """Tokens whose text is a prefix of `text` or begins with it."""
        if self._texts is None:  # the texts sorted, as fixed-width bytes numpy sorts in C
            ids = np.concatenate(self.by_first)
            texts = np.array([self.pieces[t] for t in ids.tolist()], dtype=bytes)
            order = np.argsort(texts, kind="stable")
            self._texts = texts[order], ids[order]
        texts, ids = self._texts
        found = [ids[np.searchsorted(texts, text[:n], "left"):np.searchsorted(texts, text[:n], "right")]
                 for n in range(1, len(text) + 1)]
        after = np.searchsorted(texts, text, "right")
        end = after + np.searchsorted(texts[after:], _successor(text), "left") if _successor(text) else len(texts)
        return np.unique(np.concatenate([*found, ids[after:end]])).astype(np.int32)


def _successor(text: bytes) -> bytes:
    """The least bytes greater than every bytes that begins with `text` (b'' where none is)."""
    stripped = text.rstrip(b"\xff")
    return stripped[:-1] + bytes([stripped[-1] + 1]) if stripped else b""


def admissible(state: GrammarState, scores: np.ndarray | None = None) -> np.ndarray:
    """Every token the grammar admits now (sorted ids). With `scores`: those not scored -inf,
    and GrammarDeadEnd where there is none."""
    return _admitted(state, state.index.could_follow(state), scores)


def _admitted(state: GrammarState, ids: np.ndarray, scores: np.ndarray | None) -> np.ndarray:
    ids = np.sort(ids[state.admitted(ids)]) if len(ids) else ids
    return ids if scores is None else _found(ids[np.isfinite(scores[ids])])


def best(state: GrammarState, scores: np.ndarray, k: int) -> np.ndarray:
    """The k admissible tokens of highest score (fewer when fewer are admitted), best first;
    tokens scored -inf are not admissible. Raises GrammarDeadEnd when none is."""
    hits = _best_of(state, scores, min(ROUNDS[0], len(scores)))
    if len(hits) >= k or ROUNDS[0] >= len(scores):
        return _found(hits[:k])
    candidates = state.index.could_follow(state)
    if len(candidates) > ROUNDS[1] * 4:  # a permissive state: its best are likely near the top
        hits = _best_of(state, scores, ROUNDS[1])
        if len(hits) >= k:
            return hits[:k]
    ids = _admitted(state, candidates, scores)
    return ids[np.argsort(-scores[ids], kind="stable")][:k]


def _best_of(state: GrammarState, scores: np.ndarray, size: int) -> np.ndarray:
    """Of the `size` best tokens by score, those admitted, best first."""
    top = np.argpartition(-scores, size - 1)[:size] if size < len(scores) else np.arange(len(scores))
    top = top[np.argsort(-scores[top], kind="stable")]
    return top[state.admitted(top) & np.isfinite(scores[top])]


def _found(ids: np.ndarray) -> np.ndarray:
    if not len(ids):
        raise GrammarDeadEnd("the grammar admits no token here: generation cannot go on")
    return ids


def best_one(state: GrammarState, scores: np.ndarray) -> int:
    """The best admissible token: the argmax itself, one check, most of the time."""
    token = int(np.argmax(scores))
    if np.isfinite(scores[token]) and state.admitted(np.array([token], dtype=np.int32))[0]:
        return token
    return int(best(state, scores, 1)[0])


def stepped(state: GrammarState | None, token: int) -> GrammarState | None:
    """A copy of `state` after `token` (None stays None)."""
    if state is None:
        return None
    state = state.copy()
    state.accept(token)
    return state


def check_draft(draft: Draft, state: GrammarState) -> Draft:
    """The draft as far as the grammar admits it. A token drafted deterministically (no q: an
    n-gram, a greedy draft, a tree's fork) that the grammar refuses is cut with what follows it;
    one sampled from a distribution is kept as the last of its branch, where the acceptance rule
    rejects it (p = 0) and draws from the residual, which cutting it would skip."""
    if not draft.tokens:
        return draft
    parents = draft.tree
    states: dict[int, GrammarState] = {-1: state}
    keep: list[int] = []
    ends = set(state.index.eog.tolist())
    for i, token in enumerate(draft.tokens):
        parent_state = states.get(parents[i])
        if parent_state is None:  # below a node that was cut or ends its branch
            continue
        if parent_state.admitted(np.array([token], dtype=np.int32))[0]:
            keep.append(i)
            if token not in ends:
                states[i] = parent_state.copy()
                states[i].accept(token)
        elif draft.q is not None and len(draft.q[i][0]) > 1:
            keep.append(i)  # sampled: rejected with certainty by the rule, and nothing below it
    if len(keep) == len(draft.tokens):
        return draft
    return _subset(draft, keep)


def _subset(draft: Draft, keep: list[int]) -> Draft:
    new = {old: j for j, old in enumerate(keep)}
    tokens = [draft.tokens[i] for i in keep]
    q = None if draft.q is None else tuple(draft.q[i] for i in keep)
    parents = None
    if draft.parents is not None:
        parents = tuple(new.get(draft.parents[i], -1) for i in keep)
    certain = next((j for j, old in enumerate(keep) if old != j or j >= draft.certain), len(keep))
    return Draft(tokens, draft.source, draft.kind, q, parents, certain)


def path_states(state: GrammarState, tokens: Sequence[int], parents: Sequence[int]):
    """A function of a verified row: the grammar state after the path to it (row 0: `state`,
    row i + 1: after drafted node i and its ancestors), each made once, from its parent's."""
    made: dict[int, GrammarState] = {0: state}

    def at(row: int) -> GrammarState:
        got = made.get(row)
        if got is None:
            got = at(parents[row - 1] + 1).copy()
            got.accept(tokens[row - 1])
            made[row] = got
        return got
    return at


@dataclass(frozen=True)
class Forced:
    """What the grammar forces next: `certain` tokens, each the only one it admits at its place
    (kind a), then `likely`, the rest of the forced text as the model tokenizes it (kind b)."""
    certain: list[int]
    likely: list[int]


def forced_text(state: GrammarState, limit: int = FORCED_MAX) -> bytes:
    """The bytes the grammar admits next, as far as it admits exactly one byte at a time (b''
    where it admits several, or may end here), whole UTF-8 characters only."""
    index = state.index
    if not index.every_byte:
        return b""
    probe = np.concatenate([index.eog, index.single])
    text = bytearray()
    walk = state
    while len(text) < limit:
        ok = walk.admitted(probe)
        if ok[: len(index.eog)].any() or ok.sum() != 1:
            break
        byte = int(np.flatnonzero(ok[len(index.eog):])[0])
        text.append(byte)
        walk = walk.copy()
        walk.accept(int(index.single[byte]))
    return _whole_characters(bytes(text))


def _whole_characters(text: bytes) -> bytes:
    for cut in range(len(text), max(len(text) - 4, -1), -1):
        try:
            text[:cut].decode("utf-8")
            return text[:cut]
        except UnicodeDecodeError:
            continue
    return b""


def forced(state: GrammarState, limit: int) -> Forced:
    """Up to `limit` tokens the grammar forces from `state`: certain ones while exactly one token
    spells the forced text's start, then the remaining forced text tokenized."""
    certain: list[int] = []
    walk = state
    while len(certain) < limit:
        text = forced_text(walk)
        if not text:
            return Forced(certain, [])
        ids = walk.index.spelling(text)
        ids = ids[walk.admitted(ids)] if len(ids) else ids
        if len(ids) != 1:
            return Forced(certain, _tokenized(walk, text, limit - len(certain)))
        certain.append(int(ids[0]))
        walk = walk.copy()
        walk.accept(certain[-1])
    return Forced(certain, [])


def _tokenized(state: GrammarState, text: bytes, limit: int) -> list[int]:
    """`text` as the model spells it, as far as the grammar admits it (all of it, normally), less
    the token that ends it: the text stops where the grammar admits several bytes, and the model
    often spells its end together with what comes next (a key's closing `"` as `":`)."""
    spelled = state.tokenize(text)
    tokens: list[int] = []
    walk = state
    for token in spelled[:limit] if len(spelled) > limit else spelled[:-1]:
        if not walk.admitted(np.array([token], dtype=np.int32))[0]:
            break
        tokens.append(token)
        walk = walk.copy()
        walk.accept(token)
    return tokens


class Constraint:
    """A run's grammar: its state after what the run emitted. The loop alone advances it, along
    accepted tokens; drafters and verification step copies."""

    def __init__(self, state: GrammarState):
        self.state = state
        self._ends = set(state.index.eog.tolist())

    def advance(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            if token not in self._ends:  # an end of generation ends the run, not the grammar
                self.state.accept(token)

    @property
    def seconds(self) -> float:
        """What the grammar's own checks cost the run so far."""
        return self.state.timer[0]

    def complete(self) -> bool:
        """Whether the grammar may end here (it admits an end-of-generation token)."""
        eog = self.state.index.eog
        return not len(eog) or bool(self.state.admitted(eog).any())
