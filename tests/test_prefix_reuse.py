"""Between runs an Engine keeps what its caches hold: a prompt that starts like the previous
conversation only processes what is new, and the output is the same as from scratch."""

from __future__ import annotations

import pytest

from speculative.decoding.settings import ModelSpec, SamplerSettings, SpecSettings
from speculative.engine.engine import Engine
from speculative.engine.stream import Stream, complete
from tests.conftest import SMOL

pytestmark = pytest.mark.real

GREEDY = SamplerSettings(temp=0.0)
SPEC = SpecSettings(types=("draft",), draft_max=4, n_predict=24)


@pytest.fixture(scope="module")
def specs(model_path):
    path = model_path(SMOL)
    return ModelSpec(path, "target", n_ctx=1024), ModelSpec(path, "draft", n_ctx=1024)


def run_all(engine: Engine, prompt: list[int]):
    final = complete(engine, prompt, GREEDY, SPEC, seed=1)
    return final.tokens, final.stats


def test_a_conversation_reuses_its_history_and_decodes_the_same(specs, batch_invariant):
    with Engine(*specs) as engine:
        p1 = engine.prompt_tokens("The three primary colours are")
        out1, stats = run_all(engine, p1)
        assert stats.n_cached == 0
        p2 = [*p1, *out1, *engine.target.tokenize(" In short:", add_special=False)]
        out2, stats = run_all(engine, p2)
        assert stats.n_cached == len(p1) + len(out1) - 1  # all but the previous run's last token
        assert stats.to_dict()["n_cached"] == stats.n_cached

        # The first prompt again: its own prefix is still there.
        again, stats = run_all(engine, p1)
        assert again == out1 and stats.n_cached == len(p1) - 1

        # A run stopped after 3 tokens leaves nothing stale behind.
        stream = Stream(engine, p2, GREEDY, SPEC, seed=1)
        next(iter(stream))
        assert len(stream.end("stopped").tokens) < SPEC.n_predict
        resumed, stats = run_all(engine, p2)
        assert resumed == out2 and stats.n_cached == len(p2) - 1

    with Engine(*specs) as fresh:
        assert run_all(fresh, p2)[0] == out2
