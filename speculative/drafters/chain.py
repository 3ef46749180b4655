"""Several drafters tried in order (`--spec-type ngram-simple,draft`): the first
that proposes anything drafts this step, as in llama-server's --spec-type a,b."""

from __future__ import annotations

from typing import Sequence

from . import Draft, Drafter, Outcome


class Chain(Drafter):
    def __init__(self, drafters: list[Drafter]):
        self.drafters = drafters
        self.name = ",".join(d.name for d in drafters)

    def prefill(self, prompt: Sequence[int]) -> None:
        for d in self.drafters:
            d.prefill(prompt)

    def propose(self, context: Sequence[int], k: int) -> Draft:
        for d in self.drafters:
            draft = d.propose(context, k)
            if draft.tokens:
                return draft
        return self.nothing()

    def accept(self, outcome: Outcome) -> None:
        for d in self.drafters:
            d.accept(outcome)

    def summary(self) -> list[str]:
        return [note for d in self.drafters for note in d.summary()]
