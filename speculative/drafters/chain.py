"""Several drafters tried in order (`--spec-type ngram-simple,draft`): the first
that proposes anything drafts this step, as in llama-server's --spec-type a,b. Each
drafts at most its own limit (SpecSettings.draft_limit): llama.cpp's n-gram types
their own maximum, the others --draft-max."""

from __future__ import annotations

from typing import Sequence

from speculative.decoding.backend import Work
from speculative.decoding.drafter import DecodingDrafter, Draft, Drafter, Outcome


class Chain(DecodingDrafter):
    def __init__(self, drafters: list[Drafter], limits: Sequence[int] | None = None):
        self.drafters = drafters
        self.limits = list(limits) if limits is not None else [None] * len(drafters)
        self.name = ",".join(d.name for d in drafters)

    def prefilling(self, prompt: Sequence[int]) -> Work[None]:
        for d in self.drafters:
            yield from d.prefilling(prompt)

    def proposing(self, context: Sequence[int], k: int) -> Work[Draft]:
        for d, limit in zip(self.drafters, self.limits):
            draft = yield from d.proposing(context, k if limit is None else min(k, limit))
            if draft.tokens:
                return draft
        return self.nothing()

    def accept(self, outcome: Outcome) -> None:
        for d in self.drafters:
            d.accept(outcome)

    def finish(self, context: Sequence[int]) -> None:
        for d in self.drafters:
            d.finish(context)

    def summary(self) -> list[str]:
        return [note for d in self.drafters for note in d.summary()]
