"""Token bytes to text, safely streamed.

Tokens carry bytes, not characters: a UTF-8 character can be split across two
tokens (or across a draft boundary). An incremental decoder holds back the
incomplete tail, so streamed text never shows a broken character, and invalid
bytes become U+FFFD exactly as decoding the whole output at once would.

Stop strings are held back the same way: text that may be the start of one is
not shown until the next text says whether it is.
"""

from __future__ import annotations

import codecs
from typing import Callable, Sequence


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


class StopFilter:
    """Cuts streamed text at the first stop string, which is not shown; text that could
    be the beginning of a stop string waits until it is known not to be one."""

    def __init__(self, stops: Sequence[str]):
        self._stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """The text now known to come before any stop string ('' once one was found)."""
        if self.stopped:
            return ""
        text = self._held + text
        found = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if found:
            self.stopped, self._held = True, ""
            return text[:min(found)]
        n = self._partial(text)
        self._held = text[len(text) - n:]
        return text[:len(text) - n]

    def flush(self) -> str:
        """The text held back at the end, which turned out not to be a stop string."""
        held, self._held = self._held, ""
        return held

    def _partial(self, text: str) -> int:
        """The length of the longest end of `text` that begins a stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
