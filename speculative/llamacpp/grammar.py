"""A grammar state: llama.cpp's grammar sampler (llama_sampler_init_grammar) over a model's
vocabulary, asked only which of some tokens it admits (decoding/constraint.py's GrammarState).

The grammar text reaching here has passed speculative/grammar/gbnf.py, which names the line and
column of what is wrong; llama.cpp's own parser still runs (it is what enforces the grammar), and
what it prints to stderr when it refuses one is captured and cut to its first line, so no dump of
the whole grammar reaches the user.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import tempfile
import threading
import time
from typing import Iterator

import llama_cpp as ll
import numpy as np

from speculative.decoding.constraint import VocabIndex
from speculative.errors import GrammarError
from speculative.grammar.gbnf import TokenRef, check


class _Buffers(threading.local):
    """Each thread's array of candidates for llama_sampler_apply (requests at once: one per slot)."""

    def get(self, n_vocab: int) -> tuple[ctypes.Array, np.ndarray, ll.llama_token_data_array]:
        if getattr(self, "n", 0) != n_vocab:
            self.data = (ll.llama_token_data * n_vocab)()
            self.view = np.ctypeslib.as_array(self.data)
            self.array = ll.llama_token_data_array(self.data, n_vocab, -1, False)
            self.n = n_vocab
        return self.data, self.view, self.array


_buffers = _Buffers()


class Grammar:
    """One state of a grammar (GrammarState): copies are independent samplers, and share `timer`,
    the seconds spent in llama.cpp's grammar code for the run."""

    def __init__(self, sampler, index: VocabIndex, tokenizer, timer: list[float] | None = None):
        self._sampler = sampler
        self.index = index
        self._tokenizer = tokenizer
        self.timer = timer if timer is not None else [0.0]

    def copy(self) -> "Grammar":
        t0 = time.perf_counter()
        copy = Grammar(ll.llama_sampler_clone(self._sampler), self.index, self._tokenizer, self.timer)
        self.timer[0] += time.perf_counter() - t0
        return copy

    def accept(self, token: int) -> None:
        t0 = time.perf_counter()
        ll.llama_sampler_accept(self._sampler, int(token))  # admitted tokens only: llama.cpp aborts otherwise
        self.timer[0] += time.perf_counter() - t0

    def admitted(self, ids: np.ndarray) -> np.ndarray:
        n = len(ids)
        if not n:
            return np.zeros(0, dtype=bool)
        if ids.max() >= self.index.n_vocab or ids.min() < 0:  # a draft model's extra tokens: none is text here
            inside = (ids >= 0) & (ids < self.index.n_vocab)
            ok = np.zeros(n, dtype=bool)
            ok[inside] = self.admitted(ids[inside])
            return ok
        t0 = time.perf_counter()
        _, view, array = _buffers.get(self.index.n_vocab)
        view["id"][:n] = ids
        view["logit"][:n] = 0.0
        array.size, array.selected, array.sorted = n, -1, False
        ll.llama_sampler_apply(self._sampler, ctypes.byref(array))
        ok = np.isfinite(view["logit"][:n])
        self.timer[0] += time.perf_counter() - t0
        return ok

    def tokenize(self, text: bytes) -> list[int]:
        return self._tokenizer.tokenize(text.decode("utf-8"), add_special=False, parse_special=False)

    def __del__(self):
        if getattr(self, "_sampler", None) is not None:
            ll.llama_sampler_free(self._sampler)
            self._sampler = None


def compile_grammar(tokenizer, text: str, triggers: tuple[str, ...] = ()) -> Grammar:
    """A state at the start of `text` (GBNF, root rule `root`) over `tokenizer`'s vocabulary
    (llamacpp.tokenizer.Tokenizer). With `triggers` (regular expressions), the grammar is lazy:
    every token is admitted until one matches the generated text, and the grammar then holds
    from the match's first group (llama_sampler_init_grammar_lazy_patterns). GrammarError
    naming the place of a token the vocabulary lacks, or with llama.cpp's first line when it
    refuses the grammar."""
    for ref in check(text).tokens:
        _check_token(tokenizer, ref)
    with _captured_stderr() as printed:
        if triggers:
            patterns = (ctypes.c_char_p * len(triggers))(*(t.encode("utf-8") for t in triggers))
            sampler = ll.llama_sampler_init_grammar_lazy_patterns(
                tokenizer._vocab, text.encode("utf-8"), b"root", patterns, len(triggers), None, 0)
        else:
            sampler = ll.llama_sampler_init_grammar(tokenizer._vocab, text.encode("utf-8"), b"root")
    if not sampler:
        said = next((line.strip() for line in printed().splitlines() if line.strip()), "")
        raise GrammarError(f"llama.cpp refused the grammar: {said or 'it does not parse'}")
    return Grammar(sampler, vocab_index(tokenizer), tokenizer)


def _check_token(tokenizer, ref: TokenRef) -> None:
    """A token the grammar names must be one of the vocabulary's (llama.cpp takes any id, and a
    grammar that needs one beyond the vocabulary could never complete)."""
    where = f"grammar line {ref.line}, column {ref.column}"
    if ref.id is not None and not 0 <= ref.id < tokenizer.n_vocab:
        raise GrammarError(f"{where}: token <[{ref.id}]> is outside this model's vocabulary of "
                           f"{tokenizer.n_vocab} tokens")
    if ref.text is not None and len(tokenizer.tokenize(ref.text, add_special=False, parse_special=True)) != 1:
        raise GrammarError(f"{where}: {ref.text} is not one token of this model's vocabulary")


def vocab_index(tokenizer) -> VocabIndex:
    """The vocabulary grouped for grammars, made once per model (about a second for 150k tokens)."""
    index = getattr(tokenizer, "_grammar_index", None)
    if index is None:
        pieces = [tokenizer.token_bytes(t) for t in range(tokenizer.n_vocab)]
        index = tokenizer._grammar_index = VocabIndex(pieces, tokenizer.eog_tokens())
    return index


@contextlib.contextmanager
def _captured_stderr() -> Iterator:
    """What C code writes to file descriptor 2 meanwhile, kept from the terminal; yields a
    function that returns it once the block is over."""
    sys.stderr.flush()
    saved = os.dup(2)
    captured = tempfile.TemporaryFile()
    text: list[str] = []
    try:
        os.dup2(captured.fileno(), 2)
        yield lambda: "".join(text)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        captured.seek(0)
        text.append(captured.read().decode("utf-8", errors="replace"))
        captured.close()
