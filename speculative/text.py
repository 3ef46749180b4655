"""Token bytes to text, safely streamed.

Tokens carry bytes, not characters: a UTF-8 character can be split across two
tokens (or across a draft boundary). An incremental decoder holds back the
incomplete tail, so streamed text never shows a broken character, and invalid
bytes become U+FFFD exactly as decoding the whole output at once would.
"""

from __future__ import annotations

import codecs
from typing import Callable


class TextStream:
    def __init__(self, token_bytes: Callable[[int], bytes]):
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        """The text that became complete with this token (may be '')."""
        return self._decoder.decode(self._token_bytes(token))

    def flush(self) -> str:
        """Whatever is held back at the end (an incomplete character becomes U+FFFD)."""
        return self._decoder.decode(b"", final=True)
