"""The draft-model drafter: a small model proposing its continuation (greedy, or
sampled from its own distribution q for speculative sampling)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..backend import Backend
from ..sampling import Sampler, draw
from . import Draft, Drafter

# llama.cpp judges --draft-p-min on the draft's top candidates renormalised over
# the 10 best (common/speculative.cpp draws drafts through a top-k 10 sampler).
P_MIN_TOP_K = 10


class ModelDrafter(Drafter):
    """A small model proposing its continuation: greedy, or with `sampler` (a
    sampling one) drawn from its own sampler chain, each token's distribution kept
    in the Draft for the acceptance rule.

    Its KV cache holds `self.cached`; before drafting it is brought in line with
    the context by trimming to the common prefix and decoding the rest, which is
    an exact rollback whatever the target accepted (or an earlier run left).
    """

    name = "draft"

    def __init__(self, model: Backend, p_min: float = 0.0, sampler: Sampler | None = None,
                 cached: list[int] | None = None):
        self.model = model
        self.p_min = p_min
        self.sampler = sampler if sampler is not None and not sampler.settings.greedy else None
        # What the model's cache holds; given, it is what an earlier drafter left there, and
        # it is updated in place (only after each decode succeeds, so it never claims more).
        self.cached: list[int] = [] if cached is None else cached
        self._n_checked = 0  # cached[:_n_checked] is known to equal the context

    def prefill(self, prompt: Sequence[int]) -> None:
        if len(prompt) <= self.model.n_ctx:
            self._sync(prompt[:-1], outputs="none")

    def propose(self, context: Sequence[int], k: int) -> Draft:
        # The draft's own context may be smaller than the target's (-cd): it holds the
        # context and k - 1 drafted tokens (the last drafted token is never decoded).
        k = min(k, self.model.n_ctx - len(context) + 1)
        if k <= 0:
            return self.nothing()
        row = self._sync(context, outputs="last")
        drafted: list[int] = []
        q = []
        while True:
            token = int(np.argmax(row))
            if self.p_min > 0.0 and top_probability(row, token) < self.p_min:
                break
            if self.sampler is not None:
                history = [*context, *drafted] if self.sampler.settings.penalties else ()
                q.append(self.sampler.distribution(row, history))
                token = draw(q[-1], self.sampler.rng)
            drafted.append(token)
            if len(drafted) >= k or self.model.is_eog(token):
                break
            (row,) = self.model.decode([token], len(self.cached), "last")
            self.cached.append(token)
        return Draft(drafted, self.name, q=tuple(q) if self.sampler is not None else None)

    def behind(self, context: Sequence[int]) -> int:
        """Tokens of `context` the draft's cache does not hold yet (to decode before drafting)."""
        return max(len(context) - min(self._n_checked, len(self.cached)), 0)

    def _sync(self, context: Sequence[int], outputs) -> np.ndarray | None:
        """Make the cache hold `context` and return the last row of logits."""
        n = self._n_checked
        limit = min(len(self.cached), len(context))
        while n < limit and self.cached[n] == context[n]:
            n += 1
        if outputs == "last":
            n = min(n, len(context) - 1)  # the last token must be decoded for its logits
        # Trimmed even when nothing is stale: a decode interrupted before `cached` was
        # updated may have left cells that `cached` does not list.
        self.model.trim(n)
        del self.cached[n:]
        rows = self.model.decode(context[n:], n, outputs) if len(context) > n else []
        self.cached.extend(context[n:])
        self._n_checked = len(context)
        return rows[-1] if rows else None


def top_probability(row: np.ndarray, token: int) -> float:
    """Probability of `token` among the draft's P_MIN_TOP_K best candidates."""
    best = row[np.argpartition(-row, P_MIN_TOP_K - 1)[:P_MIN_TOP_K]] if len(row) > P_MIN_TOP_K else row
    z = np.exp(best - row[token], dtype=np.float64)
    return float(1.0 / z.sum())
