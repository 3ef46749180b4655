"""`--spec-type forced`: what the run's grammar forces next, drafted for free (constraint.py).

Where the grammar admits exactly one next byte, then one, ... (the rest of a JSON key, `": `,
a closing bracket), that text is forced. Where a single token spells its start, that token is
certain (kind a): the target's pick there is known, no row is sampled, and it cannot be rejected.
The rest of the text is drafted as the model tokenizes it (kind b): verified like any proposal,
and rejected where the target spells it otherwise (`{"` where the draft had `{`). auto plans
with it as with any free drafter, the certain tokens at acceptance 1."""

from __future__ import annotations

from typing import Sequence

from speculative.decoding.constraint import forced
from speculative.decoding.drafter import FORCED, Draft, Drafter


class ForcedDrafter(Drafter):
    name = "forced"
    free = True

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if self.constraint is None or k <= 0:
            return self.nothing()
        found = forced(self.constraint.state, k)
        tokens = [*found.certain, *found.likely][:k]
        return Draft(tokens, self.name, FORCED, certain=min(len(found.certain), k))
