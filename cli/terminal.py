"""Output that fits a terminal: how wide a stream may be written, text wrapped only between
words (or between whole fields), and tables that keep every word whole by showing fewer or
narrower columns when the terminal is too narrow for all of them (the commands' --json or
results files keep every figure).

A terminal is as wide as it says (COLUMNS overrides it, as everywhere); a file or a pipe has
no width unless COLUMNS gives one, so a log keeps whole lines and whole tables."""

from __future__ import annotations

import io
import os
import textwrap
from dataclasses import dataclass
from typing import IO, Iterable, Iterator, Sequence

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

CONTINUED = "  "  # the further lines of a wrapped paragraph or record start here
KEEP = "\u00a0"   # a space textwrap does not break at (it breaks at ASCII whitespace only)
UNLIMITED = 10_000  # a rich Console's width for a file or a pipe: lines as long as they are


def is_terminal(stream: IO) -> bool:
    """A terminal that can redraw a line: not a file or a pipe, and not TERM=dumb."""
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


def width(stream: IO) -> int | None:
    """Columns output to `stream` may take: COLUMNS when set, else the terminal's width, else
    None (a file or a pipe: no limit)."""
    given = os.environ.get("COLUMNS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    if not is_terminal(stream):
        return None
    try:
        return os.get_terminal_size(stream.fileno()).columns or None
    except (OSError, ValueError, AttributeError):
        return None


def wrap(text: str, columns: int | None, further: str = CONTINUED) -> list[str]:
    """`text` in lines of at most `columns`, broken only at spaces (a word, a number or a path
    longer than a line stays whole on a line of its own); its own line breaks are kept."""
    if columns is None:
        return text.split("\n")
    return [line for own in text.split("\n")
            for line in (textwrap.wrap(own, columns, subsequent_indent=further, break_on_hyphens=False,
                                       break_long_words=False, drop_whitespace=True) or [""])]


def fields(items: Iterable[str], columns: int | None, sep: str = "  ", further: str = CONTINUED) -> list[str]:
    """`items` joined by `sep` in lines of at most `columns`, broken only between two items, after
    the separator's visible part ("23.4 t/s" or "AVX = 1 |" never ends one line and starts the
    next); an item's own spaces, its padding included, are kept."""
    visible = sep.rstrip()
    joiner = visible.replace(" ", KEEP) + sep[len(visible):]  # a line may break at its trailing spaces
    text = joiner.join(item.replace(" ", KEEP) for item in items)
    return [line.replace(KEEP, " ").rstrip() for line in wrap(text, columns, further)]


# -- tables -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """A table's column: its header and cells (plain text or styled rich Text), how they are
    justified, and whether a cell is one unit that never wraps (a number with its unit)."""
    header: str
    cells: Sequence[str | Text]
    justify: str = "left"
    whole: bool = False

    def texts(self) -> list[str]:
        return [self.header, *(c.plain if isinstance(c, Text) else c for c in self.cells)]

    @property
    def natural(self) -> int:
        """Its width with no cell wrapped."""
        return max(len(line) for text in self.texts() for line in text.split("\n"))

    @property
    def least(self) -> int:
        """Its width with every cell wrapped between words: its longest word (or whole cell)."""
        if self.whole:
            return self.natural
        return max([len(word) for text in self.texts() for word in text.split()] or [1])


def table(columns: Sequence[Column], columns_wide: int | None, **options) -> Table:
    """A rich Table of `columns` at most `columns_wide` wide (None: as wide as they are), each
    column given a fixed width no narrower than its longest word, so that rich wraps cells only
    between words; the room beyond the least widths goes to the columns that want it most."""
    widths = [c.natural for c in columns]
    room = None if columns_wide is None else columns_wide - frame(len(columns), options)
    if room is not None and sum(widths) > room:
        widths = [c.least for c in columns]
        wanted = [c.natural - c.least for c in columns]
        for _ in range(max(0, room - sum(widths))):
            i = max(range(len(columns)), key=lambda i: wanted[i])
            if wanted[i] <= 0:
                break
            widths[i] += 1
            wanted[i] -= 1
    out = Table(**options)
    for column, w in zip(columns, widths):
        out.add_column(column.header, justify=column.justify, width=w, no_wrap=column.whole, overflow="fold")
    for row in zip(*(c.cells for c in columns)):
        out.add_row(*(cell if isinstance(cell, Text) else Text(cell) for cell in row))
    return out


def fits(columns: Sequence[Column], columns_wide: int | None, **options) -> bool:
    """Whether `columns` fit in `columns_wide` with no word broken."""
    return columns_wide is None or sum(c.least for c in columns) + frame(len(columns), options) <= columns_wide


def first_fitting(candidates: Iterable[Sequence[Column]], columns_wide: int | None, **options) -> list[Column]:
    """The first of `candidates` (each narrower than the one before) that fits; else the last."""
    chosen: list[Column] = []
    for chosen in map(list, candidates):
        if fits(chosen, columns_wide, **options):
            break
    return chosen


def dropping(columns: Sequence[Column], order: Sequence[Column]) -> Iterator[list[Column]]:
    """`columns`, then without order[0], then without order[0] and order[1], ...: the tables a
    narrower terminal shows, the columns it can best do without left out first."""
    for n in range(len(order) + 1):
        yield [c for c in columns if not any(c is gone for gone in order[:n])]


def left_out(shown: Sequence[Column], every: Sequence[Column]) -> list[str]:
    """The headers of the columns of `every` that `shown` leaves out."""
    return [c.header for c in every if not any(c is s for s in shown)]


def frame(n_columns: int, options: dict) -> int:
    """What a rich Table with these `options` adds to the widths of its `n_columns` columns (a
    space either side of each cell, borders unless it has no box), as rich measures it."""
    probe = Table(**{**options, "title": None, "caption": None})
    for _ in range(n_columns):
        probe.add_column(width=1)
    console = Console(width=UNLIMITED, file=io.StringIO())
    return Measurement.get(console, console.options, probe).maximum - n_columns
