"""The drafter contract: what every drafter implements and what the loop hands back.

`propose(context, k)` returns a Draft of up to k tokens that might follow `context`, and
`accept(outcome)` tells the drafter what the target made of them. `prefill(prompt)` lets a
drafter do its prompt work up front, so it is timed as prompt processing rather than drafting,
and `finish(context)` tells it the run is over (a drafter that learns across runs keeps what it
saw). The drafters themselves live in speculative/drafters/.

The loop asks through `proposing` and `prefilling`, which are work (backend.Work): a drafter
that decodes (a draft model, a head: a DecodingDrafter) implements those, yielding each decode
it needs; one that decodes nothing implements `propose` and `prefill`, which they call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from speculative.decoding import scheduler
from speculative.decoding.backend import Work
from speculative.decoding.tree import chain_parents


# The kinds of proposal auto keeps acceptance estimates of apart (Draft.kind), each with its
# prior in drafters/registry.py: an n-gram match by how long its context matched (ngram.match_class:
# SHORT, MEDIUM, LONG, and RESUMED, a short match resuming the passage copied before), earlier
# outputs that continue alike (pool.py), the text a grammar forces (forced.py)
SHORT, MEDIUM, LONG, RESUMED, AGREED, FORCED = range(6)


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    source: str          # the drafter that made it, as --spec-type names it
    kind: int = 0        # a class of proposals whose acceptance auto estimates apart
                         # (n-gram: how long the matched context is)
    q: tuple | None = None  # the distribution each token was sampled from, as (ids, probs),
                            # when the drafter sampled; None: deterministic proposals
    parents: tuple[int, ...] | None = None  # a draft tree (see tree.py); None: a chain
    certain: int = 0     # the first `certain` tokens are the only ones a grammar admits at their
                         # place (constraint.py): the target's pick there is known

    @property
    def tree(self) -> tuple[int, ...]:
        """Each token's parent (-1: the last accepted token)."""
        return self.parents if self.parents is not None else chain_parents(len(self.tokens))

    def head(self, k: int) -> "Draft":
        """The first k tokens (and their distributions): a tree's parents come first."""
        return Draft(self.tokens[:k], self.source, self.kind, None if self.q is None else self.q[:k],
                     None if self.parents is None else self.parents[:k], min(self.certain, k))


@dataclass(frozen=True)
class Outcome:
    """What verification made of a draft."""
    draft: Draft
    n_accepted: int      # drafted tokens the target kept
    bonus: int           # the target's own token after them
    t_draft: float       # seconds spent proposing
    t_verify: float      # seconds the target spent on the batch of len(draft.tokens) + 1


class Drafter:
    name = "drafter"
    free = False  # proposing costs (next to) nothing: auto may ask for a proposal every step
    constraint = None  # a run's grammar (constraint.Constraint): a drafter that drafts from a
                       # distribution drafts from the one it admits

    def prefill(self, prompt: Sequence[int]) -> None:
        """Optional: process the prompt before generation starts."""

    def propose(self, context: Sequence[int], k: int) -> Draft:
        """Up to k tokens that might follow `context` (prompt + generated so far)."""
        raise NotImplementedError

    def prefilling(self, prompt: Sequence[int]) -> Work[None]:
        """`prefill` as the loop runs it: the decodes it needs yielded."""
        yield from ()
        self.prefill(prompt)

    def proposing(self, context: Sequence[int], k: int) -> Work[Draft]:
        """`propose` as the loop runs it: the decodes it needs yielded, then its Draft."""
        yield from ()
        return self.propose(context, k)

    def accept(self, outcome: Outcome) -> None:
        """Optional: learn from what the target kept."""

    def finish(self, context: Sequence[int]) -> None:
        """Optional: the run is over; `context` is its prompt and every token it generated."""

    def behind(self, context: Sequence[int]) -> int:
        """Tokens of `context` to process before proposing (a draft model catching up)."""
        return 0

    def can_draft(self, context: Sequence[int]) -> bool:
        """Whether it can propose anything after `context` at all (auto plans only with those that can)."""
        return True

    def summary(self) -> list[str]:
        """Notes on the run for the statistics (why it drafted less than it could)."""
        return []

    def nothing(self) -> Draft:
        return Draft([], self.name)


class DecodingDrafter(Drafter):
    """A drafter that decodes (a draft model, a head, or drafters among which one may): it
    implements `prefilling` and `proposing`; `prefill` and `propose` run them with their decodes
    alone, here (a tool, a test)."""

    def prefill(self, prompt: Sequence[int]) -> None:
        scheduler.run(self.prefilling(prompt))

    def propose(self, context: Sequence[int], k: int) -> Draft:
        return scheduler.run(self.proposing(context, k))

    def prefilling(self, prompt: Sequence[int]) -> Work[None]:
        raise NotImplementedError

    def proposing(self, context: Sequence[int], k: int) -> Work[Draft]:
        raise NotImplementedError
