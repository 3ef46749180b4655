"""Speculative sampling (speculative/verify.py) alone: exact cases and statistics.

The statistical tests use the Bretagnolle-Huber-Carol bound: for N draws over V
tokens, P(||empirical - p||_1 >= lam) <= 2^V exp(-N lam^2 / 2). Each check uses
the lam that makes this 1e-6, so a correct verifier fails one with probability at
most 1e-6 (and the seeds are fixed, so a run repeats exactly).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from speculative.sampling import draw
from speculative.verify import prob, rejection_sample, residual

V = 6
N = 100_000
FALSE_ALARM = 1e-6
LAM = math.sqrt(2 * (V * math.log(2) + math.log(1 / FALSE_ALARM)) / N)


def dist(*probs: float):
    """A distribution over tokens 0..V-1 in sparse form (zeros dropped)."""
    p = np.array(probs, dtype=float)
    ids = np.flatnonzero(p)
    return ids, p[ids] / p.sum()


def dense(d) -> np.ndarray:
    out = np.zeros(V)
    out[d[0]] = d[1]
    return out


class Rng:
    """A scripted uniform stream, for exact outcomes."""

    def __init__(self, *u: float):
        self.u = list(u)

    def random(self) -> float:
        return self.u.pop(0)


P = dist(0.5, 0.3, 0.2, 0, 0, 0)


def test_all_accepted_then_a_bonus_from_p():
    q = [dist(0.5, 0.5, 0, 0, 0, 0)] * 2
    # p/q >= 1 for token 0; 0.3/0.5 = 0.6 for token 1: u = 0.59 accepts, then the bonus draw
    m, bonus = rejection_sample([0, 1], q, lambda i: P, Rng(0.99, 0.59, 0.9))
    assert (m, bonus) == (2, 2)  # cumulative p: 0.5, 0.8, 1.0; u = 0.9 -> token 2


def test_rejection_at_position_2_draws_from_the_residual():
    q = [dist(1, 0, 0, 0, 0, 0), dist(0, 1, 0, 0, 0, 0)]
    # token 1 has p/q = 0.3: u = 0.5 rejects; residual max(0, p - q) = (0.5, 0, 0.2) -> norm
    m, token = rejection_sample([0, 1], q, lambda i: P, Rng(0.1, 0.5, 0.8))
    assert m == 1 and token == 2  # residual cumulative 5/7, 1.0; u = 0.8 -> token 2
    assert np.allclose(dense(residual(P, q[1])), [5 / 7, 0, 2 / 7, 0, 0, 0])


def test_first_token_rejected_when_the_target_never_says_it():
    m, token = rejection_sample([4], None, lambda i: P, Rng(0.0, 0.1))
    assert m == 0 and token == 0  # p(4) = 0: rejected even at u = 0; residual is p itself


def test_edge_distributions_give_no_nans():
    one_hot = dist(0, 0, 1, 0, 0, 0)
    assert np.allclose(dense(residual(one_hot, one_hot)), dense(one_hot))  # p = q: nothing left -> p
    disjoint = residual(P, dist(0, 0, 0, 1, 1, 0))
    assert np.allclose(dense(disjoint), dense(P))
    assert prob(P, 5) == 0.0 and math.isclose(prob(P, 1), 0.3)


PAIRS = {
    "p = q": (P, dist(0.5, 0.3, 0.2, 0, 0, 0)),
    "overlapping": (P, dist(0.1, 0.1, 0.3, 0.3, 0.2, 0)),
    "disjoint supports": (P, dist(0, 0, 0, 0.3, 0.3, 0.4)),
    "q one-hot": (dist(0.2, 0.2, 0.2, 0.2, 0.1, 0.1), dist(0, 0, 0, 0, 1, 0)),
    "p one-hot": (dist(0, 0, 0, 1, 0, 0), dist(0.2, 0.2, 0.2, 0.2, 0.1, 0.1)),
}


def first_tokens(verifier, p, q, seed: int, n: int = N) -> np.ndarray:
    """Histogram of the first emitted token over n steps drafting 2 tokens from q."""
    rng = np.random.Generator(np.random.PCG64(seed))
    counts = np.zeros(V)
    for _ in range(n):
        drafted = [draw(q, rng), draw(q, rng)]
        m, bonus = verifier(drafted, [q, q], lambda i: p, rng)
        counts[drafted[0] if m > 0 else bonus] += 1
    return counts / n


@pytest.mark.parametrize("name", PAIRS)
def test_emitted_tokens_follow_the_target_distribution(name):
    p, q = PAIRS[name]
    l1 = np.abs(first_tokens(rejection_sample, p, q, seed=1) - dense(p)).sum()
    assert l1 < LAM, f"{name}: L1 distance {l1:.4f} >= {LAM:.4f}"


def test_a_verifier_that_accepts_everything_fails_the_same_check():
    def accept_all(drafted, q, target_dist, rng):
        return len(drafted), draw(target_dist(len(drafted)), rng)

    p, q = PAIRS["overlapping"]
    l1 = np.abs(first_tokens(accept_all, p, q, seed=1, n=N // 10) - dense(p)).sum()
    assert l1 > 10 * LAM  # it follows q (a tenth of the draws is plenty to see it)


def test_seeded_runs_repeat_exactly():
    p, q = PAIRS["overlapping"]
    assert np.array_equal(first_tokens(rejection_sample, p, q, 7, n=2000),
                          first_tokens(rejection_sample, p, q, 7, n=2000))
