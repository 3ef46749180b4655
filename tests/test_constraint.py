"""Generation under a grammar, against a fake grammar and the fake backend: the constrained
distribution is what the target samples from and drafters draft from, drafts are cut where the
grammar refuses them, forced text is found, and output is exact (milliseconds per test)."""

from __future__ import annotations

import numpy as np
import pytest

from speculative.decoding.cache import Cache
from speculative.decoding.constraint import (Constraint, GrammarDeadEnd, VocabIndex, admissible, best,
                                             check_draft, forced, forced_text)
from speculative.decoding.drafter import Draft, Drafter
from speculative.decoding.events import Done, Step, Token
from tests.fakes import generate
from speculative.decoding.sampling import Sampler
from speculative.decoding.settings import SamplerSettings, SpecSettings
from speculative.drafters import ForcedDrafter, ModelDrafter
from tests.fakes import EOG, FakeBackend, ToyModel

# The toy vocabulary's texts (token 0 ends generation) and a language over them: JSON-like objects.
PIECES = [b"", b"{", b"}", b'"', b"a", b"b", b":", b" ", b",", b'{"', b'":', b"ab", b"ba", b'a"', b'"a',
          b"1", b"2", b"12", b"x", b"y", b"xy", b'"}', b"  ", b'b"']
KEYS, VALUES = (b"a", b"b", b"ab"), (b"1", b"2", b"12", b'"x"', b'"y"', b'"xy"')
LANGUAGE = frozenset(b'{"' + k + b'": ' + v + b"}" for k in KEYS for v in VALUES)
PROMPT = [3, 5, 7, 11]


class FakeGrammar:
    """A grammar state that admits exactly the prefixes of a finite language."""

    def __init__(self, language=LANGUAGE, pieces=PIECES, text=b"", index=None):
        self.language, self.pieces, self.text = language, pieces, text
        self.index = index or VocabIndex(pieces, np.array([EOG]))
        self.timer = [0.0]

    def copy(self):
        return FakeGrammar(self.language, self.pieces, self.text, self.index)

    def _ok(self, token: int) -> bool:
        if token == EOG:
            return self.text in self.language
        piece = self.pieces[token] if 0 <= token < len(self.pieces) else b""
        return bool(piece) and any(s.startswith(self.text + piece) for s in self.language)

    def admitted(self, ids):
        return np.array([self._ok(int(t)) for t in ids], dtype=bool)

    def accept(self, token: int) -> None:
        assert self._ok(token), (self.text, token)  # llama.cpp aborts on a token it does not admit
        if token != EOG:
            self.text += self.pieces[token]

    def tokenize(self, text: bytes) -> list[int]:
        """Longest match first, as a toy tokenizer."""
        out = []
        while text:
            token = max((t for t, p in enumerate(self.pieces) if p and text.startswith(p)),
                        key=lambda t: len(self.pieces[t]))
            out.append(token)
            text = text[len(self.pieces[token]):]
        return out


class LazyFakeGrammar(FakeGrammar):
    """A lazy grammar, as llama.cpp's with a trigger: every token is admitted until the generated
    text holds TRIGGER; from there on, the language, from the trigger's start."""
    TRIGGER = b"{"

    def __init__(self, generated=b"", index=None):
        super().__init__(index=index)
        self.generated = generated
        at = generated.find(self.TRIGGER)
        self.text = generated[at:] if at >= 0 else None  # None: waiting for the trigger

    def copy(self):
        return LazyFakeGrammar(self.generated, self.index)

    def _ok(self, token: int) -> bool:
        if self.text is None:  # waiting: llama.cpp's lazy grammar admits every token (the toy's "{" ones
            return token == EOG or 0 <= token < len(self.pieces) and bool(self.pieces[token])  # open validly)
        return super()._ok(token)

    def accept(self, token: int) -> None:
        assert self._ok(token), (self.generated, token)
        if token != EOG:
            self.__init__(self.generated + self.pieces[token], self.index)


class MaskGrammar:
    """A state admitting a fixed set of ids of a large vocabulary (for `best`'s rounds)."""

    def __init__(self, allowed: np.ndarray, n_vocab: int):
        self.allowed = np.zeros(n_vocab, dtype=bool)
        self.allowed[allowed] = True
        self.calls: list[int] = []
        self.index = self

    def could_follow(self, state):
        return np.arange(len(self.allowed))

    def admitted(self, ids):
        self.calls.append(len(ids))
        return self.allowed[ids]


@pytest.mark.parametrize("n_allowed", [1, 3, 50, 900, 30000])
@pytest.mark.parametrize("k", [1, 40])
def test_the_best_admissible_tokens_are_exactly_the_best_of_the_masked_scores(n_allowed, k):
    rng = np.random.default_rng(n_allowed + k)
    n = 60000
    scores = rng.normal(size=n).astype(np.float32)
    allowed = rng.choice(n, n_allowed, replace=False)
    state = MaskGrammar(allowed, n)
    masked = np.full(n, -np.inf)
    masked[allowed] = scores[allowed]
    expected = np.argsort(-masked, kind="stable")[: min(k, n_allowed)]
    assert list(best(state, scores, k)) == list(expected)
    if n_allowed >= 30000:  # found among the best 64: the whole vocabulary never asked
        assert max(state.calls) < n


def test_a_grammar_that_admits_nothing_is_a_dead_end():
    with pytest.raises(GrammarDeadEnd):
        best(MaskGrammar(np.array([], dtype=int), 1000), np.zeros(1000, dtype=np.float32), 1)


SEQUENCES = ["edskypmxt", "kt", "pkt", "mt", "ypt", "tk", "ekt"]


@pytest.mark.parametrize("sequence", SEQUENCES)
@pytest.mark.parametrize("temp", [0.0, 0.9])
@pytest.mark.parametrize("text", [b"", b'{"', b'{"a', b'{"ab": ', b'{"b": "x'])
def test_the_sampler_under_a_grammar_is_the_chain_over_the_masked_logits(sequence, temp, text):
    """Whatever the order of the chain, the constrained distribution equals the unconstrained
    chain run over logits with every token the grammar refuses at -inf."""
    settings = SamplerSettings(temp=temp, top_k=3, top_p=0.8, min_p=0.1, typical_p=0.9, repeat_penalty=1.3,
                               sequence=sequence)
    grammar = FakeGrammar(text=text)
    rng = np.random.default_rng(len(text) + len(sequence))
    for _ in range(20):
        logits = rng.normal(scale=3.0, size=len(PIECES)).astype(np.float32)
        ok = grammar.admitted(np.arange(len(PIECES)))
        masked = np.where(ok, logits, -np.inf).astype(np.float32)
        ids, probs = Sampler(settings, 0).distribution(logits.copy(), [4, 5, 4], grammar)
        want_ids, want_probs = Sampler(settings, 0).distribution(masked, [4, 5, 4])
        got = dict(zip(ids.tolist(), probs.tolist()))
        want = {t: p for t, p in zip(want_ids.tolist(), want_probs.tolist()) if p > 0}
        assert got.keys() == want.keys()
        assert all(abs(got[t] - want[t]) < 1e-6 for t in want)


def test_forced_text_and_its_tokens():
    """The language forces `{"` first; `{` and `{"` both spell its start, so the text is drafted
    as the tokenizer spells it (kind b), less its last token, which the model may spell together
    with what follows: here nothing is left. After `{"a` a `"` or a `b` may follow: nothing
    forced. After `{"ab` the text `": ` is forced, spelt by `"` or `":`: kind b again, `":` and
    not the ` ` after it (unless a limit cuts the text before it). After a number of two digits
    only `}` spells what is forced: certain (kind a)."""
    assert forced_text(FakeGrammar()) == b'{"'
    assert forced(FakeGrammar(), 8).certain == [] and forced(FakeGrammar(), 8).likely == []
    assert forced_text(FakeGrammar(text=b'{"a')) == b""
    after_key = forced(FakeGrammar(text=b'{"ab'), 8)
    assert after_key.certain == [] and after_key.likely == [10]
    assert forced(FakeGrammar(text=b'{"ab'), 1).likely == [10]
    assert forced(FakeGrammar(text=b'{"ab": 1'), 8).certain == []  # 1 or 12: not forced
    assert forced(FakeGrammar(text=b'{"ab": 12'), 8).certain == [2]


def test_drafts_are_cut_where_the_grammar_refuses_them():
    state = FakeGrammar(text=b'{"')
    chain = check_draft(Draft([4, 5, 2, 6], "ngram"), state)
    assert chain.tokens == [4, 5]  # `b` after `a` is in the language, `}` is not
    assert state.text == b'{"'  # the real state did not move
    sampled = check_draft(Draft([4, 2, 6], "draft", q=((np.array([4, 2]), np.array([0.5, 0.5])),) * 3), state)
    assert sampled.tokens == [4, 2]  # a sampled refusal stays, as the last token: the rule rejects it
    tree = check_draft(Draft([4, 5, 2, 10], "draft", parents=(-1, -1, 0, 1)), state)
    assert tree.tokens == [4, 5, 10] and tree.parents == (-1, -1, 1)


class Fixed(Drafter):
    """Proposes what a script says after each context length (n-gram-like: deterministic)."""
    name = "ngram-simple"
    free = True

    def __init__(self, proposals):
        self.proposals = proposals

    def propose(self, context, k):
        return Draft(list(self.proposals(len(context)))[:k], self.name)


def _run(model, drafter=None, sampling=SamplerSettings(temp=0.0), seed=1, n=30, grammar=None, **spec):
    constraint = Constraint(grammar or FakeGrammar())
    if drafter is not None:
        drafter.constraint = constraint
    events = list(generate(Cache(FakeBackend(model)), PROMPT, Sampler(sampling, seed), SpecSettings(n_predict=n, **spec),
                           drafter, constraint))
    tokens = [e.id for e in events if isinstance(e, Token)]
    return tokens, events


@pytest.fixture
def model():
    return ToyModel(seed=0, eog_bias=0.0)


def _drafters(model):
    draft = FakeBackend(model.perturbed(0.4, seed=2), name="draft")
    rng = np.random.default_rng(0)
    return {"none": None, "draft": ModelDrafter(Cache(draft)), "forced": ForcedDrafter(),
            "random": Fixed(lambda n: rng.integers(1, len(PIECES), size=6).tolist())}


@pytest.mark.parametrize("draft_max", [1, 3, 8])
def test_greedy_output_under_a_grammar_is_target_only_for_every_drafter(model, draft_max):
    outputs = {name: _run(model, d, draft_max=draft_max)[0] for name, d in _drafters(model).items()}
    text = b"".join(PIECES[t] for t in outputs["none"])
    assert text in LANGUAGE  # it ended with the language's end of generation, complete
    assert all(out == outputs["none"] for out in outputs.values()), outputs


@pytest.mark.parametrize("seed", [4, 7, 9, 10])  # toy models whose greedy text reaches the trigger
def test_greedy_output_under_a_lazy_grammar_is_target_only_for_every_drafter(seed):
    model = ToyModel(seed=seed, eog_bias=0.0)
    outputs = {name: _run(model, d, draft_max=3, grammar=LazyFakeGrammar())[0] for name, d in _drafters(model).items()}
    assert all(out == outputs["none"] for out in outputs.values()), outputs
    state = LazyFakeGrammar(b"".join(PIECES[t] for t in outputs["none"]))
    assert state.text in LANGUAGE  # free text, the trigger, then the grammar's language to its end


def test_certain_tokens_are_emitted_without_sampling_their_rows(model):
    tokens, events = _run(model, ForcedDrafter(), draft_max=8)
    steps = [e for e in events if isinstance(e, Step)]
    assert sum(s.n_certain for s in steps) > 0
    assert all(s.n_accepted >= s.n_certain for s in steps)
    assert tokens == _run(model)[0]


def test_a_run_cut_by_its_length_says_the_grammar_is_incomplete(model):
    _, events = _run(model, n=3)
    assert events[-1] == Done("length", events[-1].t_decode, True)
    _, events = _run(model, n=40)
    assert events[-1].reason == "stop" and not events[-1].incomplete


def test_a_state_that_admits_no_token_ends_the_run_with_an_error(model):
    grammar = FakeGrammar(language=frozenset({b"{q}"}))  # no token spells q
    with pytest.raises(GrammarDeadEnd):
        _run(model, grammar=grammar)


GRAMMARS = {"eager": lambda generated=b"": FakeGrammar(text=generated), "lazy": LazyFakeGrammar}


def _marginals(model, sampling, n_tokens, grammar="eager"):
    """The exact distribution of the first generated tokens, target alone, under the grammar."""
    sampler = Sampler(sampling, 0)
    out, paths = [], {(tuple(PROMPT), b""): 1.0}
    for _ in range(n_tokens):
        row, nxt = np.zeros(model.vocab), {}
        for (path, text), weight in paths.items():
            ids, probs = sampler.distribution(model.logits(list(path)), (), GRAMMARS[grammar](text))
            for t, p in zip(ids.tolist(), probs.tolist()):
                row[t] += weight * p
                key = (path + (t,), text + PIECES[t])
                nxt[key] = nxt.get(key, 0.0) + weight * p
        out.append(row)
        paths = nxt
    return out


@pytest.mark.parametrize("accept, grammar", [("rejection", "eager"), ("match", "eager"), ("rejection", "lazy")])
def test_sampled_output_under_a_grammar_follows_the_constrained_distribution(model, accept, grammar):
    """3,000 seeded runs per rule: the first three tokens follow target-only probabilities
    under the grammar (the L1 bound of tests/test_loop.py), with a draft model sampling from its
    own masked distribution (rejection) or drafting greedily (match), and deterministic drafts;
    also under a lazy grammar (a tool call's, free text until its trigger)."""
    sampling = SamplerSettings(temp=1.0, top_k=5, top_p=1.0, min_p=0.0)
    runs, n_tokens = 3000, 3
    if grammar == "lazy":  # a toy model that writes the trigger within its first tokens
        model = ToyModel(seed=12, eog_bias=0.0)
    draft_model = model.perturbed(0.4, seed=2)
    counts = np.zeros((n_tokens, model.vocab))
    for seed in range(runs):
        draft = ModelDrafter(Cache(FakeBackend(draft_model, name="draft")),
                             sampler=Sampler(SamplerSettings(temp=1.3, top_k=5, top_p=1.0, min_p=0.0), seed + 99)
                             if accept == "rejection" else None)
        tokens, _ = _run(model, draft, sampling, seed=seed, n=n_tokens, draft_max=3, accept=accept,
                         grammar=GRAMMARS[grammar]())
        for i, t in enumerate(tokens):
            counts[i, t] += 1
    lam = np.sqrt(2 * (model.vocab * np.log(2) + np.log(1e6)) / runs)
    for i, expected in enumerate(_marginals(model, sampling, n_tokens, grammar)):
        assert np.abs(counts[i] / runs - expected).sum() < lam, f"token {i}"


def test_every_admissible_token_is_found_through_its_first_byte():
    for text in (b"", b'{"', b'{"a', b'{"ab": "', b'{"b": 12'):
        state = FakeGrammar(text=text)
        brute = np.flatnonzero(state.admitted(np.arange(len(PIECES))))
        assert list(admissible(state)) == list(brute)

