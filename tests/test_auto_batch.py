"""auto with other requests in the target's pass (requests at once, engine/parallel.py): each step
it plans for the whole pass, whose cost grows with every request's tokens, so speculation
shrinks as the batch fills and grows back when the request is alone.

A fake clock makes every pass cost what the curve says; n-gram lookup drafts on a toy target
whose output falls into a cycle, so that drafts are right often enough to pay alone.
"""

from __future__ import annotations

import numpy as np
import pytest

from speculative.decoding.cache import Cache
from speculative.decoding.drafter import Drafter
from speculative.decoding.events import Step, Token
from tests.fakes import generate
from speculative.decoding.sampling import Sampler
from speculative.decoding.settings import SamplerSettings, SpecSettings
from speculative.drafters import NgramSimple
from speculative.drafters.auto import Auto, best_plan
from tests.fakes import Clock, FakeBackend, ToyModel, plain_decode

GREEDY = SamplerSettings(temp=0.0)
K_MAX = 6
SLOTS = 4


def pass_cost(b: int) -> float:
    """A pass of b tokens: 5 ms, and 1 ms per token (a CPU's weights read once, its work per token)."""
    return 5e-3 + 1e-3 * b


def test_a_draft_pays_for_what_it_costs_the_others_in_the_pass():
    """At 80% acceptance, alone, 4 drafted tokens double the speed; with 3, 7 and 15 other
    requests' tokens in the pass the best draft is shorter and gains less: 12%, 2%, 0.2% (less
    than auto's margin: it decodes plainly)."""
    rates = np.full(K_MAX, 0.8)
    plans = []
    for others in (0, 3, 7, 15):
        verify = np.array([np.inf, *(pass_cost(others + b) for b in range(1, K_MAX + 2))])
        k, speed = best_plan(rates, verify, 0.0, K_MAX, others=others)
        plans.append((k, round(speed / ((others + 1) / verify[1]), 3)))
    assert plans == [(4, 2.017), (3, 1.116), (2, 1.023), (1, 1.002)]


def run(load: tuple[int, int] | None, n: int = 80) -> list[int]:
    """The draft lengths auto chose, with other requests putting `load` (tokens, requests) in
    every pass (None: alone, as a lone engine runs it); the output is the target's own."""
    model = ToyModel(vocab=8, seed=3, eog_bias=-40.0)
    clock = Clock(pass_cost if load is None else (lambda b: pass_cost(load[0] + b)))
    cache = Cache(clock.timed(FakeBackend(model, n_ctx=512)))
    with pytest.MonkeyPatch.context() as patch:
        for module in ("decoding.loop", "drafters.auto"):
            patch.setattr(f"speculative.{module}.time", clock)
        costs = [pass_cost(b) for b in range(1, K_MAX + 2)]
        shared = [[pass_cost(o + b) for b in range(1, K_MAX + 2)] for o in range(1, SLOTS)]
        auto = Auto([NgramSimple(n=2, m=K_MAX)], costs, K_MAX, load=None if load is None else (lambda: load),
                    shared_costs=shared)
        events = list(generate(cache, [1, 2, 3], Sampler(GREEDY, 0), SpecSettings(n_predict=n, draft_max=K_MAX),
                               auto))
    assert [e.id for e in events if isinstance(e, Token)] == plain_decode(model, [1, 2, 3], n, Sampler(GREEDY, 0))
    return [e.n_drafted for e in events if isinstance(e, Step)]


def test_speculation_shrinks_as_the_batch_fills():
    """Other requests decoding plainly, 1 to 27 of them: auto's drafts per step shrink as their
    tokens fill the pass, down to none; alone it drafts as a lone engine does. Passes with more
    than the SLOTS - 1 others calibrated are priced as growing by what the last one added."""
    means = []
    for load in (None, (1, 1), (3, 3), (7, 7), (15, 15), (27, 27)):
        drafted = run(load)
        means.append(sum(drafted) / len(drafted))
    assert means == sorted(means, reverse=True) and len(set(means)) == len(means)
    assert means[0] > 3 and means[-1] == 0


def test_a_pass_sliced_per_sequence_is_priced_as_what_runs():
    """With a KV stream per sequence or a recurrent state, llama.cpp runs a pass of b tokens of one
    request and one of each other's in equal slices per sequence: the first slice carries a token
    of each, the rest of the draft goes alone, a pass each. Calibrated as such, a draft that pays
    alone (80% acceptance, the first plan of the test above) does not among 3 others."""
    rates = np.full(K_MAX, 0.8)
    sliced = [[pass_cost(o + 1) + (b - 1) * pass_cost(1) for b in range(1, K_MAX + 2)] for o in range(1, SLOTS)]
    alone = [pass_cost(b) for b in range(1, K_MAX + 2)]
    auto = Auto([NgramSimple(n=2, m=K_MAX)], alone, K_MAX, load=lambda: (3, 3), shared_costs=sliced)
    assert best_plan(rates, auto._pass_costs(0), 0.0, K_MAX)[0] == 4
    k, speed = best_plan(rates, auto._pass_costs(3), 0.0, K_MAX, others=3)
    assert speed < 4 / auto._pass_costs(3)[1]  # below plain decoding's, at every k


class Fed(Drafter):
    """A draft model that only records the prompts it is fed."""
    name = "draft"

    def __init__(self):
        self.fed = 0

    def prefill(self, prompt) -> None:
        self.fed += 1


@pytest.mark.parametrize("draft_cost, others, fed", [(0.5e-3, 0, True), (0.5e-3, 3, False), (4e-3, 0, False)],
                         ids=["pays alone", "not among 3 others", "too dear alone"])
def test_a_draft_model_is_fed_the_prompt_only_where_auto_would_draft_with_it(draft_cost, others, fed):
    """At its prior estimates (70%, then 85% a token), a draft model of 0.5 ms a token pays
    alone on the curve of 5 ms and 1 ms a token, and not with three others in the pass: it
    would beat plain decoding there only at 95% acceptance, which is not what auto expects of
    it, so its prompt (a third of the target's on a CPU) is not paid for."""
    alone = [pass_cost(b) for b in range(1, K_MAX + 2)]
    shared = [[pass_cost(o + b) for b in range(1, K_MAX + 2)] for o in range(1, SLOTS)]
    draft = Fed()
    auto = Auto([draft], alone, K_MAX, {"draft": draft_cost}, load=lambda: (others, others), shared_costs=shared)
    auto.prefill([1, 2, 3])
    assert draft.fed == fed
    if others:  # beyond its estimates, not beyond the 95% ceiling
        assert "draft" not in auto.declined
