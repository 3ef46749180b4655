"""N-gram drafters, chains and the cost-aware auto planner, against the fake backend."""

from __future__ import annotations

import numpy as np
import pytest

from speculative.decoding.cache import Cache
from speculative.decoding.drafter import Draft, Outcome
from speculative.decoding.events import Step, Token
from speculative.decoding.loop import generate
from speculative.decoding.sampling import Sampler
from speculative.decoding.settings import SamplerSettings, SpecSettings
from speculative.drafters import Chain, ModelDrafter, NgramMapK, NgramSimple
from speculative.drafters.auto import Acceptance, Auto, best_plan, expected_tokens
from speculative.drafters.ngram import NgramIndex
from speculative.engine.calibrate import _timed, batch_costs
from tests.fakes import Clock, FakeBackend, ToyModel, plain_decode

GREEDY = SamplerSettings(temp=0.0)

# -- n-gram lookup ------------------------------------------------------------


def test_index_is_incremental_and_matches_a_rescan():
    rng = np.random.default_rng(0)
    history = rng.integers(0, 5, size=300).tolist()
    index = NgramIndex(3)
    for end in [*range(0, 300, 7), 300]:  # synced piecemeal, as generation grows the history
        index.sync(history[:end])
    brute: dict = {}
    for i in range(3, 300):
        brute.setdefault(tuple(history[i - 3 : i]), []).append(i)
    assert index.after == brute


def test_ngram_simple_proposes_what_followed_the_latest_match():
    history = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    drafter = NgramSimple(n=3, m=4)
    assert drafter.propose(history, 10) == Draft([7, 8, 5, 1], "ngram-simple")
    assert drafter.propose(history, 2).tokens == [7, 8]          # k caps
    assert NgramSimple(n=3, m=4, min_hits=3).propose(history, 10).tokens == []  # only 2 earlier hits
    assert drafter.propose([4, 4, 6, 5], 3).tokens == []         # no earlier occurrence


def test_ngram_simple_continuation_may_run_into_the_present():
    assert NgramSimple(n=2, m=8).propose([5, 6, 5, 6], 8).tokens == [5, 6]


def test_ngram_map_k_votes_for_the_most_frequent_continuation():
    history = [1, 2, 7, 0, 1, 2, 7, 0, 1, 2, 8, 0, 1, 2]
    drafter = NgramMapK(n=2, m=2, min_hits=2)
    assert drafter.propose(history, 5).tokens == [7, 0]          # 7 followed twice, 8 once
    assert NgramMapK(n=2, m=2, min_hits=3).propose(history, 5).tokens == []
    # after a draft from this key, the next one is at most one longer than what was accepted
    drafter.accept(Outcome(Draft([7, 0], "ngram-map-k"), 0, 8, 0.0, 0.0))
    assert drafter.propose(history, 5).tokens == [7]


def test_chain_uses_the_first_drafter_with_a_proposal():
    model = ToyModel(seed=1)
    chain = Chain([NgramSimple(n=3, m=4), ModelDrafter(Cache(FakeBackend(model)), p_min=0.0)])
    assert chain.name == "ngram-simple,draft"
    assert chain.propose([1, 2, 3, 4, 1, 2, 3], 2) == Draft([4, 1], "ngram-simple")
    fallback = chain.propose([1, 2, 3, 4, 5], 2)
    assert fallback.source == "draft" and len(fallback.tokens) == 2


# -- auto ----------------------------------------------------------------------


def test_expected_tokens_and_best_plan():
    rates = np.array([1.0, 0.5, 0.5])
    assert expected_tokens(rates).tolist() == [1.0, 2.0, 2.5, 2.75]
    flat = np.array([np.inf, 1.0, 1.0, 1.0, 1.0])  # verifying 4 tokens costs what 1 does
    assert best_plan(rates, flat, 0.0, 3) == (3, 2.75)
    linear = np.array([np.inf, 1.0, 2.0, 3.0, 4.0])
    assert best_plan(rates, linear, 0.0, 3)[1] <= 1.0  # never beats plain decoding at 1 token/s


def test_acceptance_estimates_follow_recent_evidence():
    a = Acceptance(4, first_prior=0.5)
    for _ in range(30):
        a.age()
        a.observe_draft(4, 4)
    assert (a.rates() > 0.85).all()
    for _ in range(30):
        a.age()
        a.observe_draft(4, 0)
    assert a.rates()[0] < 0.15


def cyclic_model() -> ToyModel:
    """Greedy output of this toy model falls into a short cycle: n-gram lookup predicts it."""
    model = ToyModel(vocab=8, seed=3, eog_bias=-40.0)
    return model


def run_auto(model, drafters, verify_costs, n=60, draft_costs=None, calibrated=None):
    """`calibrated`: what auto was told verifies cost (default: what they do cost)."""
    clock = Clock(verify_costs)
    target = Cache(clock.timed(FakeBackend(model)))
    auto = Auto(drafters, calibrated or verify_costs, k_max=8, draft_costs=draft_costs)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("speculative.decoding.loop.time", clock)
        patch.setattr("speculative.drafters.auto.time", clock)
        events = list(generate(target, [1, 2, 3], Sampler(GREEDY, 0), SpecSettings(n_predict=n, draft_max=8), auto))
    return events, auto


def test_auto_drafts_long_when_verification_is_flat_and_output_repeats():
    model = cyclic_model()
    events, _ = run_auto(model, [NgramSimple(n=2, m=8)], [1e-3] * 9)
    steps = [e for e in events if isinstance(e, Step)]
    assert [e.id for e in events if isinstance(e, Token)] == plain_decode(model, [1, 2, 3], 60, Sampler(GREEDY, 0))
    assert max(s.n_drafted for s in steps) >= 5
    assert len(steps) < 20  # 60 tokens in far fewer target passes


def test_auto_never_drafts_when_verification_costs_grow_linearly():
    model = cyclic_model()
    events, _ = run_auto(model, [NgramSimple(n=2, m=8)], [1e-3 * b for b in range(1, 10)])
    assert all(e.n_drafted == 0 for e in events if isinstance(e, Step))
    assert [e.id for e in events if isinstance(e, Token)] == plain_decode(model, [1, 2, 3], 60, Sampler(GREEDY, 0))


def test_auto_declines_a_draft_model_that_cannot_pay_here():
    model = cyclic_model()
    drafter = ModelDrafter(Cache(FakeBackend(model)))
    # a draft token costs as much as a target pass: even perfect acceptance loses
    events, auto = run_auto(model, [drafter], [1e-3] * 9, draft_costs={"draft": 1e-3})
    assert all(e.n_drafted == 0 for e in events if isinstance(e, Step))
    assert "even at 95% acceptance" in auto.summary()[0]


def test_auto_learns_while_declining():
    """Free proposals are scored against the real output even when not verified."""
    model = cyclic_model()
    _, auto = run_auto(model, [NgramSimple(n=2, m=8)], [1e-3 * b for b in range(1, 10)])
    most_seen = max(auto.acceptance.values(), key=lambda estimates: estimates.trials.sum())
    assert most_seen.trials.sum() > 5 and (most_seen.rates()[:4] > 0.8).all()


# -- calibration ---------------------------------------------------------------


def test_calibration_is_measured_once_and_cached(tmp_path, monkeypatch):
    clock = Clock(lambda b: 1e-3 * b, redecode=True)  # a batch of b tokens takes b ms
    monkeypatch.setattr("speculative.engine.calibrate.time", clock)
    backend = clock.timed(FakeBackend(ToyModel(seed=0)))
    cache = Cache(backend)
    identity = {"name": "toy", "threads": 2}
    messages = []
    first = batch_costs(cache, 5, identity, messages.append, path=tmp_path / "cal.json")
    assert first == pytest.approx([1e-3 * b for b in range(1, 6)]) and messages
    assert backend.cache == [] and len(cache) == 0  # the cache is left empty
    messages.clear()
    assert batch_costs(cache, 4, identity, messages.append, path=tmp_path / "cal.json") == first[:4]
    assert messages == []  # no new measurement
    other = batch_costs(cache, 4, {**identity, "threads": 4}, messages.append, path=tmp_path / "cal.json")
    assert messages and len(other) == 4


def test_calibration_keeps_each_sizes_best_round(monkeypatch):
    """A moment of load spoils one round's time of one size, not the calibration."""
    clock = Clock([])
    spikes = {5: 1.0}  # the first timed decode of 5 tokens meets another process
    warmed = set()

    def decode(batch):
        if len(batch) not in warmed:  # the untimed first decode of each size
            warmed.add(len(batch))
        else:
            clock.now += spikes.pop(len(batch), 0.0)
        clock.now += 1e-3 * len(batch)

    monkeypatch.setattr("speculative.engine.calibrate.time", clock)
    costs = _timed(9, 100, decode, lambda: None)
    assert costs == pytest.approx([1e-3 * b for b in range(1, 10)])


def test_a_calibration_measured_under_load_is_noticed():
    model = cyclic_model()
    real = [1e-3 * b for b in range(1, 10)]
    _, auto = run_auto(model, [NgramSimple(n=2, m=8)], real, calibrated=[4 * c for c in real])
    assert auto.calibration_stale()
    assert any("4.0x faster than its calibration" in note for note in auto.summary())
    # a machine slower than at calibration (throttled, shared) is what speed_factor is for
    _, auto = run_auto(model, [NgramSimple(n=2, m=8)], real, calibrated=[c / 4 for c in real])
    assert not auto.calibration_stale() and auto.speed_factor == pytest.approx(4.0, rel=0.05)


def test_auto_learns_what_each_draft_size_really_costs():
    """A calibration that makes drafts look cheap (measured on a short context, or in a busy
    moment) is corrected by the drafts' own verify times: auto stops drafting."""
    model = cyclic_model()
    real = [1e-3] + [12e-3] * 8  # any draft costs more than its tokens save
    events, auto = run_auto(model, [NgramSimple(n=2, m=8)], real, n=120, calibrated=[1e-3] * 9)
    drafted = [e.n_drafted for e in events if isinstance(e, Step) and e.n_drafted]
    assert [e.id for e in events if isinstance(e, Token)] == plain_decode(model, [1, 2, 3], 120, Sampler(GREEDY, 0))
    assert 0 < len(drafted) <= 4  # a few drafts teach it
    assert auto.speed_factor == pytest.approx(1.0) and auto.verify[max(drafted) + 1] > 6e-3


def test_a_damaged_calibration_cache_is_measured_again(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text("{not json")
    assert len(batch_costs(Cache(FakeBackend(ToyModel())), 3, {"name": "toy"}, path=path)) == 3


@pytest.mark.parametrize("cost", [1e-3])
def test_auto_output_equals_plain_decoding_with_a_model_drafter(cost):
    model = ToyModel(seed=0, eog_bias=-40.0)
    draft = model.perturbed(0.3, seed=5)
    drafters = [NgramSimple(n=3, m=8), ModelDrafter(Cache(FakeBackend(draft)))]
    events, _ = run_auto(model, drafters, [cost] * 9, draft_costs={"draft": cost / 20})
    assert [e.id for e in events if isinstance(e, Token)] == plain_decode(model, [1, 2, 3], 60, Sampler(GREEDY, 0))
    assert any(e.drafter == "draft" for e in events if isinstance(e, Step))
