"""The draft/verify loop against a fake backend: milliseconds per test."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from speculative.decoding.cache import Cache
from speculative.decoding.events import Done, Prefilled, Prefilling, Step, Token
from tests.fakes import generate
from speculative.decoding.sampling import Sampler, softmax
from speculative.decoding.settings import SamplerSettings, SpecSettings, check_prompt
from speculative.drafters import ModelDrafter, top_probability
from speculative.errors import GenerationError
from speculative.decoding import scheduler
from tests.fakes import EOG, FakeBackend, ToyModel, plain_decode

GREEDY = SamplerSettings(temp=0.0)
PROMPT = [3, 5, 7, 11]


def run(target_model, draft_model=None, *, n=40, n_ctx=256, n_ctx_draft=None, sampling=GREEDY, seed=1,
        prompt=PROMPT, p_min=0.0, draft_sampling=None, branches=1, p_split=0.1, **spec):
    target = FakeBackend(target_model, n_ctx=n_ctx, n_seq=branches)
    draft = FakeBackend(draft_model, n_ctx=n_ctx_draft or n_ctx, name="draft", n_seq=branches) if draft_model else None
    draft_sampler = Sampler(draft_sampling, seed + 1000) if draft_sampling else None
    drafter = ModelDrafter(Cache(draft), p_min=p_min, sampler=draft_sampler, branches=branches,
                           p_split=p_split) if draft else None
    events = list(generate(Cache(target), prompt, Sampler(sampling, seed), SpecSettings(n_predict=n, **spec), drafter))
    return events, target, draft


def tokens_of(events):
    return [e.id for e in events if isinstance(e, Token)]


def steps_of(events):
    return [e for e in events if isinstance(e, Step)]


@pytest.fixture
def model():
    return ToyModel(seed=0, eog_bias=-40.0)  # no end-of-generation unless a test wants one


def test_draft_equal_to_target_accepts_everything(model):
    events, _, _ = run(model, model, draft_max=4)
    assert tokens_of(events) == plain_decode(model, PROMPT, 40, Sampler(GREEDY, 1))
    steps = steps_of(events)
    assert all(s.n_accepted == s.n_drafted for s in steps)
    assert sum(s.n_drafted for s in steps) > 0
    # all k drafted tokens accepted plus a bonus: 5 tokens a step, 40 in 8 steps
    assert len(steps) == 8


@pytest.mark.parametrize("draft_max", [1, 2, 3, 5, 8])
def test_greedy_output_equals_target_only(model, draft_max):
    draft = model.perturbed(0.4, seed=7)
    events, target, drafter_backend = run(model, draft, draft_max=draft_max, n=60)
    out = tokens_of(events)
    assert out == plain_decode(model, PROMPT, 60, Sampler(GREEDY, 1))
    steps = steps_of(events)
    accepted = [e for e in events if isinstance(e, Token) and e.from_draft]
    assert sum(s.n_accepted for s in steps) == len(accepted)
    assert 0 < len(accepted) < sum(s.n_drafted for s in steps)  # some rejections happened
    assert all(s.n_drafted <= draft_max for s in steps)
    # Exact rollback: the target cache holds every token but the last one.
    assert target.cache == (PROMPT + out)[:-1]
    assert drafter_backend.cache == (PROMPT + out)[: len(drafter_backend.cache)]


@pytest.mark.parametrize("branches", [1, 3])
def test_sampled_output_follows_target_stream(model, branches):
    """Sample-and-match consumes the sampler's random stream exactly like target-only
    decoding, so with one seed both produce the same tokens (also over draft trees)."""
    sampling = SamplerSettings(temp=1.0, top_k=0, top_p=1.0, min_p=0.0)
    draft = model.perturbed(0.3, seed=3)
    for seed in range(5):
        events, _, _ = run(model, draft, sampling=sampling, seed=seed, draft_max=4, n=50, accept="match",
                           branches=branches, p_split=0.05)
        assert tokens_of(events) == plain_decode(model, PROMPT, 50, Sampler(sampling, seed))


@pytest.mark.parametrize("branches", [1, 3])
@pytest.mark.parametrize("accept", ["match", "rejection"])
def test_penalties_are_recomputed_for_every_position_of_a_verified_batch(model, accept, branches):
    """With penalties, row i of a batch is sampled after tokens + the path to its node;
    greedy output still equals target-only output, sampled output still the seeded
    target-only stream under sample-and-match."""
    greedy = SamplerSettings(temp=0.0, repeat_penalty=1.8, frequency_penalty=0.3, repeat_last_n=16)
    draft = model.perturbed(0.2, seed=4)
    tree = dict(branches=branches, p_split=0.05)
    events, _, _ = run(model, draft, sampling=greedy, draft_max=5, n=60, accept=accept, **tree)
    assert tokens_of(events) == plain_decode(model, PROMPT, 60, Sampler(greedy, 1))
    assert sum(s.n_accepted for s in steps_of(events)) > 0
    sampled = replace(greedy, temp=1.0, top_k=0, top_p=1.0, min_p=0.0)
    if accept == "match":
        events, _, _ = run(model, draft, sampling=sampled, seed=3, draft_max=4, n=50, accept=accept, **tree)
        assert tokens_of(events) == plain_decode(model, PROMPT, 50, Sampler(sampled, 3))


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_synthetic_acceptance_keeps_drafts_at_its_rates(model, temp):
    """llama.cpp's --spec-synth-rates (benchmarking only): at rates 0 every draft is rejected and
    the output is target-only decoding's, seed for seed (llama.cpp's test_with_and_without_draft);
    at rates 1 every drafted token is kept whatever the target picks (a draft unlike the target:
    the output is then not the target's)."""
    sampling = SamplerSettings(temp=temp, top_k=0, top_p=1.0, min_p=0.0)
    draft = model.perturbed(0.6, seed=9)
    never, _, _ = run(model, draft, sampling=sampling, seed=2, n=40, types=("draft",), draft_max=4,
                      synth_rates=(0.0,) * 4)
    assert tokens_of(never) == plain_decode(model, PROMPT, 40, Sampler(sampling, 2))
    steps = steps_of(never)
    assert sum(s.n_drafted for s in steps) > 0 and sum(s.n_accepted for s in steps) == 0
    always, _, _ = run(model, draft, sampling=sampling, seed=2, n=40, types=("draft",), draft_max=4,
                       synth_rates=(1.0,) * 4)
    steps = steps_of(always)
    assert all(s.n_accepted == s.n_drafted == 4 for s in steps[:-1])
    assert tokens_of(always) != plain_decode(model, PROMPT, 40, Sampler(sampling, 2))


def target_only_marginals(model, sampling, n_tokens: int) -> list[np.ndarray]:
    """The exact distribution of each of the first generated tokens, target alone."""
    sampler = Sampler(sampling, 0)
    marginals, paths = [], {tuple(PROMPT): 1.0}
    for _ in range(n_tokens):
        out, nxt = np.zeros(model.vocab), {}
        for path, weight in paths.items():
            ids, probs = sampler.distribution(model.logits(list(path)))
            for t, pr in zip(ids, probs):
                out[t] += weight * pr
                nxt[path + (int(t),)] = nxt.get(path + (int(t),), 0.0) + weight * pr
        marginals.append(out)
        paths = nxt
    return marginals


@pytest.mark.parametrize("branches", [1, 3])
def test_speculative_sampling_follows_the_target_distribution_and_accepts_more(model, branches):
    """The draft samples at another temperature; the first three tokens of 4,000
    seeded runs match target-only probabilities (L1 bound with false-alarm rate 1e-6,
    see tests/test_verify.py), and more drafts are kept than with sample-and-match.
    With 3 branches the tree's forks are verified by recursive rejection sampling."""
    target_sampling = SamplerSettings(temp=1.0, top_k=6, top_p=1.0, min_p=0.0)
    draft_sampling = SamplerSettings(temp=1.5, top_k=6, top_p=1.0, min_p=0.0)
    draft = model.perturbed(0.3, seed=3)
    runs, n_tokens = 4000, 3
    counts = np.zeros((n_tokens, model.vocab))
    kept = {"rejection": 0, "match": 0}
    for seed in range(runs):
        for accept in kept:
            events, _, _ = run(model, draft, sampling=target_sampling, seed=seed, draft_max=3, n=n_tokens,
                               accept=accept, draft_sampling=draft_sampling if accept == "rejection" else None,
                               branches=branches, p_split=0.1)
            kept[accept] += sum(s.n_accepted for s in steps_of(events))
            if accept == "rejection":
                for i, t in enumerate(tokens_of(events)):
                    counts[i, t] += 1
    lam = np.sqrt(2 * (model.vocab * np.log(2) + np.log(1e6)) / runs)
    for i, expected in enumerate(target_only_marginals(model, target_sampling, n_tokens)):
        assert np.abs(counts[i] / runs - expected).sum() < lam, f"token {i}"
    assert kept["rejection"] > kept["match"]


def test_no_drafter_is_plain_decoding(model):
    events, target, _ = run(model, None, n=30)
    assert tokens_of(events) == plain_decode(model, PROMPT, 30, Sampler(GREEDY, 1))
    assert set(target.batches) == {1}
    assert all(s.drafter is None and s.n_drafted == 0 for s in steps_of(events))


def test_eog_inside_accepted_draft_stops_there():
    model = ToyModel(seed=5, eog_bias=0.0)
    reference = plain_decode(model, PROMPT, 500, Sampler(GREEDY, 1))
    assert len(reference) < 500, "the toy model must reach end-of-generation"
    events, _, _ = run(model, model, draft_max=8, n=500)
    assert tokens_of(events) == reference
    assert events[-1] == Done("stop", events[-1].t_decode)
    assert EOG not in tokens_of(events)
    # the draft proposed the end-of-generation token and the target accepted it
    last_step = steps_of(events)[-1]
    assert last_step.n_accepted >= 1


class Script:
    """A model that says `text` (then end-of-generation), whatever came before."""

    def __init__(self, text: list[int], start: int, vocab: int = 24):
        self.text, self.start, self.vocab = text + [EOG], start, vocab

    def logits(self, context: list[int]) -> np.ndarray:
        row = np.zeros(self.vocab, dtype=np.float32)
        row[self.text[min(max(len(context) - self.start, 0), len(self.text) - 1)]] = 10.0
        return row


@pytest.mark.parametrize("draft_max", [1, 3, 4])
def test_eog_at_any_draft_position_ends_output_exactly_there(draft_max):
    positions = set()  # where in its draft the end-of-generation token was
    for m in range(2 * (draft_max + 1)):
        model = Script([5 + i % 7 for i in range(m)], start=len(PROMPT))
        events, _, _ = run(model, model, draft_max=draft_max, n=100)
        assert tokens_of(events) == model.text[:-1]
        assert events[-1].reason == "stop"
        last = steps_of(events)[-1:]
        emitted = [e for e in events if isinstance(e, Token) and last and e.step == last[0].index]
        if last and last[0].n_accepted == len(emitted) + 1:  # the accepted draft ended with it
            positions.add(len(emitted))
    assert positions == set(range(draft_max))  # every position of the draft


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 9, 17])
def test_n_predict_is_a_hard_cap(model, n):
    events, target, _ = run(model, model, draft_max=4, n=n)
    assert len(tokens_of(events)) == n
    assert events[-1].reason == "length"
    # never verifies more than it may emit: k + 1 <= tokens left
    assert sum(target.batches) - len(target.batches) <= n


def test_drafts_are_clipped_to_the_context(model):
    n_ctx = len(PROMPT) + 7
    events, target, draft = run(model, model, draft_max=5, n=-1, n_ctx=n_ctx)
    out = tokens_of(events)
    assert len(out) == n_ctx - len(PROMPT)
    assert events[-1].reason == "length"
    assert target.max_pos < n_ctx and draft.max_pos < n_ctx
    assert out == plain_decode(model, PROMPT, 100, Sampler(GREEDY, 1), n_ctx=n_ctx)


@pytest.mark.parametrize("n_keep", [0, 2, -1])
def test_context_shift_goes_on_past_the_context_as_target_only_does(model, n_keep):
    """At a full context, n_keep tokens stay and half the rest goes; the caches hold what is left
    and generation goes on, drafted tokens or not: the same tokens as target-only, and no cache
    position past the context."""
    n_ctx, spec = 24, {"context_shift": True, "n_keep": n_keep, "draft_max": 4}
    events, target, draft = run(model, model.perturbed(0.4, seed=7), n=60, n_ctx=n_ctx, **spec)
    alone, plain, _ = run(model, n=60, n_ctx=n_ctx, **spec)
    assert tokens_of(events) == tokens_of(alone) and len(tokens_of(events)) == 60
    assert events[-1].reason == "length" and events[-1].n_shifted == alone[-1].n_shifted > 0
    assert max(target.max_pos, draft.max_pos, plain.max_pos) < n_ctx
    assert sum(s.n_accepted for s in steps_of(events)) > 0
    kept = PROMPT if n_keep < 0 else PROMPT[:n_keep]
    assert target.cache[:len(kept)] == kept  # what n_keep keeps stays at the front


def test_a_smaller_draft_context_stops_drafting_not_generation(model):
    n_ctx_draft = len(PROMPT) + 9
    events, _, draft = run(model, model, draft_max=4, n=30, n_ctx_draft=n_ctx_draft)
    assert tokens_of(events) == plain_decode(model, PROMPT, 30, Sampler(GREEDY, 1))
    assert draft.max_pos < n_ctx_draft
    drafted = [s.n_drafted for s in steps_of(events)]
    assert drafted[0] == 4 and drafted[-1] == 0


def test_prompt_that_fills_the_context_is_refused():
    with pytest.raises(GenerationError, match="4 tokens but the context holds 4"):
        check_prompt(PROMPT, 4, -1)
    with pytest.raises(GenerationError, match="empty"):
        check_prompt([], 4, -1)


def test_draft_min_discards_short_drafts(model):
    draft = model.perturbed(0.5, seed=2)
    # p-min cuts drafts short; draft-min then drops the short ones entirely
    events, _, _ = run(model, draft, draft_max=6, draft_min=3, p_min=0.6, n=80)
    steps = steps_of(events)
    assert all(s.n_drafted == 0 or s.n_drafted >= 3 for s in steps)
    assert any(s.n_drafted >= 3 for s in steps)
    assert tokens_of(events) == plain_decode(model, PROMPT, 80, Sampler(GREEDY, 1))


def test_no_draft_when_room_is_below_draft_min(model):
    events, _, _ = run(model, model, draft_max=4, draft_min=4, n=3)
    assert all(s.n_drafted == 0 for s in steps_of(events))
    assert len(tokens_of(events)) == 3


def test_draft_p_min_stops_drafting_on_low_confidence(model):
    loose, _, _ = run(model, model, draft_max=6, p_min=0.0)
    strict, _, _ = run(model, model, draft_max=6, p_min=0.9)
    never, _, _ = run(model, model, draft_max=6, p_min=1.01)
    drafted = lambda ev: sum(s.n_drafted for s in steps_of(ev))  # noqa: E731
    assert drafted(never) == 0
    assert 0 < drafted(strict) < drafted(loose)
    assert tokens_of(loose) == tokens_of(strict) == tokens_of(never)


def test_top_probability_matches_llama_cpp_top10_rule():
    row = np.log(np.array([0.5, 0.2, 0.1] + [0.01] * 20, dtype=np.float64)).astype(np.float32)
    top10 = np.sort(np.exp(row.astype(np.float64)))[::-1][:10]
    assert top_probability(row, 0) == pytest.approx(0.5 / top10.sum(), rel=1e-6)


def test_the_prompts_progress_and_prefilled_come_first(model):
    events, _, _ = run(model, model, n=5)
    progress = list(itertools.takewhile(lambda e: isinstance(e, Prefilling), events))
    assert progress == [Prefilling(len(PROMPT), 0, 0), Prefilling(len(PROMPT), 0, len(PROMPT))]
    assert isinstance(events[2], Prefilled) and events[2].n_prompt == len(PROMPT)
    assert isinstance(events[-1], Done)


@pytest.mark.parametrize("n_cached, reports", [(0, [0, 4, 8, 11]), (3, [3, 7, 11]), (10, [10, 11])])
def test_the_prompts_progress_is_reported_after_each_batch(model, n_cached, reports):
    """llama-server's prompt_progress: before the first batch (-b 4 here) and after each, the
    last token (scored by the first step) counted with the last batch; a prompt the cache holds
    but its last token reports at once that it is done."""
    prompt = [*PROMPT, *PROMPT, *PROMPT][:11]
    cache = Cache(FakeBackend(model, n_batch=4))
    scheduler.run(cache.extend(prompt[:n_cached]))
    events = list(generate(cache, prompt, Sampler(GREEDY, 1), SpecSettings(n_predict=3)))
    progress = [e for e in events if isinstance(e, Prefilling)]
    assert [p.n_done for p in progress] == reports
    assert all(p.n_prompt == len(prompt) and p.n_cached == n_cached for p in progress)
    assert events.index(progress[-1]) < next(i for i, e in enumerate(events) if isinstance(e, Prefilled))


def test_a_prefix_kept_in_the_caches_is_not_processed_again(model):
    """What an earlier run left: the target holds the prompt's first tokens, the draft an
    older conversation that diverges after them. Output is unchanged; the fake backends
    fail on any decode that is not contiguous with what they hold."""
    target = FakeBackend(model)
    target_cache = Cache(target)
    scheduler.run(target_cache.extend(PROMPT[:3]))
    draft = FakeBackend(model.perturbed(0.4, seed=7), name="draft")
    draft_cache = Cache(draft)
    scheduler.run(draft_cache.extend([*PROMPT[:2], 9, 9, 9]))
    events = list(generate(target_cache, PROMPT, Sampler(GREEDY, 1), SpecSettings(n_predict=30, draft_max=4),
                           ModelDrafter(draft_cache)))
    prefilled = next(e for e in events if isinstance(e, Prefilled))
    assert prefilled == Prefilled(len(PROMPT), prefilled.seconds, n_cached=3)
    out = tokens_of(events)
    assert out == plain_decode(model, PROMPT, 30, Sampler(GREEDY, 1))
    assert draft.cache == list(draft_cache.tokens()) == (PROMPT + out)[: len(draft.cache)]
    assert target.cache == list(target_cache.tokens()) == (PROMPT + out)[:-1]


def test_the_last_prompt_token_is_always_scored_again(model):
    """A cache holding the whole prompt and more keeps all of it but the last token, whose
    logits the first step needs."""
    target = Cache(FakeBackend(model))
    scheduler.run(target.extend([*PROMPT, 9, 9]))
    events = list(generate(target, PROMPT, Sampler(GREEDY, 1), SpecSettings(n_predict=10)))
    assert events[0].n_cached == len(PROMPT) - 1
    assert tokens_of(events) == plain_decode(model, PROMPT, 10, Sampler(GREEDY, 1))


@pytest.mark.parametrize("draft_max", [1, 2, 4, 8])
@pytest.mark.parametrize("limit", [0, 1, 3, 8])
def test_a_recurrent_state_rolls_back_through_snapshots_or_checkpoints(model, limit, draft_max):
    """Backends that undo only the latest `limit` tokens of their latest decode, once (a
    recurrent state's snapshots, as llama.cpp's n_rs_seq) and fail on any other trim: the
    output is unchanged at every draft length. A rollback the snapshots cannot do comes back
    to a checkpoint; the draft model, which drafts one token per decode, always does."""
    target, draft = FakeBackend(model), FakeBackend(model.perturbed(0.4, seed=7), name="draft")
    target.rollback_limit = limit
    draft.rollback_limit = 0
    events = list(generate(Cache(target), PROMPT, Sampler(GREEDY, 1),
                           SpecSettings(n_predict=30, draft_max=draft_max), ModelDrafter(Cache(draft))))
    assert tokens_of(events) == plain_decode(model, PROMPT, 30, Sampler(GREEDY, 1))
    steps = steps_of(events)
    assert any(s.n_accepted < s.n_drafted for s in steps)  # rejected drafts were rolled back
    rejected_beyond_limit = any(s.n_drafted - s.n_accepted > limit for s in steps)
    assert (target.checkpoints["restored"] > 0) == rejected_beyond_limit
    if limit >= draft_max:  # the snapshots cover every draft: only the prompt's checkpoint
        assert target.checkpoints["saved"] == 1
    if draft_max > 1:
        assert draft.checkpoints["restored"] > 0


def test_a_recurrent_prefix_is_kept_where_exact_and_recomputed_past_it(model):
    """A second run whose prompt shares the first one's prompt and part of its output: a
    recurrent cache comes back to the prompt's checkpoint and decodes the rest, exactly."""
    backend = FakeBackend(model)
    backend.rollback_limit = 4
    target = Cache(backend)
    first = tokens_of(generate(target, PROMPT, Sampler(GREEDY, 1), SpecSettings(n_predict=12)))
    follow_up = PROMPT + first[:6] + [5, 6]
    events = list(generate(target, follow_up, Sampler(GREEDY, 1), SpecSettings(n_predict=12)))
    assert events[0].n_cached == len(PROMPT) - 1  # the checkpoint lies after the prompt's last-but-one token
    assert backend.checkpoints["restored"] == 1
    assert tokens_of(events) == plain_decode(model, follow_up, 12, Sampler(GREEDY, 1))


@pytest.mark.parametrize("draft_max", [2, 5, 8])
def test_a_draft_tree_keeps_greedy_output(model, draft_max):
    """Greedy: the longest path the target agrees with is kept, whichever branch it is on.
    The fake backends check every sequence's positions, so a wrong fork or fold fails."""
    draft = model.perturbed(0.5, seed=7)
    tree, target, draft_backend = run(model, draft, draft_max=draft_max, n=80, branches=4, p_split=0.02)
    out = tokens_of(tree)
    assert out == plain_decode(model, PROMPT, 80, Sampler(GREEDY, 1))
    steps = steps_of(tree)
    assert max(s.n_branches for s in steps) == min(4, draft_max)  # a fork per drafted token at most
    assert all(s.n_drafted <= draft_max for s in steps)
    assert target.cache == (PROMPT + out)[:-1] and not target.branches
    assert draft_backend.cache == (PROMPT + out)[: len(draft_backend.cache)] and not draft_backend.branches


def swapped_top2(model: ToyModel) -> ToyModel:
    """A draft whose best guess is always the target's second choice, and vice versa."""
    other = ToyModel.__new__(ToyModel)
    other.vocab, other.table = model.vocab, model.table.copy()
    rows = np.arange(len(model.table))
    first, second = np.argsort(-model.table, axis=1)[:, :2].T
    other.table[rows, first], other.table[rows, second] = model.table[rows, second], model.table[rows, first]
    return other


def test_a_fork_the_target_agrees_with_is_accepted(model):
    """The draft's runner-up is the target's pick: a chain never lands, while the fork
    at each step does (then the draft's guess after it is wrong again)."""
    draft = swapped_top2(model)
    chain, _, _ = run(model, draft, draft_max=4, n=40)
    tree, target, _ = run(model, draft, draft_max=4, n=40, branches=2, p_split=0.0)
    expected = plain_decode(model, PROMPT, 40, Sampler(GREEDY, 1))
    assert tokens_of(chain) == tokens_of(tree) == expected
    assert sum(s.n_accepted for s in steps_of(chain)) == 0
    steps = steps_of(tree)
    forked = [s for s in steps if s.n_drafted >= 2]  # near -n, room for one drafted token only
    assert len(forked) >= 18 and all((s.n_branches, s.branch, s.n_accepted) == (2, 1, 1) for s in forked)
    assert target.cache == (PROMPT + expected)[:-1]


def test_one_branch_per_sequence_the_backend_has(model):
    """-np sizes both caches: a drafter never forks into a sequence that does not exist."""
    events, _, _ = run(model, model.perturbed(0.5, seed=7), draft_max=8, n=40, branches=2, p_split=0.0)
    assert {s.n_branches for s in steps_of(events)} <= {1, 2}


def test_no_context_shift_when_n_predict_ends_the_run_as_the_context_fills(model):
    """The -n cap, not the context, is what ends it: the caches are not processed again for
    nothing."""
    n_ctx = 24
    events, target, _ = run(model, n=n_ctx - len(PROMPT), n_ctx=n_ctx, context_shift=True)
    assert len(tokens_of(events)) == n_ctx - len(PROMPT) and events[-1].n_shifted == 0
    assert target.cache == (PROMPT + tokens_of(events))[:-1]


@pytest.mark.parametrize("post", [False, True])
@pytest.mark.parametrize("sampling", [GREEDY, SamplerSettings(temp=0.9, top_k=8, top_p=0.9, min_p=0.0)])
def test_each_token_carries_the_targets_probabilities_drafted_or_not(model, sampling, post):
    """n_probs: every generated token, accepted drafted ones included, gets the probabilities of
    the target's row that chose it: the same as target-only decoding's, which is computed here
    from the model without the loop (softmax of the row, or the chain's distribution)."""
    reported = replace(sampling, n_probs=5, post_sampling_probs=post)
    events, _, _ = run(model, model.perturbed(0.3, seed=5), n=30, sampling=reported, draft_max=4)
    tokens = [e for e in events if isinstance(e, Token)]
    assert any(t.from_draft for t in tokens) and any(not t.from_draft for t in tokens)
    reference = Sampler(reported, 1)
    context = list(PROMPT)
    for token in tokens:
        row = model.logits(context).astype(np.float32)
        ids, probs = reference.distribution(row.copy(), context) if post else (np.arange(len(row)), softmax(row))
        order = np.argsort(-probs, kind="stable")[:5]
        expected = [(int(ids[i]), float(probs[i])) for i in order if probs[i] > 0]
        assert [i for i, _ in token.probs.top] == [i for i, _ in expected]
        assert [p for _, p in token.probs.top] == pytest.approx([p for _, p in expected], rel=1e-5)
        assert token.probs.prob == pytest.approx(float(probs[ids == token.id][0]), rel=1e-5)
        context.append(token.id)


def test_without_n_probs_no_token_carries_probabilities(model):
    events, _, _ = run(model, model.perturbed(0.3, seed=5), n=10)
    assert all(e.probs is None for e in events if isinstance(e, Token))


def test_a_logit_bias_is_applied_before_the_chain_drafted_or_not(model):
    """-inf bans a token, a positive bias favours one (twice named: both add): greedy output is
    target-only decoding's with the same biased sampler, with or without drafts; sampled output
    never has the banned token."""
    greedy_first = plain_decode(model, PROMPT, 1, Sampler(GREEDY, 1))[0]
    bias = ((greedy_first, float("-inf")), (7, 1.5), (7, 1.0))
    alone = plain_decode(model, PROMPT, 30, Sampler(replace(GREEDY, logit_bias=bias), 1))
    events, _, _ = run(model, model, n=30, sampling=replace(GREEDY, logit_bias=bias), draft_max=4)
    assert tokens_of(events) == alone and greedy_first not in alone
    assert alone != plain_decode(model, PROMPT, 30, Sampler(GREEDY, 1))
    for seed in range(3):
        events, _, _ = run(model, model, n=30, sampling=SamplerSettings(temp=1.0, logit_bias=bias), seed=seed)
        assert greedy_first not in tokens_of(events)
