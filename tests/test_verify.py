"""Speculative sampling (speculative/decoding/verify.py) alone: exact cases and statistics.

The statistical tests use the Bretagnolle-Huber-Carol bound: for N draws over V
tokens, P(||empirical - p||_1 >= lam) <= 2^V exp(-N lam^2 / 2). Each check uses
the lam that makes this 1e-6, so a correct verifier fails one with probability at
most 1e-6 (and the seeds are fixed, so a run repeats exactly).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from speculative.decoding.sampling import draw, one_hot
from speculative.decoding.tree import Tree
from speculative.decoding.settings import SpecSettings
from speculative.decoding.verify import (match_tree, prob, rejection_sample, rejection_sample_tree, residual,
                                         synthetic_keep, synthetic_match)
from speculative.errors import UsageError

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


def drafts(q, seed: int, shape) -> list:
    """Tokens sampled from q, all at once, from a stream of their own (the draft model's)."""
    ids, probs = q
    u = np.random.Generator(np.random.PCG64(seed)).random(shape) * probs.sum()
    return ids[np.minimum(np.searchsorted(np.cumsum(probs), u, side="right"), len(ids) - 1)].tolist()


def histogram(steps, n: int) -> np.ndarray:
    """The frequencies of the first n tokens of what the steps emit, one after the other.
    The target's distribution is p at every position, so an exact verifier's output is n
    independent draws from p: every token counts, accepted drafts and corrections alike."""
    counts = np.zeros(V)
    left = n
    for emitted in steps:
        for token in emitted[:left]:
            counts[token] += 1
        left -= len(emitted)
        if left <= 0:
            return counts / n
    raise AssertionError("fewer steps than tokens")  # every step emits at least one


def chain_emitted(verifier, p, q, seed: int, n: int = N) -> np.ndarray:
    """Histogram of n emitted tokens over steps drafting 2 tokens from q."""
    rng = np.random.Generator(np.random.PCG64(seed))

    def steps():
        for drafted in drafts(q, seed + 1, (n, 2)):
            m, token = verifier(drafted, [q, q], lambda i: p, rng)
            yield (*drafted[:m], token)

    return histogram(steps(), n)


@pytest.mark.parametrize("name", PAIRS)
def test_emitted_tokens_follow_the_target_distribution(name):
    p, q = PAIRS[name]
    l1 = np.abs(chain_emitted(rejection_sample, p, q, seed=1) - dense(p)).sum()
    assert l1 < LAM, f"{name}: L1 distance {l1:.4f} >= {LAM:.4f}"


def test_a_verifier_that_accepts_everything_fails_the_same_check():
    def accept_all(drafted, q, target_dist, rng):
        return len(drafted), draw(target_dist(len(drafted)), rng)

    p, q = PAIRS["overlapping"]
    l1 = np.abs(chain_emitted(accept_all, p, q, seed=1, n=N // 10) - dense(p)).sum()
    assert l1 > 10 * LAM  # two tokens of every three follow q (a tenth of the draws is plenty)


def test_seeded_runs_repeat_exactly():
    p, q = PAIRS["overlapping"]
    assert np.array_equal(chain_emitted(rejection_sample, p, q, 7, n=2000),
                          chain_emitted(rejection_sample, p, q, 7, n=2000))


# -- draft trees ---------------------------------------------------------------

FORK = Tree((-1, -1, 0, 1))  # the root has children 0 and 1; 0 has child 2, 1 has child 3


def test_matching_follows_the_branch_the_target_picked():
    picks = {0: 2, 2: 4, 4: 5}  # row 0 (the root) says 2 -> node 1; its row (2) says 4 -> node 3
    path, bonus = match_tree([1, 2, 3, 4], FORK, picks.__getitem__)
    assert (path, bonus) == ([1, 3], 5)
    assert FORK.branch == (0, 1, 0, 1) and FORK.seqs == ((0,), (1,), (0,), (1,))


def test_a_rejected_child_passes_its_residual_to_the_next():
    p = dist(0.2, 0.3, 0.2, 0.2, 0.1, 0)
    q = [dist(0.4, 0, 0, 0, 0.6, 0), one_hot(1), one_hot(3), one_hot(4)]
    rows = []
    # Child 0 (token 0): p/q = 0.5, u = 0.6 rejects; p becomes max(0, p - q) = (0, .3, .2, .2, 0)/.7.
    # Child 1 (token 1, one-hot): accepted with p'(1) = 3/7 > u = 0.3. Then node 1's row (2):
    # child 3 (token 4) has p = 0.1 < u = 0.99, rejected; the token is drawn from p without 4.
    path, bonus = rejection_sample_tree([0, 1, 3, 4], FORK, q, lambda i: rows.append(i) or p,
                                        Rng(0.6, 0.3, 0.99, 0.0))
    assert (path, bonus, rows) == ([1], 0, [0, 2])
    assert np.allclose(dense(residual(p, q[0])), [0, 3 / 7, 2 / 7, 2 / 7, 0, 0])


def top_forks(q, x, n=2):
    """The draft's n most likely other tokens: fixed once x is drawn."""
    ids, probs = q
    return [int(ids[i]) for i in np.argsort(-probs, kind="stable") if ids[i] != x][:n]


def tree_emitted(verifier, p, q, seed: int, n: int = N) -> np.ndarray:
    """Histogram of n emitted tokens over steps drafting a root with three children: one
    sampled from q, then the draft's two best other candidates."""
    rng = np.random.Generator(np.random.PCG64(seed))
    forks = {x: ([x, *top_forks(q, x)], [q, *(one_hot(f) for f in top_forks(q, x))]) for x in q[0].tolist()}

    def steps():
        for x in drafts(q, seed + 1, n):
            drafted, qs = forks[x]
            path, token = verifier(drafted, Tree((-1,) * len(drafted)), qs, lambda i: p, rng)
            yield (drafted[path[0]], token) if path else (token,)

    return histogram(steps(), n)


@pytest.mark.parametrize("name", PAIRS)
def test_tree_verification_follows_the_target_distribution(name):
    p, q = PAIRS[name]
    l1 = np.abs(tree_emitted(rejection_sample_tree, p, q, seed=2) - dense(p)).sum()
    assert l1 < LAM, f"{name}: L1 distance {l1:.4f} >= {LAM:.4f}"


def test_forks_judged_by_the_draft_distribution_are_not_exact():
    """llama-speculative verifies every branch's token against the draft's distribution q;
    a fork was not sampled from q, and the same check then fails."""
    def forks_as_samples(drafted, tree, q, target_dist, rng):
        return rejection_sample_tree(drafted, tree, [q[0]] * len(drafted), target_dist, rng)

    p, q = PAIRS["overlapping"]
    l1 = np.abs(tree_emitted(forks_as_samples, p, q, seed=2, n=N // 10) - dense(p)).sum()
    assert l1 > LAM * math.sqrt(10)  # the check's bound for a tenth of the draws


# -- synthetic acceptance (llama.cpp's --spec-synth-*, benchmarking only) -----------------------


def test_synthetic_match_keeps_what_it_is_told_and_asks_the_target_up_to_the_first_not_kept():
    asked = []

    def pick(i):
        asked.append(i)
        return 100 + i

    assert synthetic_match([5, 6, 7], pick, lambda i, token: i < 2) == ([0, 1], 102) and asked == [0, 1, 2]
    asked.clear()
    assert synthetic_match([5, 6, 7], pick, lambda i, token: True) == ([0, 1, 2], 103) and asked == [0, 1, 2, 3]


def test_synthetic_keep_draws_its_own_seeded_stream_and_never_keeps_an_end_of_generation():
    keep = synthetic_keep([0.5] * 4, 7, lambda t: False)
    first = [keep(0, 1) for _ in range(400)]
    keep = synthetic_keep([0.5] * 4, 7, lambda t: False)
    assert [keep(0, 1) for _ in range(400)] == first and 150 < sum(first) < 250
    assert not synthetic_keep([1.0], 7, lambda t: t == 2)(0, 2)


@pytest.mark.parametrize("given, probs", [
    ({"synth_rates": (0.8, 0.6, 0.3)}, (0.8, 0.75, 0.5)),
    ({"synth_rates": (0.5, 0.0, 0.0)}, (0.5, 0.0, 0.0)),
    ({"synth_len": 1.0}, (0.0, 0.0, 0.0)),
    ({"synth_len": 4.0}, (1.0, 1.0, 1.0)),
])
def test_synthetic_probabilities_are_llama_cpps(given, probs):
    assert SpecSettings(types=("draft",), draft_max=3, **given).synthetic_probs() == pytest.approx(probs)


def test_a_synthetic_length_gives_that_mean_acceptance_length():
    probs = SpecSettings(types=("draft",), draft_max=3, synth_len=2.5).synthetic_probs()
    p = probs[0]
    assert probs == pytest.approx((p, p, p)) and 1 + p + p * p + p ** 3 == pytest.approx(2.5, abs=1e-6)


@pytest.mark.parametrize("given, message", [
    ({"synth_rates": (0.5, 0.4)}, "must have 3 values"),
    ({"synth_rates": (0.5, 0.6, 0.1)}, "non-increasing"),
    ({"synth_rates": (1.5, 0.6, 0.1)}, "within [0, 1]"),
    ({"synth_len": 5.0}, "within [1, 4]"),
    ({"synth_len": 2.0, "synth_rates": (0.5, 0.4, 0.3)}, "mutually exclusive"),
])
def test_synthetic_settings_llama_cpp_refuses_are_refused(given, message):
    with pytest.raises(UsageError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SpecSettings(types=("draft",), draft_max=3, **given).validate()
