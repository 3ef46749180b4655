"""What a long step is doing now, on stderr: one status line that each update replaces in
place, and that a lasting message clears before it is printed.

Library code never imports this. It takes two plain callbacks, `progress: Callable[[str], None]`
(what runs now: each call redraws the line, replacing the last) and
`notify: Callable[[str], None]` (a lasting line, which ends the status), and the command line
hands it this class's bound methods:

    with StatusLine(enabled=not json_output) as status:
        engine = Engine(target, notify=status.say, progress=status.update)
        checks = batch_invariance(cache, progress=status.step(2, 3, "batch invariance"))

- `update(text)`: what runs now ("calibrating: batch of 5 tokens, round 2/3"); each call
  replaces the last. Shown only on a terminal, and not with --json: a file, a pipe or a CI log
  gets no progress at all.
- `say(message)`: a lasting line (a notice, a result): the status line is cleared first, and
  stays cleared until the next update. Printed wherever stderr goes, as notices always were.
- `step(number, total, what)`: shows "step i/n: what" now and returns the callback that adds a
  detail to it ("step i/n: what: detail"), for the library code that runs the step.
- `clear()`: before anything else writes where the status line is (text streamed to a
  terminal's stdout); leaving the `with` block clears it too, on an error or Ctrl-C as well.
"""

from __future__ import annotations

import sys
import threading
from typing import IO, Callable

from . import terminal

ELLIPSIS = "…"


class StatusLine:
    """The status line of one command's run on `stream` (stderr); `enabled=False` (--json) draws
    nothing."""

    def __init__(self, stream: IO | None = None, enabled: bool = True):
        self.stream = stream if stream is not None else sys.stderr
        self.live = enabled and terminal.is_terminal(self.stream)  # progress drawn at all
        self._shown = False  # a status line is on the screen, the cursor at its end
        self._lock = threading.Lock()  # serve's threads may notify while the models load

    def update(self, text: str) -> None:
        """Replace the status line with `text` (cut at a word to fit the terminal's width)."""
        if not self.live:
            return
        line = shortened(" ".join(text.split()), (terminal.width(self.stream) or 80) - 1)
        with self._lock:
            self._write("\r" + line + "\x1b[K")
            self._shown = bool(line)

    def say(self, message: str) -> None:
        """A lasting message: the status line cleared, then `message`, wrapped between words on
        a terminal."""
        lines = terminal.wrap(message, terminal.width(self.stream)) if terminal.is_terminal(self.stream) \
            else [message]
        with self._lock:
            self._clear()
            self._write("\n".join(lines) + "\n")

    def clear(self) -> None:
        with self._lock:
            self._clear()

    def step(self, number: int, total: int, what: str = "") -> Callable[[str], None]:
        """Show step `number` of `total` (and `what` it is); the callback returned shows a detail
        of it."""
        head = f"step {number}/{total}" + (f": {what}" if what else "")
        self.update(head)
        return lambda detail: self.update(f"{head}: {detail}")

    def __enter__(self) -> "StatusLine":
        return self

    def __exit__(self, *exc) -> None:
        self.clear()

    def _clear(self) -> None:
        if self._shown:
            self._write("\r\x1b[K")
            self._shown = False

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # stderr gone (a closed terminal): nothing to show it on
            self.live = False


def shortened(text: str, columns: int) -> str:
    """`text` in at most `columns` characters: cut after a whole word, marked with an ellipsis."""
    if len(text) <= columns:
        return text
    cut = text[: max(columns - len(ELLIPSIS), 0)]
    if " " in cut and text[len(cut)] != " ":
        cut = cut[: cut.rindex(" ")]
    return cut.rstrip() + ELLIPSIS
