"""--cache-ram: the cache on its own (entries, the choice of one, least-recently-used eviction),
then real models: two conversations taking turns on one Engine restore each other's caches
and generate exactly what they generate without it, attention, hybrid and recurrent targets
alike. The server's side (cache_n over HTTP, eviction under a small budget, the flag) is in
test_serve.py."""

from __future__ import annotations

import json
from typing import Callable, Sequence

import pytest

from speculative.decoding.cache import Cache, _common_prefix
from speculative.decoding.settings import ModelSpec, SamplerSettings, SpecSettings
from speculative.decoding.stats import Stats
from speculative.engine.engine import Engine
from speculative.engine.persist import NEXTN_ROLE
from speculative.engine.ram_cache import MIN_TOKENS, RamCache, State
from speculative.engine.stream import complete
from speculative.errors import GenerationError
from speculative.llamacpp.doctor import batch_invariance
from speculative.decoding.scheduler import run
from tests.conftest import SMOL
from tests.fakes import FakeBackend, ToyModel
from tests.tiny_drafters import write_drafter
from tests.tiny_model import write_model

MIB = 1 << 20


def lcp(state: State, tokens: Sequence[int], limit: int | None) -> int:
    """An attention cache's rule: the shared prefix."""
    held = list(state.tokens)
    return _common_prefix(held, tokens, min(len(held), len(tokens), len(tokens) if limit is None else limit))


def entry(tokens: Sequence[int], nbytes: int, draft: bool = False) -> dict[str, State]:
    parts = {"target": State(tuple(tokens), bytes(nbytes))}
    if draft:
        parts["draft"] = State(tuple(tokens[:-1]), bytes(nbytes // 2))
    return parts


def held(cache: RamCache) -> list[tuple[int, ...]]:
    return [e.tokens for e in cache.entries()]


def test_the_entry_sharing_the_longest_prefix_is_chosen():
    cache = RamCache(8, lcp)
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 9, 9, 9]
    assert cache.add(entry(a, 100, draft=True)) and cache.add(entry(b, 100))
    assert cache.best([1, 2, 3, 4, 7]) == (cache.entries()[0], 4)
    assert cache.best([1, 2, 9, 9, 9, 9]) == (cache.entries()[1], 5)
    assert cache.best([1, 2, 9, 9, 9, 9], limit=3) == (cache.entries()[1], 3)
    assert cache.best([8, 1, 2]) == (None, 0)
    found, _ = cache.best([1, 2])  # a tie: the most recently used
    assert found.tokens == tuple(b)
    assert cache.entries()[0].nbytes == 150 and cache.nbytes == 250


def test_least_recently_used_entries_go_when_the_budget_is_full():
    cache = RamCache(1, lcp)
    third = MIB // 3
    for first in (1, 2, 3):
        assert cache.add(entry([first, 0, 0], third))
    assert held(cache) == [(1, 0, 0), (2, 0, 0), (3, 0, 0)]
    cache.use(cache.entries()[0])  # restored: now the most recently used
    assert cache.add(entry([4, 0, 0], third))
    assert held(cache) == [(3, 0, 0), (1, 0, 0), (4, 0, 0)] and cache.nbytes <= MIB
    assert cache.add(entry([5, 0, 0], MIB - 10))  # room for it alone
    assert held(cache) == [(5, 0, 0)]


def test_a_state_larger_than_the_budget_is_not_kept_and_disturbs_nothing():
    cache = RamCache(1, lcp)
    cache.add(entry([1, 2], 1000))
    assert not cache.add(entry([3, 4], MIB + 1))
    assert held(cache) == [(1, 2)]
    unlimited = RamCache(-1, lcp)
    assert unlimited.add(entry([3, 4], 3 * MIB)) and unlimited.add(entry([5, 6], 3 * MIB)) and len(unlimited) == 2


def test_an_entry_holding_the_state_already_is_not_copied_again_and_a_longer_one_supersedes():
    cache = RamCache(8, lcp)
    cache.add(entry([1, 2, 3, 4], 100))
    cache.add(entry([7, 7], 100))
    assert not cache.add(entry([1, 2, 3], 100))  # restoring [1, 2, 3, 4] gives all of it back
    assert held(cache) == [(7, 7), (1, 2, 3, 4)]  # and that entry was used
    assert cache.add(entry([1, 2, 3, 4, 5], 100))  # the conversation went on: the old one is in it
    assert held(cache) == [(7, 7), (1, 2, 3, 4, 5)]


def test_a_recurrent_rule_decides_what_an_entry_gives_back():
    """A recurrent state keeps all of an entry or its checkpoint: a state that only a cut
    entry would hold is kept on its own."""
    def whole_or_checkpoint(state: State, tokens: Sequence[int], limit: int | None) -> int:
        n = lcp(state, tokens, limit)
        if n == len(state.tokens):
            return n
        return state.checkpoint[0] if state.checkpoint and state.checkpoint[0] <= n else 0

    cache = RamCache(8, whole_or_checkpoint)
    cache.add({"target": State((1, 2, 3, 4), b"x" * 10, (2, b"c"))})
    assert cache.best([1, 2, 3, 4, 5]) == (cache.entries()[0], 4)
    assert cache.best([1, 2, 3, 9])[1] == 2  # its checkpoint
    assert cache.best([1, 9])[1] == 0
    assert cache.add({"target": State((1, 2, 3), b"x")})  # no entry holds this state
    assert len(cache) == 2 and cache.entries()[0].nbytes == 11


@pytest.mark.parametrize("rollback_limit", [None, 0, 2])
def test_what_a_cache_would_keep_is_what_it_keeps(rollback_limit):
    """Cache.keepable (the caches as they are) and keepable_after_restore (an entry, restored)
    predict keep_prefix, for an attention cache and a recurrent state (checkpoint or none)."""
    held = [5, 6, 7, 8, 9, 10, 11, 12]
    prompts = [held + [1, 2], held[:6] + [1], held[:3] + [1, 2, 3], [1, 2], held[:7], held]
    for checkpoint_at in (None, 0, 3, 6):
        for prompt in prompts:
            for limit in (None, len(prompt) - 1):
                source = Cache(FakeBackend(ToyModel()))
                source.model.rollback_limit = rollback_limit
                run(source.extend(held[:checkpoint_at] if checkpoint_at is not None else held))
                if checkpoint_at is not None:
                    source.checkpoint()
                    run(source.extend(held[checkpoint_at:]))
                case = (checkpoint_at, prompt, limit)
                predicted = source.keepable(prompt, limit)
                assert source.keep_prefix(prompt, limit) == predicted, case

                restored = Cache(FakeBackend(ToyModel()))
                restored.model.rollback_limit = rollback_limit
                checkpoint = (checkpoint_at, json.dumps(held[:checkpoint_at]).encode()) if checkpoint_at else None
                predicted = restored.keepable_after_restore(held, prompt, limit, checkpoint)
                assert restored.restore(json.dumps(held).encode(), held, checkpoint)
                assert restored.keep_prefix(prompt, limit) == predicted, case
                if rollback_limit is None:
                    assert predicted == _common_prefix(held, prompt, min(len(held), len(prompt), limit or 99))
                elif prompt[:len(held)] != held:  # a recurrent state: all of it, the checkpoint or nothing
                    assert predicted in (0, checkpoint_at), case


@pytest.mark.parametrize("mib", [0, -2])
def test_a_budget_of_nothing_is_no_cache(mib):
    with pytest.raises(ValueError):
        RamCache(mib, lcp)


# -- real models ---------------------------------------------------------------

GREEDY = SamplerSettings(temp=0.0)
SYSTEM = "You are a helpful assistant. Answer in one or two sentences."
QUESTIONS = {"A": ["What is a prime number?", "Give an example of one.", "Is 91 one of them?"],
             "B": ["Who wrote Hamlet?", "When was he born?", "Name another play of his."]}


def take_turns(engine: Engine, spec: SpecSettings) -> list[tuple[list[int], int, int, int]]:
    """Conversations A and B alternate, three turns each: per turn its answer's tokens, cache_n,
    the tokens it shares with its conversation's previous turn (prompt and answer), and that
    turn's prompt length."""
    histories: dict[str, list] = {"A": [], "B": []}
    previous: dict[str, list[int]] = {"A": [], "B": []}
    asked: dict[str, int] = {"A": 0, "B": 0}
    turns = []
    for t in range(3):
        for name in "AB":
            histories[name].append({"role": "user", "content": QUESTIONS[name][t]})
            prompt = engine.chat_tokens([{"role": "system", "content": SYSTEM}, *histories[name]])
            final = complete(engine, prompt, GREEDY, spec, seed=1)
            before = previous[name]
            shared = _common_prefix(before, prompt, min(len(before), len(prompt)))
            turns.append((final.tokens, final.stats.n_cached, shared, asked[name]))
            histories[name].append({"role": "assistant", "content": final.text})
            previous[name], asked[name] = [*prompt, *final.tokens], len(prompt)
    return turns


@pytest.mark.real
def test_alternating_conversations_restore_their_caches_and_generate_the_same(model_path, batch_invariant):
    smol = model_path(SMOL)
    specs = ModelSpec(smol, "target", n_ctx=2048, n_threads=1), ModelSpec(smol, "draft", n_ctx=2048, n_threads=1)
    spec = SpecSettings(types=("draft",), draft_max=4, n_predict=24)
    with Engine(*specs, cache_ram_mib=64) as engine:
        cached = take_turns(engine, spec)
        assert len(engine.persist.ram_cache) == 2  # each conversation's latest turn, the older ones superseded
        assert {tuple(e.parts) for e in engine.persist.ram_cache.entries()} == {("target", "draft")}
    with Engine(*specs) as engine:
        plain = take_turns(engine, spec)
    assert [t[0] for t in cached] == [t[0] for t in plain]
    template = plain[1][1]  # B's first turn keeps what it shares with A's: the system prompt
    assert template > 0 and all(t[1] == template for t in plain[1:])
    for _, n_cached, shared, before in cached[2:]:  # every later turn: the conversation so far
        # (the previous answer's last token is in the cache or not, and its end-of-turn too)
        assert n_cached >= max(shared - 1, before) and n_cached > template + MIN_TOKENS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    return lambda arch: write_model(arch, folder / f"{arch}.gguf")


def token_turns(engine: Engine, spec: SpecSettings, order: str,
                stats: Callable[[Stats], object] = lambda s: s.n_cached) -> dict[tuple[str, int], tuple]:
    """Conversations in `order` ("ABABAB": taking turns, "AAABBB": one after the other), each turn's
    prompt its previous turn's prompt and answer as tokens and the next question: per turn its
    answer and `stats` of it (cache_n)."""
    prompts = {name: [] for name in "AB"}
    turns = {}
    for name in order:
        t = sum(key[0] == name for key in turns)
        prompts[name] += engine.target.tokenize((SYSTEM if t == 0 else "") + " " + QUESTIONS[name][t],
                                                add_special=t == 0)
        final = complete(engine, prompts[name], GREEDY, spec, seed=1)
        turns[name, t] = final.tokens, stats(final.stats)
        prompts[name] += final.tokens
    return turns


@pytest.mark.real
@pytest.mark.parametrize("arch", ["lfm2", "mamba"])
def test_recurrent_targets_restore_their_whole_state(tiny, arch, batch_invariant):
    """A hybrid (LFM2) and a recurrent model (Mamba), as the target and as the draft model:
    taking turns with --cache-ram, each conversation keeps what it keeps when nothing comes
    between its turns (a recurrent state cannot be cut, so all of it), and answers the same."""
    path = tiny(arch)
    specs = ModelSpec(path, "target", n_ctx=1024, n_threads=1), ModelSpec(path, "draft", n_ctx=1024, n_threads=1)
    spec = SpecSettings(types=("draft",), draft_max=4, n_predict=24, ignore_eos=True)
    with Engine(*specs, cache_ram_mib=64) as engine:
        cached = token_turns(engine, spec, "ABABAB")
        assert all(e.parts["target"].checkpoint is not None for e in engine.persist.ram_cache.entries())
    with Engine(*specs) as engine:
        alone = token_turns(engine, spec, "AAABBB")
        plain = token_turns(engine, spec, "ABABAB")
    assert [out for out, _ in cached.values()] == [out for out, _ in plain.values()]
    assert cached == plain | {turn: (out, n) for turn, (out, n) in alone.items() if turn[1] > 0}
    assert all(alone[name, t][1] > plain[name, t][1] + MIN_TOKENS for name in "AB" for t in (1, 2))


@pytest.mark.real
@pytest.mark.parametrize("kind", ["draft-mtp", "draft-eagle3", "draft-dspark"])
def test_a_drafting_head_gets_the_targets_rows_back(tmp_path, batch_invariant, kind):
    """An MTP head, an EAGLE-3 or DSpark drafter draft from the target's hidden rows (its NextN
    rows, or its layer inputs): they are saved and restored with its state, so a restored
    conversation drafts as it does when nothing came between its turns. (Not the Gemma-4
    assistant: its tiny gemma4 target's cache, with sliding-window layers, is not restored by
    --cache-ram even alone.)"""
    if kind == "draft-mtp":
        path = write_model("qwen35", tmp_path / "qwen35-mtp.gguf", mtp=True)
        target = ModelSpec(path, "target", n_ctx=1024, n_threads=1, n_rs_seq=4, mtp=True)
    else:
        drafter, path = write_drafter(kind[6:], tmp_path / "drafter.gguf")
        target = ModelSpec(path, "target", n_ctx=1024, n_threads=1, feature_drafter=drafter)
    spec = SpecSettings(types=(kind,), draft_max=4, n_predict=24, ignore_eos=True)
    drafted = lambda stats: (stats.n_cached, stats.n_drafted, stats.n_accept)  # noqa: E731
    with Engine(target, cache_ram_mib=64) as engine:
        differences = [c.max_abs_diff for c in batch_invariance(engine.caches["target"], depths=(16,))]
        if max(differences) > 0:  # qwen35's chunked delta-net, on some CPUs (tests/test_recurrent.py)
            pytest.skip(f"qwen35 scores a batch differently from token by token here (max |logit "
                        f"difference| {max(differences):.3g}): greedy identity is not expected")
        engine.caches["target"].forget()
        cached = token_turns(engine, spec, "ABABAB", drafted)
        assert all(NEXTN_ROLE in e.parts for e in engine.persist.ram_cache.entries())
    with Engine(target) as engine:
        alone = token_turns(engine, spec, "AAABBB", drafted)
    assert cached.keys() == alone.keys()
    for turn in cached:
        if turn[1] > 0:  # the first turns follow another conversation's: only the answers are the same
            assert cached[turn] == alone[turn], turn
        assert cached[turn][0] == alone[turn][0]
    assert all(alone[name, t][1][1] > 0 for name in "AB" for t in (1, 2))  # it drafted


@pytest.mark.real
def test_a_state_that_cannot_be_copied_fails_no_request(tiny, caplog):
    """llama.cpp refusing to copy a state (or memory running out) costs the cache, not the answer."""
    spec = SpecSettings(types=("none",), n_predict=8, ignore_eos=True)
    target = ModelSpec(tiny("llama"), "target", n_ctx=512, n_threads=1)
    prompts = [list(range(10, 60)), list(range(70, 120))]

    def refuse(partial: bool = False) -> bytes:
        raise GenerationError("target: llama.cpp could not copy the KV cache")

    with Engine(target, cache_ram_mib=64) as engine:
        engine.target.save_state = refuse
        answers = [complete(engine, prompt, GREEDY, spec, seed=1).tokens for prompt in prompts]
        assert len(engine.persist.ram_cache) == 0
    assert "cache-ram: could not save the caches: target: llama.cpp could not copy the KV cache" in caplog.text
    with Engine(target) as engine:
        assert answers == [complete(engine, prompt, GREEDY, spec, seed=1).tokens for prompt in prompts]


@pytest.mark.real
def test_forget_saves_the_conversation_and_the_next_run_processes_its_whole_prompt(tiny):
    """llama-server's cache_prompt: false. The run after forget() keeps nothing of its prompt,
    not even what a saved conversation would give back, and answers as a fresh engine does;
    the conversation the caches held before is saved, and a later run that continues it
    restores it."""
    spec = SpecSettings(types=("none",), n_predict=8, ignore_eos=True)
    target = ModelSpec(tiny("llama"), "target", n_ctx=512, n_threads=1)
    x, a = list(range(10, 60)), list(range(70, 120))
    with Engine(target, cache_ram_mib=64) as engine:
        complete(engine, x, GREEDY, spec, seed=1)
        first_a = complete(engine, a, GREEDY, spec, seed=1)
        assert [e.tokens[:len(x)] for e in engine.persist.ram_cache.entries()] == [tuple(x)]  # x's, cut by a
        engine.forget()
        assert len(engine.caches["target"]) == 0
        whole = complete(engine, [*x, 5, 6], GREEDY, spec, seed=1)  # x's entry would give back 50
        assert whole.stats.n_cached == 0
        later = complete(engine, [*a, *first_a.tokens, 7, 8], GREEDY, spec, seed=1)
        assert later.stats.n_cached >= len(a) + len(first_a.tokens) - 1  # a's conversation, restored
    with Engine(target) as fresh:
        assert complete(fresh, [*x, 5, 6], GREEDY, spec, seed=1).tokens == whole.tokens
