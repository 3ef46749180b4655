"""A target that replays a known output at its calibrated costs: the real loop, auto and the
drafters run over a recorded run (a bench file's target-only output) with no model at all.

ReplayBackend is a Backend (backend.py) whose greedy pick after each prefix of a known token
sequence is the sequence's next token, so a draft is accepted as far as it matches the output
and the bonus token is the output's next. Every scoring batch advances a Clock by the
calibrated verify cost of its size, and `charged(clock)` makes the loop and auto read that
clock: the step timings auto corrects its costs with are then the calibrated ones, and a
run's decode time is its modelled time (bench.modelled_speedup). replay_auto.py replays
auto's plans over bench outputs with it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import numpy as np

from speculative.decoding import loop
from speculative.decoding.cache import Cache
from speculative.decoding.scheduler import run_alone
from speculative.decoding.drafter import Drafter
from speculative.decoding.events import Event
from speculative.decoding.sampling import Sampler
from speculative.decoding.settings import SamplerSettings, SpecSettings
from speculative.drafters import auto

GREEDY = SamplerSettings(temp=0.0)


class Clock:
    """Time that passes only while the replayed target verifies (a stand-in for the `time`
    module, whose perf_counter is all the loop and auto read)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@contextlib.contextmanager
def charged(clock: Clock) -> Iterator[Clock]:
    """The loop and auto time their steps by `clock` while this lasts."""
    saved = loop.time, auto.time
    loop.time = auto.time = clock
    try:
        yield clock
    finally:
        loop.time, auto.time = saved


class ReplayBackend:
    """A target that "produces" `sequence` (prompt, output and, where the output ended on one,
    the `eog` token): scoring a batch of b tokens costs verify_costs[b - 1] on `clock`. After a
    token off the sequence (a rejected draft) there is no known answer: its row picks token 0,
    which greedy verification never reads (it stops at the first rejected token)."""

    rollback_limit = None  # an attention cache: any suffix can be dropped

    def __init__(self, sequence: Sequence[int], verify_costs: Sequence[float], clock: Clock,
                 eog: int | None = None, n_ctx: int | None = None, n_batch: int = 2048, name: str = "replay"):
        self.sequence = list(sequence)
        self.verify_costs = list(verify_costs)
        self.clock = clock
        self.eog = eog
        self.name = name
        self.n_vocab = max([*self.sequence, *([eog] if eog is not None else []), 0]) + 1
        self.n_ctx = n_ctx or len(self.sequence) + 1
        self.n_batch = n_batch
        self.n_seq = 1
        self.held: list[int] = []
        self._on = 0  # leading tokens held that are the sequence's

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        raise NotImplementedError("a replayed target has no tokenizer: it is given tokens")

    def token_bytes(self, token: int) -> bytes:
        return b""

    def is_eog(self, token: int) -> bool:
        return token == self.eog

    def eog_tokens(self) -> np.ndarray:
        return np.array([] if self.eog is None else [self.eog], dtype=np.int64)

    def decode(self, tokens: Sequence[int], pos: int, outputs: str) -> list[np.ndarray]:
        assert pos == len(self.held), f"decode at {pos} but the replay holds {len(self.held)}"
        rows = [self._append(t) for t in tokens]
        return {"all": rows, "last": rows[-1:], "none": []}[outputs]

    def decode_branches(self, tokens: Sequence[int], positions: Sequence[int],
                        seqs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """One chain (the replay has one sequence): a verify, charged at its calibrated cost."""
        assert all(tuple(s) == (0,) for s in seqs), "a replayed target verifies chains only"
        assert list(positions) == list(range(len(self.held), len(self.held) + len(tokens)))
        self.clock.now += self.verify_costs[len(tokens) - 1]
        return [self._append(t) for t in tokens]

    def _append(self, token: int) -> np.ndarray:
        """Hold `token` next; the row that follows it."""
        on = self._on == len(self.held) and len(self.held) < len(self.sequence) \
            and self.sequence[len(self.held)] == token
        self.held.append(token)
        self._on += on
        row = np.zeros(self.n_vocab, dtype=np.float32)
        if self._on == len(self.held):
            if self._on >= len(self.sequence):
                raise IndexError(f"the replay knows no token after position {self._on - 1}")
            row[self.sequence[self._on]] = 1.0
        return row

    def trim(self, n_keep: int) -> None:
        assert 0 <= n_keep <= len(self.held)
        del self.held[n_keep:]
        self._on = min(self._on, n_keep)

    def copy_branch(self, src: int, dst: int) -> None:
        raise NotImplementedError("a replayed target verifies chains only")

    def keep_branch(self, seq: int, n_keep: int) -> None:
        assert seq == 0
        self.trim(n_keep)

    def save_state(self, partial: bool = False) -> bytes:
        raise NotImplementedError("a replayed target keeps no state to save")

    def load_state(self, data: bytes, n_tokens: int, partial: bool = False) -> bool:
        return False


def replay(prompt: Sequence[int], output: Sequence[int], stopped: bool, verify_costs: Sequence[float],
           spec: SpecSettings, drafter: Drafter | None, eog: int) -> tuple[list[Event], float]:
    """Run the loop over `prompt` as the target that produced `output` (then `eog` if `stopped`),
    greedily, with `drafter`: its events and the seconds they took at the calibrated costs. The
    context is made long enough never to end the run (the -n cap or `eog` does, as in the run
    replayed), so drafts near the end are capped as there."""
    clock = Clock()
    sequence = [*prompt, *output, *([eog] if stopped else [])]
    n_ctx = len(prompt) + max(spec.n_predict, len(output)) + 1
    target = Cache(ReplayBackend(sequence, verify_costs, clock, eog, n_ctx))
    with charged(clock):
        events = list(run_alone(loop.generate(target, list(prompt), Sampler(GREEDY, 0), spec, drafter)))
    return events, clock.now
