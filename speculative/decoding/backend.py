"""The interfaces the loop, the drafters and cache.py read models through: Backend, a model
and its KV cache; Head and BlockHead, the drafting heads beside the target; and the decodes a
step needs of them (Decode, HeadDecode), which it yields instead of running them.

A Backend is one loaded model and its KV cache. The real one lives in
`speculative/llamacpp/` (the only package that imports llama_cpp); tests use a fake one.
Positions are explicit and the backend keeps no record of what its cache holds:
cache.py's Cache, the one owner of that record, is the only caller of the
cache-changing methods below.

Between steps the cache is one sequence (id 0). Draft trees (tree.py) use
sequences 1..n_seq-1 for their other branches within a step, and fold the
accepted branch back into sequence 0 with `keep_branch`.

The loop, the drafters and the caches do not run their decodes: they are generators (Work)
that yield each decode they need and, resumed, read its `result()` (its rows, or its error
raised). Whatever lies between them and the scheduler passes a Need up as it is. The scheduler
(scheduler.py) runs the decodes of every running request of one model in one llama_decode, or
one alone (`run_alone`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Generator, Iterator, Literal, Protocol, Sequence, TypeVar, Union

if TYPE_CHECKING:  # annotations only: the command line's --help imports this without numpy
    import numpy as np

Outputs = Literal["all", "last", "none"]


class Backend(Protocol):
    name: str       # what the user called it (registry name or file name)
    n_vocab: int
    n_ctx: int      # positions 0..n_ctx-1 exist
    n_batch: int    # most tokens one `decode` call scores with outputs="all"
    n_seq: int      # sequences (draft-tree branches) the cache can hold
    rollback_limit: int | None  # None: `trim` removes any suffix; k: at most the latest k tokens
                                # of the latest decode, never all of them, once (a recurrent
                                # state's snapshots)

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        """Tokens of `text`; special-token text is parsed (as llama.cpp does)."""
        ...

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes of one token's text (may be part of a UTF-8 character)."""
        ...

    def is_eog(self, token: int) -> bool:
        """Whether the token ends generation (EOS, EOT, ...)."""
        ...

    def eog_tokens(self) -> np.ndarray:
        """All end-of-generation token ids (for --ignore-eos)."""
        ...

    def decode(self, tokens: Sequence[int], pos: int, outputs: Outputs) -> list[np.ndarray]:
        """Run the model over `tokens` placed at positions pos, pos+1, ...

        The cache must hold exactly positions 0..pos-1 before the call. Returns
        one logits row per token for "all", the last token's row for "last",
        nothing for "none". Rows are views valid until the next decode call.
        """
        ...

    def trim(self, n_keep: int) -> None:
        """Roll the cache back so it holds positions 0..n_keep-1 only (in every sequence)."""
        ...

    def decode_branches(self, tokens: Sequence[int], positions: Sequence[int],
                        seqs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Score tokens of several sequences in one batch: token i goes at positions[i]
        in each sequence of seqs[i], and sees what its first sequence holds before it.
        Every sequence must hold exactly the positions before its first token here.
        Returns one logits row per token (views, valid until the next decode)."""
        ...

    def copy_branch(self, src: int, dst: int) -> None:
        """Sequence dst holds what sequence src holds (and nothing else)."""
        ...

    def keep_branch(self, seq: int, n_keep: int) -> None:
        """Keep sequence seq's positions 0..n_keep-1 as the cache (sequence 0); drop
        everything else."""
        ...

    def save_state(self, partial: bool = False) -> bytes:
        """Sequence 0's cache, serialised (for the prompt cache file); `partial`: only a
        recurrent model's state, a checkpoint for cache.py."""
        ...

    def load_state(self, data: bytes, n_tokens: int, partial: bool = False) -> bool:
        """Make sequence 0 hold exactly positions 0..n_tokens-1 from `data` (save_state's);
        on failure the cache is left empty and False returned. `partial`: a checkpoint of
        the recurrent state at n_tokens, over the attention cells kept up to there."""
        ...


class Head(Protocol):
    """A drafter that reads the target's hidden rows, in a context of its own beside the target's
    (llamacpp/head.py), drafting token by token: the target's NextN (MTP) layers, an MTP head
    file or a Gemma-4 assistant (draft-mtp), an EAGLE-3 drafter (draft-eagle3). Entry p is the
    token at p with a row, and predicts the token at p + 1. cache.HeadCache is the only caller
    of `decode` and `trim`."""
    kind: str       # the --spec-type it drafts for
    name: str
    file: object    # what it runs, known by content (its costs' identity; None: the target's own layers)
    rows_key: object  # which of the target's rows it reads (the prompt cache's identity of them)
    n_embd: int     # the width of a row
    n_vocab: int
    n_ctx: int      # positions 0..n_ctx-1 exist
    n_batch: int
    n_heads: int    # NextN layers chained, one per drafted token (1: one head drafts every token)
    max_draft: int | None  # the longest draft it makes (chained heads: one per head); None: any
    shared_memory: bool  # reads the target's cache instead of keeping its own (a Gemma-4 assistant):
                         # each entry decoded alone at the context's last position, nothing held

    def target_rows(self, start: int, end: int) -> np.ndarray | None:
        """The target's rows for positions start..end-1 of what its cache holds (-1: zeros), or
        None when any is not known (nextn.py)."""
        ...

    def decode(self, tokens: Sequence[int], pos: int, rows: np.ndarray,
               head: int | None = None) -> tuple[np.ndarray, np.ndarray] | None:
        """Entries for tokens[i] with rows[i] at positions pos, pos+1, ... (the cache holds
        exactly 0..pos-1), in every head's layers or `head`'s alone: the last one's logits and
        row (views valid until the next decode), or None when the decode failed."""
        ...

    def trim(self, n_keep: int) -> None:
        """Hold positions 0..n_keep-1 only."""
        ...


@dataclass(frozen=True)
class Block:
    """What a block decode gives, a row per block position: the logits (None for DFlash2), and
    the pre-norm rows where they are read (DSpark's confidence, DFlash2's lattice)."""
    logits: np.ndarray | None
    rows: np.ndarray | None


class BlockHead(Head, Protocol):
    """A head that drafts a whole block in one decode (DFlash, DSpark: llamacpp/dflash.py): its
    entries inject the target's rows; `block` decodes [token, mask, ...] after them."""
    anchor: bool      # the block's first row drafts too (DSpark)
    confidence: bool  # its rows carry a confidence to cut drafts with (DSpark)
    lattice: bool     # it drafts a lattice of candidates (DFlash2), walked by selector_top_k
    selector_top_k: int

    def block(self, token: int, pos: int, k: int) -> Block | None:
        """Up to k drafted tokens after `token` at position `pos` (the cache holds 0..pos-1),
        dropped again after; None when the decode failed."""
        ...


class _Need:
    """What a decode a step needs gives back, once the scheduler has run it (`done`, `fail`)."""
    _value: object = None
    _error: BaseException | None = None

    def done(self, value: object) -> None:
        self._value, self._error = value, None

    def fail(self, error: BaseException) -> None:
        self._error = error

    def result(self):
        """What the decode gave; raises what it failed with."""
        if self._error is not None:
            raise self._error
        return self._value


@dataclass(eq=False)  # each is itself: two alike are two decodes
class Decode(_Need):
    """A decode of `model` a step needs: tokens at positions, each in sequence 0 (seqs None) or in
    the sequences of seqs[i] (a draft tree's), and the rows it wants (Backend.decode's outputs;
    a tree's are "all"); its result is those rows. The scheduler says what else ran in the same
    llama_decode: other requests' tokens, and how many of those got a token from it."""
    model: Backend
    tokens: Sequence[int]
    positions: Sequence[int]
    seqs: Sequence[Sequence[int]] | None
    outputs: Outputs
    others: int = 0
    others_scored: int = 0

    @property
    def splits(self) -> bool:
        """Whether it may run in chunks (a prompt's: it wants no row but the last)."""
        return self.seqs is None and self.outputs != "all"

    def split(self, n: int) -> "Decode":
        """Its first n tokens as a decode of their own, which wants no row; it keeps the rest."""
        first = Decode(self.model, self.tokens[:n], self.positions[:n], None, "none")
        self.tokens, self.positions = self.tokens[n:], self.positions[n:]
        return first

    def run(self) -> list[np.ndarray]:
        """Alone: in a llama_decode of its own."""
        if self.seqs is None:
            return self.model.decode(self.tokens, self.positions[0] if len(self.positions) else 0, self.outputs)
        return self.model.decode_branches(self.tokens, self.positions, self.seqs)


@dataclass(eq=False)
class HeadDecode(_Need):
    """Entries of a drafting head a step needs (Head.decode's): its result is the last one's logits
    and row, or None when the decode failed."""
    head: Head
    tokens: Sequence[int]
    pos: int
    rows: np.ndarray
    index: int | None = None  # chained heads: the one head that decodes them

    splits = True  # its result is its last entry's

    def split(self, n: int) -> "HeadDecode":
        """Its first n entries as a decode of their own; it keeps the rest."""
        first = HeadDecode(self.head, self.tokens[:n], self.pos, self.rows[:n], self.index)
        self.tokens, self.pos, self.rows = self.tokens[n:], self.pos + n, self.rows[n:]
        return first

    def run(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Alone: in a decode of its own."""
        if self.index is None:
            return self.head.decode(self.tokens, self.pos, self.rows)
        return self.head.decode(self.tokens, self.pos, self.rows, head=self.index)


Need = Union[Decode, HeadDecode]
NEEDS = (Decode, HeadDecode)
T = TypeVar("T")
Work = Generator[Need, None, T]  # what yields the decodes it needs and returns T (a drafter's proposal)


def needs_of(work: Iterator) -> Work[object]:
    """The decodes a work needs, passed on, what else it yields left out; what it returns."""
    while True:
        try:
            item = next(work)
        except StopIteration as end:
            return end.value
        if isinstance(item, NEEDS):
            yield item
