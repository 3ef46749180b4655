"""The acceptance rule: which drafted tokens the target keeps.

Glossary, used throughout speculate:
  target    the model whose output we want
  draft     the cheap proposer (a small model, later n-gram lookup)
  drafted   tokens the draft proposed in one step: d1..dk
  accepted  the drafted prefix the target agrees with: d1..dm, m <= k
  bonus     the target's own token after the accepted prefix: a correction
            when m < k, a free extra token when m == k
  step      one draft + one target forward pass over [last, d1..dk]

"Sample and match": the target picks its token at each position i of the
verified batch with its own sampler (argmax when greedy), conditioned on the
accepted prefix; d(i+1) is accepted while it equals that pick. Every emitted
token is therefore exactly what the target alone would have picked, so greedy
output equals target-only greedy output and sampled output follows the target's
distribution. No llama.cpp here: this module is pure and tested in isolation.

"Speculative sampling" (Leviathan et al. 2023, Chen et al. 2023) accepts more
when sampling: d_i ~ q_i (the draft's distribution after its sampler chain) is
accepted with probability min(1, p_i(d_i) / q_i(d_i)), p_i being the target's
distribution after its chain; on the first rejection the token is drawn from
norm(max(0, p_i - q_i)); when all k are accepted a bonus token is drawn from
p_(k+1). Each emitted token then follows p exactly, whatever q is. A drafter that
proposes deterministically (n-gram lookup, a greedy draft) has q = one-hot.

Draft trees (tree.py) verify the same way, one node at a time from the root. Sample
and match follows the child whose token the target picked. Speculative sampling
tries the children in order, each as one round of the rule above whose target is
what the previous round left: child c is accepted with probability
min(1, p(c) / q_c(c)), else p becomes norm(max(0, p - q_c)); when every child is
rejected the token is drawn from the last p ("recursive rejection sampling",
SpecInfer's multi-step speculative sampling). Each round is exact whatever p it
starts from, provided its proposal does not depend on the target's random draws:
the first child is sampled from q, the others (the draft's next-best candidates)
are fixed once it is known and have q_c = one-hot. A chain is the tree with one
child per node, and the rounds are exactly the loop of the paper.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from speculative.decoding.sampling import Dist, draw, one_hot
from speculative.decoding.tree import Tree, chain_parents


def prob(dist: Dist, token: int) -> float:
    """dist(token); 0 outside its support."""
    ids, probs = dist
    hit = ids == token
    i = int(hit.argmax())  # the first hit, if any
    return float(probs[i]) if hit[i] else 0.0


def residual(p: Dist, q: Dist) -> Dist:
    """norm(max(0, p - q)): where the target wants more than the draft offered.
    Only p's support can be positive. If nothing is (p <= q everywhere, which
    only rounding allows after a rejection), p itself."""
    p_ids, p_probs = p
    q_ids, q_probs = q
    order = np.argsort(q_ids)
    ids, probs = q_ids[order], q_probs[order]
    at = np.minimum(np.searchsorted(ids, p_ids), len(ids) - 1)  # (np.clip: most of the time on short lists)
    r = np.maximum(p_probs - np.where(ids[at] == p_ids, probs[at], 0.0), 0.0)
    total = r.sum()
    if not total > 0.0:
        return p
    keep = r > 0.0
    return p_ids[keep], r[keep] / total


def sample_and_match(drafted: Sequence[int], target_pick: Callable[[int], int]) -> tuple[int, int]:
    """Verify `drafted`, a chain, against the target.

    `target_pick(i)` is the target's token for batch row i, the row that scored
    [last, d1..dk][i]; it is called for rows 0..m only, in order, so a sampler's
    random stream is consumed exactly as in target-only decoding.

    Returns (m, bonus): the number of accepted drafted tokens and the target's
    token after them.
    """
    path, bonus = match_tree(drafted, Tree(chain_parents(len(drafted))), target_pick)
    return len(path), bonus


def synthetic_match(drafted: Sequence[int], target_pick: Callable[[int], int],
                    keep: Callable[[int, int], bool]) -> tuple[list[int], int]:
    """llama.cpp's synthetic acceptance, for benchmarking only (its output is not the target's):
    drafted token i (a chain's) is kept when keep(i, token) says so, whatever the target picks.
    The target still picks every row up to the first token not kept, in order, as sample and
    match does, and that pick replaces it. Returns (path, bonus) as match_tree."""
    for i, token in enumerate(drafted):
        picked = target_pick(i)
        if not keep(i, token):
            return list(range(i)), picked
    return list(range(len(drafted))), target_pick(len(drafted))


def synthetic_keep(probs: Sequence[float], seed: int, is_eog: Callable[[int], bool]) -> Callable[[int, int], bool]:
    """Whether synthetic acceptance keeps drafted token i: with chance probs[i] (the ones before it
    kept), from a random stream of its own seeded by the run's seed, as llama-server seeds it; a
    drafted end of generation never (it would end the answer early)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    return lambda i, token: rng.random() < probs[i] and not is_eog(token)


def rejection_sample(drafted: Sequence[int], q: Sequence[Dist] | None,
                     target_dist: Callable[[int], Dist], rng: np.random.Generator) -> tuple[int, int]:
    """Speculative sampling of `drafted`, a chain (d_i ~ q[i]; q None: deterministic proposals).

    `target_dist(i)` is the target's distribution for batch row i; rows 0..m are
    asked for, in order. One uniform number is drawn per verified token and one
    for the token after them, from `rng`. Returns (m, bonus) as sample_and_match.
    """
    path, bonus = rejection_sample_tree(drafted, Tree(chain_parents(len(drafted))), q, target_dist, rng)
    return len(path), bonus


def match_tree(drafted: Sequence[int], tree: Tree, target_pick: Callable[[int], int]) -> tuple[list[int], int]:
    """Sample and match over a draft tree. The batch scored [last, d0, d1, ...], so node
    i's row is i + 1 and the root's is 0; `target_pick(row)` is asked for the rows on
    the accepted path, in order. Returns (path, bonus): the accepted nodes, root first."""
    path: list[int] = []
    while True:
        node = path[-1] if path else -1
        picked = target_pick(node + 1)
        match = [c for c in tree.children.get(node, ()) if drafted[c] == picked]
        if not match:
            return path, picked
        path.append(match[0])


def rejection_sample_tree(drafted: Sequence[int], tree: Tree, q: Sequence[Dist] | None,
                          target_dist: Callable[[int], Dist], rng: np.random.Generator) -> tuple[list[int], int]:
    """Recursive rejection sampling over a draft tree (q[i]: node i's proposal
    distribution; None: every node was proposed deterministically). Rows as in
    match_tree; one uniform number per child tried and one for a drawn token."""
    path: list[int] = []
    while True:
        node = path[-1] if path else -1
        p = target_dist(node + 1)
        for c in tree.children.get(node, ()):
            x = drafted[c]
            q_c = one_hot(x) if q is None else q[c]
            q_x = prob(q_c, x)
            if rng.random() < (prob(p, x) / q_x if q_x > 0.0 else 0.0):  # accept with min(1, p/q)
                path.append(c)
                break
            p = residual(p, q_c)
        else:
            return path, draw(p, rng)
