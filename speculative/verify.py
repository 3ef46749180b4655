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
"""

from __future__ import annotations

from typing import Callable, Sequence


def sample_and_match(drafted: Sequence[int], target_pick: Callable[[int], int]) -> tuple[int, int]:
    """Verify `drafted` against the target.

    `target_pick(i)` is the target's token for batch row i, the row that scored
    [last, d1..dk][i]; it is called for rows 0..m only, in order, so a sampler's
    random stream is consumed exactly as in target-only decoding.

    Returns (m, bonus): the number of accepted drafted tokens and the target's
    token after them.
    """
    for i, d in enumerate(drafted):
        picked = target_pick(i)
        if picked != d:
            return i, picked
    return len(drafted), target_pick(len(drafted))
