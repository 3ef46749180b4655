"""auto on a recurrent target: what rolling drafts back costs it, and what it decides from that.

A target that can undo at most `rollback_limit` drafted tokens (llama.cpp's snapshots of a
recurrent state; 0 for Mamba's, which has none) copies its state into a checkpoint before a
longer draft is verified, and when more than the limit are rejected, restores it and decodes
the accepted tokens again (speculative/decoding/cache.py). auto plans with those costs (auto.Rewind),
which the engine measures on the loaded model (factory.rewind, calibrate.checkpoint_costs).
Here the fake backend does the rolling back and the fake clock says what each part costs, so
what auto models can be held against what the cache really did, to the microsecond.
"""

from __future__ import annotations


import numpy as np
import pytest

from speculative.decoding.cache import Cache
from speculative.decoding.drafter import Draft, Drafter
from speculative.decoding.events import Step, Token
from tests.fakes import generate
from speculative.decoding.sampling import Sampler
from speculative.decoding.settings import SamplerSettings, SpecSettings
from speculative.drafters import ModelDrafter, NgramSimple
from speculative.drafters.auto import Auto, Rewind
from speculative.engine import factory
from tests.fakes import Clock, FakeBackend, ToyModel, plain_decode

GREEDY = SamplerSettings(temp=0.0)
K_MAX = 8
PROMPT = [1, 2, 3]


def verify_cost(b: int) -> float:
    """v(b): 1.1 ms for one token, 0.1 ms more per token (every size its own, so that an
    off-by-one in the batch size shows)."""
    return (10 + b) * 1e-4


VERIFY = [verify_cost(b) for b in range(1, K_MAX + 2)]
SAVE, RESTORE = 3e-5, 7e-5  # a checkpoint's copy and restore, in the clock's seconds


def recurrent_target(model: ToyModel, clock: Clock, limit: int) -> Cache:
    backend = clock.timed(FakeBackend(model, n_ctx=512))
    backend.rollback_limit = limit
    return Cache(backend)


# -- what the engine measures ------------------------------------------------------


def test_the_engine_measures_the_checkpoint_costs_auto_plans_with(monkeypatch):
    clock = Clock(verify_cost, SAVE, RESTORE, redecode=True)
    monkeypatch.setattr("speculative.engine.calibrate.time", clock)
    cache = recurrent_target(ToyModel(), clock, limit=2)
    rewind = factory.rewind(cache, K_MAX)
    assert rewind.limit == 2
    assert (rewind.save, rewind.restore) == (pytest.approx(SAVE, abs=1e-12), pytest.approx(RESTORE, abs=1e-12))
    assert len(cache) == 0 and cache.model.cache == []  # measured, then left empty
    assert factory.rewind(cache, 2) is None  # the snapshots undo every draft auto may make
    cache.model.rollback_limit = None  # an attention cache drops any suffix for nothing
    assert factory.rewind(cache, K_MAX) is None


# -- what auto models, against the clock -------------------------------------------


class Scripted(Drafter):
    """Drafts nothing at the first step (so that the second checkpoints anew, not at the
    prompt's checkpoint), then k tokens of the target's own continuation of which the first
    `right` are kept and the next one is changed (exactly `right` are accepted), then nothing."""

    name = "scripted"

    def __init__(self, reference: list[int], k: int, right: int, n_vocab: int):
        self.reference, self.k, self.right, self.n_vocab = reference, k, right, n_vocab
        self.steps = 0

    def propose(self, context, k):
        self.steps += 1
        if self.steps != 2:
            return self.nothing()
        tokens = self.reference[len(context) - len(PROMPT) :][: self.k]
        if self.right < self.k:
            tokens[self.right] = (tokens[self.right] + 1) % self.n_vocab
        return Draft(tokens, self.name)


def step_seconds(limit: int, k: int, right: int) -> float:
    """The clock's time of the target's part of a step (Step.t_verify: the checkpoint, the
    verify, the rollback with its restore and decode again) that drafts k tokens of which
    `right` are accepted, after a step that drafted none."""
    model = ToyModel(seed=2, eog_bias=-40.0)
    reference = plain_decode(model, PROMPT, K_MAX + 2, Sampler(GREEDY, 0))
    clock = Clock(verify_cost, SAVE, RESTORE, redecode=True)
    cache = recurrent_target(model, clock, limit)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("speculative.decoding.loop.time", clock)
        spec = SpecSettings(n_predict=K_MAX + 2, draft_max=K_MAX)
        events = list(generate(cache, PROMPT, Sampler(GREEDY, 0), spec, Scripted(reference, k, right, model.vocab)))
    steps = [e for e in events if isinstance(e, Step)]
    assert [(s.n_drafted, s.n_accepted) for s in steps[:2]] == [(0, 0), (k, right)]
    assert [e.id for e in events if isinstance(e, Token)] == reference  # rolled back exactly
    return steps[1].t_verify


def certain(right: int) -> np.ndarray:
    """Acceptance rates that make exactly `right` drafted tokens accepted, for sure."""
    return np.array([1.0] * right + [0.0] * (K_MAX - right))


@pytest.mark.parametrize("limit", [0, 2])
def test_what_auto_models_a_rollback_to_cost_is_what_the_cache_spends(limit):
    """For every draft length k and number accepted a: auto's T(k) without the drafting, for a
    draft it knows will get exactly a accepted, is the clock's time of such a step, and its
    expected cost under any acceptance rates is the clock's times weighted by how likely each a is."""
    rewind = Rewind(limit, SAVE, RESTORE)
    verify = np.array([np.inf, *VERIFY])  # auto's v(b) at index b
    clocked = {(k, a): step_seconds(limit, k, a) for k in range(1, K_MAX + 1) for a in range(k + 1)}
    for (k, a), seconds in clocked.items():
        # what the cache does: verify k + 1; past the limit, a checkpoint first, and when more
        # than `limit` are rejected, a restore and [last, d1..da] decoded again
        by_hand = verify_cost(k + 1) + (SAVE if k > limit else 0.0) + (
            RESTORE + verify_cost(a + 1) if k - a > limit else 0.0)
        assert seconds == pytest.approx(by_hand, abs=1e-12), (k, a)
        modelled = verify[k + 1] + rewind.costs(certain(a), verify, K_MAX)[k - 1]
        assert modelled == pytest.approx(seconds, abs=1e-12), (k, a)
    rates = np.array([0.9, 0.8, 0.7, 0.95, 0.5, 0.6, 0.9, 0.85])
    reach = np.concatenate([[1.0], np.cumprod(rates)])  # P(the first a are accepted)
    expected = rewind.costs(rates, verify, K_MAX)
    for k in range(1, K_MAX + 1):
        chance = [reach[a] - reach[a + 1] for a in range(k)] + [reach[k]]  # P(exactly a)
        clock_mean = sum(p * clocked[(k, a)] for a, p in enumerate(chance))
        assert verify[k + 1] + expected[k - 1] == pytest.approx(clock_mean, abs=1e-12), k


# -- what auto decides --------------------------------------------------------------


def run_auto(limit: int, save: float, restore: float, drafter: str = "draft", n: int = 80):
    """auto on a recurrent target whose checkpoints cost `save` and `restore` on the clock,
    measured as the engine measures them, with a draft model (the target with 30% of its
    contexts changed) or n-gram lookup (on a target whose output falls into a cycle)."""
    model = ToyModel(seed=0, eog_bias=-40.0) if drafter == "draft" else ToyModel(vocab=8, seed=3, eog_bias=-40.0)
    clock = Clock(verify_cost, save, restore, redecode=True)
    cache = recurrent_target(model, clock, limit)
    with pytest.MonkeyPatch.context() as patch:
        for module in ("decoding.loop", "drafters.auto", "engine.calibrate"):
            patch.setattr(f"speculative.{module}.time", clock)
        rewind = factory.rewind(cache, K_MAX)
        restored = cache.model.checkpoints["restored"]  # by the measurement
        drafters = [ModelDrafter(Cache(FakeBackend(model.perturbed(0.3, seed=5))))] if drafter == "draft" else \
            [NgramSimple(n=2, m=K_MAX)]
        auto = Auto(drafters, VERIFY, K_MAX, {"draft": 2e-5}, rewind=rewind)
        events = list(generate(cache, PROMPT, Sampler(GREEDY, 0), SpecSettings(n_predict=n, draft_max=K_MAX), auto))
    assert [e.id for e in events if isinstance(e, Token)] == plain_decode(model, PROMPT, n, Sampler(GREEDY, 0))
    drafted = [e.n_drafted for e in events if isinstance(e, Step) and e.n_drafted]
    return drafted, cache.model.checkpoints["restored"] - restored, auto


@pytest.mark.parametrize("drafter", ["draft", "ngram"])
@pytest.mark.parametrize("limit", [0, 2])
def test_auto_drafts_past_the_snapshots_when_checkpoints_are_cheap(limit, drafter):
    """10 us a copy or a restore: long drafts pay, verifying 9 tokens costs 1.7x verifying 1."""
    drafted, restored, _ = run_auto(limit, save=1e-5, restore=1e-5, drafter=drafter)
    assert drafted and max(drafted) > limit
    if drafter == "draft":  # (n-gram lookup on a cycle is never wrong that far back)
        assert restored > 0  # some were rejected further back than the snapshots reach


@pytest.mark.parametrize("drafter", ["draft", "ngram"])
def test_auto_never_drafts_when_every_draft_needs_a_dear_checkpoint(drafter):
    """No snapshots (Mamba): every draft needs a checkpoint, here 20 ms against 1.1 ms a pass,
    more than even 8 accepted tokens save."""
    drafted, _, auto = run_auto(0, save=20e-3, restore=1e-5, drafter=drafter)
    assert drafted == []
    if drafter == "draft":
        assert "auto declined draft: slower than the target alone on this hardware even at 95% acceptance" \
            in auto.summary()


@pytest.mark.parametrize("drafter", ["draft", "ngram"])
@pytest.mark.parametrize("save, restore", [(20e-3, 1e-5), (1e-5, 20e-3)], ids=["dear-copy", "dear-restore"])
def test_auto_keeps_drafts_within_the_snapshots_when_checkpoints_are_dear(drafter, save, restore):
    """2 snapshots: drafts of 2 need no checkpoint; longer ones pay 20 ms for its copy, or risk
    20 ms for a restore. auto drafts, never more than 2, and never comes back to a checkpoint."""
    drafted, restored, _ = run_auto(2, save, restore, drafter)
    assert drafted and max(drafted) == 2
    assert restored == 0
