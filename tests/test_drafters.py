"""N-gram drafters, chains and the cost-aware auto planner, against the fake backend."""

from __future__ import annotations

import json

import numpy as np
import pytest

from speculative.decoding.cache import Cache
from speculative.decoding.drafter import Draft, Outcome
from speculative.decoding.events import Step, Token
from tests.fakes import generate
from speculative.decoding.sampling import Sampler
from speculative.decoding.settings import SamplerSettings, SpecSettings
from speculative.drafters import Chain, ModelDrafter, NgramMapK, NgramSimple
from speculative.drafters.auto import Acceptance, Auto, best_plan, expected_tokens
from speculative.drafters.ngram import NgramIndex
from speculative.engine import calibrate
from speculative.engine.costs import SAMPLES, CostBook, ModelCosts, reset
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


def run_auto(model, drafters, verify_costs, n=60, draft_costs=None, calibrated=None, book=None):
    """`calibrated`: what auto was told verifies cost (default: what they do cost); `book`: a
    model's entry that learns what the passes cost, as a model's on_pass does."""
    clock = Clock(verify_costs)
    backend = clock.timed(FakeBackend(model))
    if book is not None:
        verify = backend.decode_branches

        def timed(tokens, positions, seqs):
            start = clock.now
            rows = verify(tokens, positions, seqs)
            book.record(len(tokens), seconds=clock.now - start)
            return rows
        backend.decode_branches = timed
    target = Cache(backend)
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


# -- what passes cost: calibration and the book of costs ------------------------------


TOY = {"model": "toy"}  # a model's identity in the book


def calibrated(clock: Clock, sizes: list[int], spikes: dict | None = None, book: CostBook | None = None) -> ModelCosts:
    """A model's book entry after calibrating `sizes` on the fake clock, with `spikes` (round, size)
    -> seconds of load added to those decodes (round 0 is the untimed one, and each attempt has
    its rounds)."""
    spikes = dict(spikes or {})
    backend = FakeBackend(ToyModel(seed=0))
    rounds_seen: dict[int, int] = {}

    def decoded(tokens, pos, outputs, decode=backend.decode):
        b = len(tokens)
        if outputs == "all":
            r = rounds_seen[b] = rounds_seen.get(b, -1) + 1
            clock.now += clock.cost(b) + spikes.pop((r, b), 0.0)
        return decode(tokens, pos, outputs)

    backend.decode = decoded
    cache = Cache(backend)
    timings, why = calibrate.calibrate(lambda sizes, report: calibrate.measure(cache, sizes, report), sizes)
    assert len(cache) == 0 and backend.cache == []  # the cache is left empty
    costs = (book or CostBook()).model(TOY)
    costs.record_rounds(timings.rounds, keep=why is None)
    return costs


def test_a_calibration_times_each_size_in_rounds_and_the_ratios_follow(monkeypatch):
    clock = Clock(lambda b: 1e-3 * b)  # a batch of b tokens takes b ms
    monkeypatch.setattr("speculative.engine.calibrate.time", clock)
    costs = calibrated(clock, calibrate.target_sizes(17))
    assert costs.measured() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17]
    assert costs.seconds() == pytest.approx(1e-3)
    assert [costs.ratio(b) for b in (2, 9, 11, 17, 21)] == pytest.approx([2, 9, 11, 17, 21])  # 11: between
    assert costs.price(4) == pytest.approx(4e-3)


def test_a_moment_of_load_spoils_one_rounds_figure_not_the_calibration(monkeypatch):
    clock = Clock(lambda b: 1e-3 * b)
    monkeypatch.setattr("speculative.engine.calibrate.time", clock)
    costs = calibrated(clock, list(range(1, 10)), spikes={(2, 5): 1.0})  # one decode meets another process
    assert [costs.price(b) for b in range(1, 10)] == pytest.approx([1e-3 * b for b in range(1, 10)])
    assert costs.to_dict(None)["calibrated"]["5"] == pytest.approx(5.0)  # agreeing with itself, it is kept


def test_a_calibration_that_disagrees_with_itself_is_measured_again(monkeypatch):
    clock = Clock(lambda b: 1e-3 * b)
    monkeypatch.setattr("speculative.engine.calibrate.time", clock)
    busy = {(1, b): 0.05 * b for b in range(2, 10)}  # the first attempt's first round: every size loaded
    costs = calibrated(clock, list(range(1, 10)), spikes=busy)
    assert [costs.price(b) for b in range(1, 10)] == pytest.approx([1e-3 * b for b in range(1, 10)])
    kept = costs.to_dict(None)  # the second attempt's
    assert kept["calibrated"]["9"] == pytest.approx(9.0) and len(kept["seconds"]) == calibrate.ROUNDS


def test_a_calibration_still_busy_after_every_attempt_is_used_and_not_kept(monkeypatch, tmp_path):
    clock = Clock(lambda b: 1e-3 * b)
    monkeypatch.setattr("speculative.engine.calibrate.time", clock)
    busy = {(r, b): 0.05 * b for r in range(1, (calibrate.ROUNDS + 1) * calibrate.ATTEMPTS, 2) for b in range(2, 10)}
    book = CostBook(tmp_path / "costs.json")
    costs = calibrated(clock, list(range(1, 10)), spikes=busy, book=book)
    assert costs.price(2) > 0  # this process plans with it ...
    book.save()
    assert CostBook(tmp_path / "costs.json").model(TOY).measured() == []  # ... and no other


def test_a_calibration_with_a_batch_cheaper_than_a_token_is_not_trusted():
    timings = calibrate.Timings({1: [1e-2] * 3, 2: [2e-3] * 3})  # the single token met the load, every round
    assert "0.20x one token's time" in calibrate.disagreement(timings)
    assert calibrate.disagreement(calibrate.Timings({1: [1e-3] * 3, 2: [2e-3] * 3}, again=3e-3)) == \
        "one token took 3.00x as long at the end"
    assert calibrate.disagreement(calibrate.Timings({1: [1e-3] * 3, 2: [2e-3] * 3}, again=1.1e-3)) is None


def test_a_busy_while_moves_the_seconds_not_the_ratios():
    """A round measured while the machine ran at a third of its speed: its ratios are the quiet
    rounds' (each round's sizes are taken to its own single token)."""
    costs = ModelCosts({"model": "toy"})
    costs.record_rounds({1: [1e-3, 3e-3, 1e-3], 4: [2e-3, 6e-3, 2e-3], 8: [5e-3, 15e-3, 5e-3]})
    assert [costs.ratio(b) for b in (4, 8)] == pytest.approx([2.0, 5.0])
    assert costs.seconds() == pytest.approx(1e-3)


def test_prices_hold_for_an_engine_and_follow_only_real_drift(tmp_path):
    path = tmp_path / "costs.json"
    book = CostBook(path)
    first = book.model(TOY)
    first.record_rounds({1: [1e-3] * 3, 2: [1.5e-3] * 3})
    assert first.price(2) == pytest.approx(1.5e-3)
    for _ in range(SAMPLES):
        first.record(2, seconds=1.55e-3)  # a little dearer than calibrated
    assert first.price(2) == pytest.approx(1.5e-3)  # an engine's prices are fixed once asked for
    book.save()
    book = CostBook(path)
    second = book.model(TOY)  # the next process: within DRIFT of the last one's prices, those
    assert second.ratio(2) == pytest.approx(1.55) and second.price(2) == pytest.approx(1.5e-3)
    for _ in range(SAMPLES):
        second.record(2, seconds=3e-3)  # twice as dear, pass after pass
    assert second.price(2) == pytest.approx(1.5e-3)
    book.save()
    assert CostBook(path).model(TOY).price(2) == pytest.approx(3e-3)  # moved beyond DRIFT: followed


def test_runs_teach_the_book_what_each_draft_size_really_costs(tmp_path):
    """A calibration that made drafts look cheap (a short context, a lucky moment) is corrected by
    the drafts' own passes: after a few runs auto no longer drafts, each run planned with the
    prices the book had when it started."""
    model = cyclic_model()
    path = tmp_path / "costs.json"
    book = CostBook(path)
    book.model(TOY).record_rounds({b: [1e-3] * 3 for b in range(1, 10)})  # flat: drafting looks free
    book.save()
    real = [1e-3] + [12e-3] * 8  # any draft costs more than its tokens save
    drafts = []
    for _ in range(6):
        book = CostBook(path)
        costs = book.model(TOY)
        events, _ = run_auto(model, [NgramSimple(n=2, m=8)], real, n=60,
                             calibrated=[costs.price(b) for b in range(1, 10)], book=costs)
        assert [e.id for e in events if isinstance(e, Token)] == plain_decode(model, [1, 2, 3], 60, Sampler(GREEDY, 0))
        drafts.append(sum(1 for e in events if isinstance(e, Step) and e.n_drafted))
        book.save()
    assert drafts[0] > 0 and drafts[-1] == 0, drafts


def test_a_damaged_or_foreign_book_is_timed_again(tmp_path):
    path = tmp_path / "costs.json"
    for text in ("{not json", '{"format": 1}', '{"format": 2, "models": {"k": {"identity": {}, "seconds": [-1]}}}'):
        path.write_text(text)
        assert CostBook(path).model({}).measured() == []


def test_reset_forgets_every_model_or_those_it_is_told_to(tmp_path):
    path = tmp_path / "costs.json"
    book = CostBook(path)
    for name in ("a", "b"):
        book.model({"model": name}).record_rounds({1: [1e-3] * 3})
    book.save()
    (tmp_path / "calibration.json").write_text("{}")  # an older version's
    assert reset(path, keep=lambda identity: identity["model"] == "b") == 1
    assert not (tmp_path / "calibration.json").exists()
    assert CostBook(path).model({"model": "a"}).measured() == [] and CostBook(path).model({"model": "b"}).measured()
    assert reset(path) == 1 and reset(tmp_path / "none.json") == 0


@pytest.mark.parametrize("cost", [1e-3])
def test_auto_output_equals_plain_decoding_with_a_model_drafter(cost):
    model = ToyModel(seed=0, eog_bias=-40.0)
    draft = model.perturbed(0.3, seed=5)
    drafters = [NgramSimple(n=3, m=8), ModelDrafter(Cache(FakeBackend(draft)))]
    events, _ = run_auto(model, drafters, [cost] * 9, draft_costs={"draft": cost / 20})
    assert [e.id for e in events if isinstance(e, Token)] == plain_decode(model, [1, 2, 3], 60, Sampler(GREEDY, 0))
    assert any(e.drafter == "draft" for e in events if isinstance(e, Step))


def test_doctor_reset_costs_forgets_every_model_or_the_one_named(tmp_path):
    from speculative.files import content_identity
    from tests.conftest import speculate_here

    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(60))  # what -m is checked for; nothing loads
    book = CostBook(tmp_path / "costs.json")
    book.model({**content_identity(model), "threads": 2}).record_rounds({1: [1e-3] * 3})
    book.model({"size": 1, "sha256_head_tail": "another", "threads": 2}).record_rounds({1: [1e-3] * 3})
    book.save()
    env = {"SPECULATE_HOME": str(tmp_path)}
    named = speculate_here("doctor", "--reset-costs", "-m", str(model), env=env)
    assert named.returncode == 0 and "forgot the costs of 1 model " in named.stderr, named.stderr
    assert CostBook(tmp_path / "costs.json").model({"size": 1, "sha256_head_tail": "another", "threads": 2}).measured()
    every = speculate_here("doctor", "--reset-costs", env=env)
    assert every.returncode == 0 and "forgot the costs of 1 model " in every.stderr
    assert json.loads((tmp_path / "costs.json").read_text())["models"] == {}
