"""The small interface the loop and the drafters talk to.

A Backend is one loaded model with one KV-cache sequence. The real one lives in
`llamacpp.py` (the only module that imports llama_cpp); tests use a fake one.
Positions are explicit: the caller says where a batch goes, and rolls the cache
back with `trim`, so the KV bookkeeping is visible in the loop, not hidden here.
"""

from __future__ import annotations

from typing import Literal, Protocol, Sequence

import numpy as np

Outputs = Literal["all", "last", "none"]


class Backend(Protocol):
    name: str       # what the user called it (registry name or file name)
    n_vocab: int
    n_ctx: int      # positions 0..n_ctx-1 exist
    n_batch: int    # most tokens one `decode` call scores with outputs="all"

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
        """Roll the cache back so it holds positions 0..n_keep-1 only."""
        ...
