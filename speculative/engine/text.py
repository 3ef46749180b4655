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
import time
from typing import Callable, Sequence


TAIL_TOKENS = 8  # of a prompt, for prompt_tail


def prompt_tail(vocab, tokens: list[int]) -> str:
    """A prompt's last few tokens as text (`vocab`'s token_bytes): does a chat template open a
    thinking block there?"""
    return b"".join(vocab.token_bytes(t) for t in tokens[-TAIL_TOKENS:]).decode("utf-8", "replace")


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
        self.found = ""  # the stop string found

    def push(self, text: str) -> str:
        """The text now known to come before any stop string ('' once one was found)."""
        if self.stopped:
            return ""
        text = self._held + text
        found = [(i, s) for s in self._stops if (i := text.find(s)) >= 0]
        if found:
            at, self.found = min(found, key=lambda hit: hit[0])
            self.stopped, self._held = True, ""
            return text[:at]
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


class LineLimits:
    """llama-server's two limits for code completion (`n_indent`, `t_max_predict_ms`), on the
    text as it is released (after the stop strings):

    - n_indent > 0: a line after the first (which continues the cursor's line) must begin with
      at least n_indent blanks (spaces or tabs); the first other character of a line that has
      fewer, a newline included, ends the text there, its blanks kept. Blanks at the start of a
      line wait until that character shows which it is.
    - t_max > 0: once t_max seconds have passed since the first token, the text ends with the
      next token whose text has a newline (that token's whole text included).

    `push` takes one token's text; `stopped` tells when the text has ended.
    """

    def __init__(self, n_indent: int = 0, t_max: float = 0.0, clock: Callable[[], float] | None = None):
        self.n_indent = n_indent
        self.t_max = t_max
        self._clock = clock or time.monotonic
        self._t0: float | None = None
        self._line_start = False  # the first line is not checked
        self._blanks = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        now = self._clock()
        if self._t0 is None:
            self._t0 = now
        out = []
        for ch in text:
            if self.n_indent > 0 and self._line_start:
                if ch in " \t":
                    self._blanks += ch
                    continue
                if len(self._blanks) < self.n_indent:  # llama-server cuts the line after its blanks
                    self.stopped = True
                    out.append(self._blanks)
                    self._blanks = ""
                    return "".join(out)
                out.append(self._blanks)
                self._blanks = ""
                self._line_start = False
            out.append(ch)
            if ch == "\n":
                self._line_start = True
        if self.t_max > 0 and "\n" in text and now - self._t0 > self.t_max:
            self.stopped = True
            out.append(self.flush())
        return "".join(out)

    def flush(self) -> str:
        """Blanks held at the end, which no character followed."""
        blanks, self._blanks = self._blanks, ""
        return blanks
