"""A run as text: the one layer between the engine's events and every front end.

`Stream` turns a run's tokens into UTF-8-safe text, cuts it at stop strings, and
ends with one Final value carrying the whole text, the tokens, the finish reason
and the statistics. The one-shot command, `serve`, `batch` and `bench` all read it
(mlx-lm's stream_generate plays this role there); none of them decodes tokens to
text, applies stop strings or settles a finish reason itself.

Text comes one Piece per step (the step's accepted drafted tokens and the target's
own), with each token's share of it, so a terminal can colour drafted tokens, and the
statistics so far, so a server can send timings per token. A consumer that stops early
(its reader went away, Ctrl-C) still gets Final from `end(reason)`, with the statistics
up to there.

A run yields the decodes it needs too (decoding/scheduler.py). A Stream runs them `alone`, each
in a decode of its own; or, for a request among others (engine/parallel.py), passes them on as
they come, among its Pieces, for the scheduler that runs them together.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from speculative.decoding.backend import NEEDS, Work, needs_of
from speculative.decoding.scheduler import run
from speculative.decoding.events import Done, Prefilling, Step, Token, TokenProbs
from speculative.decoding.settings import SamplerSettings, SpecSettings
from speculative.decoding.stats import Stats
from speculative.engine.text import LineLimits, StopFilter, TextStream

if TYPE_CHECKING:  # annotations only: importing the engine loads llama.cpp
    from speculative.engine.engine import Engine

INCOMPLETE = ("the output reached its length limit (-n or the context) before the grammar was complete: "
              "the JSON (or whatever the grammar describes) is unfinished")


@dataclass(frozen=True)
class Piece:
    """The text one step completed: per token, the text it released (incomplete characters
    and possible stop strings wait for later tokens, so some are '') and whether it was
    an accepted drafted token."""
    parts: tuple[tuple[str, bool], ...]
    ids: tuple[int, ...] = ()  # the tokens of these parts
    probs: tuple[TokenProbs | None, ...] = ()  # and their probabilities (SamplerSettings.n_probs)
    stats: Stats | None = field(default=None, compare=False)  # the run's so far (Stream.so_far): timings per token

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.parts)


@dataclass(frozen=True)
class Final:
    reason: str          # "stop" (end of generation or a stop string), "length", or the consumer's
    tail: str            # text held back until the end (after the last Piece)
    text: str            # the whole text: every Piece and the tail
    tokens: list[int]    # every generated token (up to a stop string)
    stats: Stats
    notes: list[str]     # what the drafter has to say (auto's declines)
    stop_word: str = ""  # the stop string that ended the text, if one did
    n_kept: int = 0      # tokens the target's cache holds after the run (set by serving.generate)
    probs: list[TokenProbs | None] = field(default_factory=list)  # each token's, with n_probs


class Stream:
    """One run as text. Iterate for Pieces, then call `end()` for the Final value, also
    after stopping early. `should_stop` is asked after the prompt and after every step:
    a reason it returns ends the run there."""

    def __init__(self, engine: Engine, prompt: list[int], sampling: SamplerSettings, spec: SpecSettings,
                 seed: int, stops: Sequence[str] = (), should_stop: Callable[[], str | None] | None = None,
                 limits: LineLimits | None = None, carry: bool = False,
                 progress: Callable[[Prefilling], None] | None = None, alone: bool = True):
        """`carry`: the run continues the previous one (Engine.run); `progress` hears how far
        the prompt has gone into the caches (loop.prefill); `alone`: the run's decodes are its own
        to run, else they are passed on."""
        self.engine = engine
        self.stats = Stats(t_load=engine.t_load)
        self.tokens: list[int] = []
        self.probs: list[TokenProbs | None] = []
        self._progress = progress or (lambda event: None)
        self._events = (engine.run if alone else engine.running)(prompt, sampling, spec, seed, carry)
        self._text = TextStream(engine.target.token_bytes)
        self._stops = StopFilter(stops)
        self._limits = limits  # llama-server's n_indent and t_max_predict_ms, after the stop strings
        self._should_stop = should_stop or (lambda: None)
        self._shown: list[str] = []
        self._reason: str | None = None
        self._started: tuple[float, float] | None = None  # (wall clock, llama.cpp time) once the prompt is in

    def __iter__(self) -> Iterator[Piece]:
        parts: list[tuple[str, bool]] = []
        left = 0  # tokens of the current step still to come
        for event in self._events:
            if isinstance(event, NEEDS):
                yield event
                continue
            self.stats.add(event)
            if isinstance(event, Prefilling):
                self._progress(event)
                continue
            if isinstance(event, Step):
                left = event.n_accepted + 1
                continue
            if isinstance(event, Done):
                if parts:  # an end-of-generation token in the middle of a step
                    yield self._piece(parts)
                self._reason = event.reason
                return
            if isinstance(event, Token):
                parts.append(self._push(event))
                left -= 1
                if left and not self._stopped:
                    continue  # the rest of the step follows at once
                yield self._piece(parts)
                if self._stopped:
                    return
            else:  # Prefilled or PromptCache: the prompt is in, generation starts
                self._started = (time.perf_counter(), self.engine.busy_seconds())
            self._reason = self._should_stop()  # after the prompt, and after every step
            if self._reason:
                return

    def _push(self, token: Token) -> tuple[str, bool]:
        self.tokens.append(token.id)
        self.probs.append(token.probs)
        return self._limit(self._stops.push(self._text.push(token.id))), token.from_draft

    def _limit(self, text: str) -> str:
        return text if self._limits is None else self._limits.push(text)

    @property
    def _stopped(self) -> bool:
        return self._stops.stopped or (self._limits is not None and self._limits.stopped)

    def _piece(self, parts: list[tuple[str, bool]]) -> Piece:
        piece = Piece(tuple(parts), tuple(self.tokens[len(self.tokens) - len(parts):]),
                      tuple(self.probs[len(self.probs) - len(parts):]), self.so_far())
        parts.clear()
        self._shown.append(piece.text)
        return piece

    def so_far(self) -> Stats:
        """The statistics up to now, with the decode time up to now: a shallow copy, whose numbers
        are this moment's (its counters and histograms are the run's own, and go on growing)."""
        stats = copy.copy(self.stats)
        if self._started is not None:
            stats.t_decode = time.perf_counter() - self._started[0]
        return stats

    def end(self, reason: str | None = None) -> Final:
        """Stop the run (if it has not ended) and settle it: `reason` says why the consumer
        stopped, when it did."""
        self._events.close()
        tail = "" if self._stopped else self._limit(self._stops.push(self._text.flush()) + self._stops.flush())
        if self._limits is not None and not self._limits.stopped:
            tail += self._limits.flush()
        stats = self.stats
        if self._started is not None:
            stats.t_llama = self.engine.busy_seconds() - self._started[1]
            stats.t_plan = self.engine.plan_seconds()
            if stats.finish_reason is None:  # the consumer stopped
                stats.t_decode = time.perf_counter() - self._started[0]
        limited = self._limits is not None and self._limits.stopped
        stats.finish_reason = ("stop" if self._stops.stopped else "length" if limited else reason or self._reason
                               or stats.finish_reason or "length")
        notes = self.engine.notes()
        if stats.incomplete and stats.finish_reason == "length":
            notes = [*notes, INCOMPLETE]
        return Final(stats.finish_reason, tail, "".join(self._shown) + tail, self.tokens, stats, notes,
                     self._stops.found, probs=self.probs)


def complete(engine: Engine, prompt: list[int], sampling: SamplerSettings, spec: SpecSettings, seed: int,
             stops: Sequence[str] = ()) -> Final:
    """A run to its end."""
    return run(completing(engine, prompt, sampling, spec, seed, stops, alone=True))


def completing(engine: Engine, prompt: list[int], sampling: SamplerSettings, spec: SpecSettings, seed: int,
               stops: Sequence[str] = (), alone: bool = False) -> Work[Final]:
    """A run to its end as work: the decodes it needs yielded (unless `alone`), its Final returned."""
    stream = Stream(engine, prompt, sampling, spec, seed, stops, alone=alone)
    yield from needs_of(iter(stream))
    return stream.end()
