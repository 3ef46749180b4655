"""The stream layer over a fake engine: pieces per step, stop strings, the final value."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from speculative.decoding.cache import Cache
from tests.fakes import generate
from speculative.decoding.sampling import Sampler
from speculative.decoding.settings import SamplerSettings, SpecSettings
from speculative.drafters import ModelDrafter
from speculative.engine.stream import Stream, complete
from tests.fakes import FakeBackend, ToyModel

GREEDY = SamplerSettings(temp=0.0)
PROMPT = [3, 5, 7, 11]
SPEC = SpecSettings(types=("draft",), draft_max=4, n_predict=40)


def fake_engine():
    """What Stream reads off an Engine: runs of the loop over a fake target and draft."""
    model = ToyModel(seed=0, eog_bias=-40.0)
    target, draft = Cache(FakeBackend(model)), Cache(FakeBackend(model.perturbed(0.4, seed=7), name="draft"))

    def run(prompt, sampling, spec, seed, carry=False):
        return generate(target, prompt, Sampler(sampling, seed), spec, ModelDrafter(draft))

    return SimpleNamespace(run=run, target=target.model, t_load=0.5, busy_seconds=lambda: 0.0, notes=lambda: [],
                           plan_seconds=lambda: 0.0)


def test_one_piece_per_step_and_a_final_value_that_adds_up():
    stream = Stream(fake_engine(), PROMPT, GREEDY, SPEC, seed=1)
    pieces = list(stream)
    final = stream.end()
    steps = final.stats.n_steps
    assert len(pieces) == steps and final.reason == "length"
    assert all(p.parts for p in pieces)  # every step emits at least the target's own token
    assert sum(len(p.parts) for p in pieces) == len(final.tokens) == final.stats.n_predict == 40
    assert final.text == "".join(p.text for p in pieces) == "".join(chr(96 + t) for t in final.tokens)
    drafted = sum(from_draft for p in pieces for _, from_draft in p.parts)
    assert drafted == final.stats.n_accept > 0 and final.stats.t_load == 0.5


def test_a_stop_string_cuts_the_text_in_the_middle_of_a_step():
    whole = complete(fake_engine(), PROMPT, GREEDY, SPEC, seed=1)
    start = len(whole.text) // 2
    stop = whole.text[start : start + 3]
    cut = whole.text.find(stop)
    stream = Stream(fake_engine(), PROMPT, GREEDY, SPEC, seed=1, stops=[stop])
    pieces = list(stream)
    final = stream.end()
    assert final.reason == "stop" and final.text == whole.text[:cut] == "".join(p.text for p in pieces)
    assert final.tokens == whole.tokens[: len(final.tokens)] and len(final.tokens) < len(whole.tokens)
    assert final.stats.finish_reason == "stop" and final.stats.n_predict == len(final.tokens)


@pytest.mark.parametrize("after", [0, 1, 3])
def test_should_stop_ends_the_run_after_the_prompt_or_a_step(after):
    asked = []

    def should_stop():
        asked.append(1)
        return "cancelled" if len(asked) > after else None

    stream = Stream(fake_engine(), PROMPT, GREEDY, SPEC, seed=1, should_stop=should_stop)
    pieces = list(stream)
    final = stream.end()
    assert len(pieces) == after and final.reason == final.stats.finish_reason == "cancelled"
    assert final.stats.n_prompt == len(PROMPT) and final.stats.n_steps == after


def test_a_consumer_that_stops_early_still_gets_the_statistics():
    stream = Stream(fake_engine(), PROMPT, GREEDY, SPEC, seed=1)
    first = next(iter(stream))
    final = stream.end("interrupted")
    assert final.reason == "interrupted" and final.text == first.text
    assert final.stats.n_predict == len(final.tokens) == len(first.parts) and final.stats.t_decode > 0
