"""The draft-model drafter: a small model proposing its continuation (greedy, or
sampled from its own distribution q for speculative sampling), as a chain or, with
branches > 1, as a tree that forks where the draft hesitates (llama-speculative's
-np and --draft-p-split)."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from speculative.decoding.backend import Work
from speculative.decoding.cache import Cache
from speculative.decoding.constraint import GrammarDeadEnd, GrammarState, best, best_one, path_states
from speculative.decoding.drafter import DecodingDrafter, Draft
from speculative.decoding.sampling import Sampler, draw, one_hot
from speculative.decoding.tree import path_to

# llama.cpp judges --draft-p-min on the draft's top candidates renormalised over
# the 10 best (common/speculative.cpp draws drafts through a top-k 10 sampler).
P_MIN_TOP_K = 10


class ModelDrafter(DecodingDrafter):
    """A small model proposing its continuation: greedily, or, given `sampler` (when the
    acceptance rule is speculative sampling), drawn from its own sampler chain, each
    token's distribution kept in the Draft for the acceptance rule.

    Before drafting its cache is brought in line with the context (Cache.sync keeps the
    prefix they share and decodes the rest), which is an exact rollback whatever the
    target accepted, or an earlier run left there.
    """

    name = "draft"

    def __init__(self, cache: Cache, p_min: float = 0.0, sampler: Sampler | None = None,
                 branches: int = 1, p_split: float = 0.1):
        self.cache = cache
        self.model = cache.model
        self.p_min = p_min
        self.sampler = sampler
        self.branches = branches  # > 1: draft trees (needs a model with that many sequences)
        self.p_split = p_split

    def prefilling(self, prompt: Sequence[int]) -> Work[None]:
        if len(prompt) <= self.model.n_ctx:
            yield from self.cache.sync(prompt[:-1])

    def proposing(self, context: Sequence[int], k: int) -> Work[Draft]:
        # The draft's own context may be smaller than the target's (-cd): it holds the
        # context and up to k - 1 drafted tokens (the last drafted tokens are never decoded).
        k = min(k, self.model.n_ctx - len(context) + 1)
        if k <= 0:
            return self.nothing()
        tree = _Growing()
        grammar = (path_states(self.constraint.state, tree.tokens, tree.parents) if self.constraint is not None
                   else lambda row: None)  # the grammar after a node's path (row: node + 1)
        # Level by level: every branch's next token, then one decode for all of them.
        frontier = [(-1, (yield from self.cache.sync(context, "last"))[-1])]  # (node, the draft's logits after it)
        self.cache.checkpoint()  # drafts decoded one level at a time are undone next step
        while frontier:
            level = []
            for node, row in frontier:
                if len(tree.tokens) < k:
                    level += self._grow(tree, context, node, row, k, grammar(node + 1))
            frontier_nodes = [i for i in level if not self.model.is_eog(tree.tokens[i])]
            if len(tree.tokens) >= k or not frontier_nodes:
                break
            rows = yield from self.cache.decode_tree([tree.tokens[i] for i in frontier_nodes],
                                                     [(tree.seq[i],) for i in frontier_nodes])
            frontier = list(zip(frontier_nodes, rows))
        if tree.n_branches > 1:
            self.cache.keep_branch(0, len(self.cache))  # the cache is sequence 0 between steps
        return Draft(tree.tokens, self.name, q=tuple(tree.q) if self.sampler is not None else None,
                     parents=tuple(tree.parents) if tree.n_branches > 1 else None)

    def _grow(self, tree: "_Growing", context: Sequence[int], node: int, row: np.ndarray, k: int,
              grammar: GrammarState | None) -> list[int]:
        """The nodes drafted after `node`: its next token (unless --draft-p-min stops the
        branch), and the forks that start new branches beside it, among what `grammar` admits."""
        picked = pick(row, self.p_min, self.sampler,
                      lambda: [*context, *(tree.tokens[i] for i in path_to(tree.parents, node))], grammar)
        if picked is None:
            return []
        token, dist = picked
        branch = tree.seq[node] if node >= 0 else 0
        added = [tree.add(token, node, dist, branch)]
        forks = self._forks(row, dist, token, min(self.branches - tree.n_branches, k - len(tree.tokens)))
        if grammar is not None and forks:  # a fork's children are drafted after it
            forks = [f for f, ok in zip(forks, grammar.admitted(np.array(forks, dtype=np.int32))) if ok]
        for fork in forks:
            self.cache.fork(branch, tree.n_branches)  # the fork sees what its parent saw
            added.append(tree.add(fork, node, one_hot(fork), tree.n_branches))
        return added

    def _forks(self, row: np.ndarray, dist, token: int, room: int) -> list[int]:
        """Up to `room` other candidates likely enough to the draft (> p_split) to start
        branches, most likely first: from its sampled distribution, or when it drafts
        greedily from its best candidates as --draft-p-min judges them."""
        if room <= 0:
            return []
        ids, probs = dist if dist is not None else top_candidates(row)
        order = np.argsort(-probs, kind="stable")
        return [int(ids[i]) for i in order if probs[i] > self.p_split and ids[i] != token][:room]

    def behind(self, context: Sequence[int]) -> int:
        """Tokens of `context` the draft's cache does not hold yet (to decode before drafting)."""
        return len(context) - self.cache.shared_prefix(context)


class _Growing:
    """A draft tree as the drafter builds it: tokens, parents, distributions, and each
    token's branch (its cache sequence)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.q: list = []
        self.seq: list[int] = []
        self.n_branches = 1

    def add(self, token: int, parent: int, dist, branch: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.q.append(dist)
        self.seq.append(branch)
        self.n_branches = max(self.n_branches, branch + 1)
        return len(self.tokens) - 1


def pick(row: np.ndarray, p_min: float, sampler: Sampler | None, history: Callable[[], Sequence[int]],
         grammar: GrammarState | None = None) -> tuple[int, tuple | None] | None:
    """A drafter's next token after logits `row`: its best one, or, given `sampler`, one drawn
    from the sampler chain's distribution (returned with it, for speculative sampling);
    None when --draft-p-min stops the draft there. `history`: what the token follows, for
    the sampler's penalties. With `grammar`, among the tokens it admits (None where it admits
    none: the draft stops)."""
    try:
        judged = _admitted_only(row, grammar) if grammar is not None and p_min > 0.0 else row
        token = best_one(grammar, judged) if grammar is not None else int(np.argmax(row))
        if p_min > 0.0 and top_probability(judged, token) < p_min:
            return None
        if sampler is None:
            return token, None
        dist = sampler.distribution(row, history() if sampler.settings.penalties else (), grammar)
    except GrammarDeadEnd:
        return None
    return draw(dist, sampler.rng), dist


def _admitted_only(row: np.ndarray, grammar: GrammarState) -> np.ndarray:
    """The row with -inf for every token but the best admissible ones --draft-p-min judges by."""
    keep = best(grammar, row, P_MIN_TOP_K)
    masked = np.full(len(row), -np.inf, dtype=np.float32)
    masked[keep] = row[keep]
    return masked


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
