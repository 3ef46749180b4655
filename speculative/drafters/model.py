"""The draft-model drafter: a small model proposing its continuation (greedy, or
sampled from its own distribution q for speculative sampling), as a chain or, with
branches > 1, as a tree that forks where the draft hesitates (llama-speculative's
-np and --draft-p-split)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..backend import Backend
from ..sampling import Sampler, draw, one_hot
from ..tree import path_to
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
                 cached: list[int] | None = None, branches: int = 1, p_split: float = 0.1):
        self.model = model
        self.p_min = p_min
        self.branches = branches  # > 1: draft trees (needs a model with that many sequences)
        self.p_split = p_split
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
        # context and up to k - 1 drafted tokens (the last drafted tokens are never decoded).
        k = min(k, self.model.n_ctx - len(context) + 1)
        if k <= 0:
            return self.nothing()
        drafted: list[int] = []
        parents: list[int] = []
        q: list = []
        seq: list[int] = []    # the cache sequence of each drafted token's branch
        depth: list[int] = []
        n_branches = 1

        def add(token: int, parent: int, dist, branch: int) -> int:
            drafted.append(token)
            parents.append(parent)
            q.append(dist)
            seq.append(branch)
            depth.append(depth[parent] + 1 if parent >= 0 else 1)
            return len(drafted) - 1

        # Level by level: every branch's next token, then one decode for all of them.
        frontier = [(-1, self._sync(context, outputs="last"))]  # (node, the draft's logits after it)
        while frontier:
            level = []
            for node, row in frontier:
                token = int(np.argmax(row))
                if len(drafted) >= k or (self.p_min > 0.0 and top_probability(row, token) < self.p_min):
                    continue
                dist = None
                if self.sampler is not None:
                    history = self._history(context, drafted, parents, node)
                    dist = self.sampler.distribution(row, history)
                    token = draw(dist, self.sampler.rng)
                branch = seq[node] if node >= 0 else 0
                level.append(add(token, node, dist, branch))
                for fork in self._forks(row, dist, token, min(self.branches - n_branches, k - len(drafted))):
                    self.model.copy_branch(branch, n_branches)  # the fork sees what its parent saw
                    level.append(add(fork, node, one_hot(fork), n_branches))
                    n_branches += 1
            frontier_nodes = [i for i in level if not self.model.is_eog(drafted[i])]
            if len(drafted) >= k or not frontier_nodes:
                break
            rows = self.model.decode_branches([drafted[i] for i in frontier_nodes],
                                              [len(context) - 1 + depth[i] for i in frontier_nodes],
                                              [(seq[i],) for i in frontier_nodes])
            self.cached.extend(drafted[i] for i in frontier_nodes if seq[i] == 0)
            frontier = list(zip(frontier_nodes, rows))
        if n_branches > 1:
            self.model.keep_branch(0, len(self.cached))  # the cache is sequence 0 between steps
        return Draft(drafted, self.name, q=tuple(q) if self.sampler is not None else None,
                     parents=tuple(parents) if n_branches > 1 else None)

    def _forks(self, row: np.ndarray, dist, token: int, room: int) -> list[int]:
        """Up to `room` other candidates likely enough to the draft (> p_split) to start
        branches, most likely first: from its sampled distribution, or when it drafts
        greedily from its best candidates as --draft-p-min judges them."""
        if room <= 0:
            return []
        ids, probs = dist if dist is not None else top_candidates(row)
        order = np.argsort(-probs, kind="stable")
        return [int(ids[i]) for i in order if probs[i] > self.p_split and ids[i] != token][:room]

    def _history(self, context: Sequence[int], drafted: list[int], parents: list[int], node: int):
        """What a drafted node follows, for the sampler's penalties."""
        if not self.sampler.settings.penalties:
            return ()
        return [*context, *(drafted[i] for i in path_to(parents, node))]

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


def top_candidates(row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The draft's P_MIN_TOP_K best tokens and their probabilities renormalised over them."""
    best = np.argpartition(-row, P_MIN_TOP_K - 1)[:P_MIN_TOP_K] if len(row) > P_MIN_TOP_K else np.arange(len(row))
    z = np.exp(row[best] - row[best].max(), dtype=np.float64)
    return best, z / z.sum()


def top_probability(row: np.ndarray, token: int) -> float:
    """Probability of `token` among the draft's P_MIN_TOP_K best candidates."""
    best = row[np.argpartition(-row, P_MIN_TOP_K - 1)[:P_MIN_TOP_K]] if len(row) > P_MIN_TOP_K else row
    z = np.exp(best - row[token], dtype=np.float64)
    return float(1.0 / z.sum())
