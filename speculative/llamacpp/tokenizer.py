"""A model's vocabulary as llama.cpp reads it: text to tokens and back, the special tokens.
LlamaModel is a Tokenizer of its own vocabulary."""

from __future__ import annotations

import ctypes

import llama_cpp as ll
import numpy as np

from speculative.errors import GenerationError
from speculative.llamacpp.grammar import Grammar, compile_grammar


class Tokenizer:
    """Tokens of one llama.cpp vocabulary; token texts and end-of-generation answers are
    remembered as they are asked for."""

    def __init__(self, vocab):
        self._vocab = vocab
        self.n_vocab = ll.llama_vocab_n_tokens(vocab)
        self._pieces: dict[int, bytes] = {}
        self._eog_cache: dict[int, bool] = {}
        self._eog_tokens: np.ndarray | None = None

    @property
    def add_bos(self) -> bool:
        return bool(ll.llama_vocab_get_add_bos(self._vocab))

    def special_text(self, which: str) -> str:
        """Text of the BOS or EOS token ('' when the model has none)."""
        token = {"bos": ll.llama_vocab_bos, "eos": ll.llama_vocab_eos}[which](self._vocab)
        return self.token_bytes(token).decode("utf-8", errors="replace") if token >= 0 else ""

    def tokenize(self, text: str, add_special: bool, parse_special: bool = True) -> list[int]:
        """`parse_special`: text such as "<|fim_prefix|>" becomes that special token (else plain text)."""
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buf = (ll.llama_token * capacity)()
        n = ll.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:  # the buffer was too small: -n is the size needed
            capacity = -n
            buf = (ll.llama_token * capacity)()
            n = ll.llama_tokenize(self._vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:
            raise GenerationError("tokenization failed")
        return list(buf[:n])

    def token_bytes(self, token: int, special: bool = True) -> bytes:
        """A token's text; `special` False: special tokens (<|endoftext|>, ...) have none."""
        piece = self._pieces.get(token) if special else None
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            n = ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
            piece = buf.raw[: max(n, 0)]
            if special:
                self._pieces[token] = piece
        return piece

    def grammar(self, text: str, triggers: tuple[str, ...] = ()) -> Grammar:
        """A grammar state (GBNF `text`) over this vocabulary, at the start of generation; lazy
        until one of `triggers` matches the generated text, where there are any."""
        return compile_grammar(self, text, triggers)

    def fim_tokens(self) -> dict[str, int | None]:
        """The model's fill-in-the-middle tokens (GGUF tokenizer.ggml.fim_*_token_id, or what
        llama.cpp recognises by their text): pre, suf, mid, rep, sep; None where it has none."""
        found = {name: int(get(self._vocab)) for name, get in (
            ("pre", ll.llama_vocab_fim_pre), ("suf", ll.llama_vocab_fim_suf), ("mid", ll.llama_vocab_fim_mid),
            ("rep", ll.llama_vocab_fim_rep), ("sep", ll.llama_vocab_fim_sep))}
        return {name: token if token >= 0 else None for name, token in found.items()}

    def bos_token(self) -> int | None:
        token = int(ll.llama_vocab_bos(self._vocab))
        return token if token >= 0 else None

    def end_token(self) -> int:
        """End of turn, or end of sequence where the model has none (llama.cpp's infill sampler's choice)."""
        token = int(ll.llama_vocab_eot(self._vocab))
        return token if token >= 0 else int(ll.llama_vocab_eos(self._vocab))

    def is_eog(self, token: int) -> bool:
        eog = self._eog_cache.get(token)
        if eog is None:
            eog = self._eog_cache[token] = bool(ll.llama_vocab_is_eog(self._vocab, token))
        return eog

    def eog_tokens(self) -> np.ndarray:
        if self._eog_tokens is None:
            self._eog_tokens = np.array(
                [t for t in range(self.n_vocab) if ll.llama_vocab_is_eog(self._vocab, t)], dtype=np.int64)
        return self._eog_tokens
