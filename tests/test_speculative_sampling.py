"""Speculative sampling end to end on a real model: the output follows the target.

SmolLM2 135M drafts for itself at another temperature (so q != p and drafts are
really rejected and resampled). The first generated token of 1,000 seeded runs,
which goes through the draft's sampling, acceptance and resampling from the
residual, is compared with its exact target-only probabilities, computed from the
target's own logits. Each token's frequency (tokens under 2% together) must lie
within 3.9 standard errors of its probability: a false-alarm rate of at most 1e-4
per token, 6e-4 for the few checked, and a detection threshold of about 0.05 for a
shifted probability of 0.2-0.3. About 70 s on 2 CPU cores. Later tokens, bonus
tokens included, are checked against exact marginals with a fake model in
tests/test_loop.py. The same check holds the drafters of the target's hidden states
(EAGLE-3, DFlash, DSpark, chained MTP layers, a Gemma-4 assistant) to it on tiny models,
a few seconds each.
"""

from __future__ import annotations

import numpy as np
import pytest

from speculative.decoding.cache import Cache
from speculative.decoding.constraint import Constraint
from speculative.decoding.events import Step, Token
from tests.fakes import generate
from speculative.decoding.sampling import Sampler
from speculative.decoding.settings import ModelSpec
from speculative.decoding.settings import SamplerSettings, SpecSettings
from speculative.drafters import ForcedDrafter, ModelDrafter
from speculative.llamacpp.model import LlamaModel
from tests.conftest import SMOL

pytestmark = pytest.mark.real

RUNS = 1000
Z = 3.9
TARGET = SamplerSettings(temp=1.0, top_k=5, top_p=1.0, min_p=0.0)
DRAFT = SamplerSettings(temp=1.6, top_k=8, top_p=1.0, min_p=0.0)


def exact_first_token(model: LlamaModel, prompt: list[int]) -> dict[int, float]:
    """Target-only probabilities of the first generated token."""
    model.trim(0)
    (row,) = model.decode(prompt, 0, "last")
    ids, probs = Sampler(TARGET, 0).distribution(row.copy())
    model.trim(0)
    return dict(zip(ids.tolist(), probs.tolist()))


def first_tokens(target: Cache, prompt: list[int], spec: SpecSettings, drafter_of, forget,
                 support: dict[int, float], grammar_of=None) -> tuple[dict[int, int], int, int]:
    """The first generated token of RUNS seeded runs (`forget()` empties the drafter's cache
    before each, `drafter_of(seed)` makes its drafter, `grammar_of()` a grammar state to run
    under): how often each token came, and how many drafted tokens the first steps kept and
    drafted."""
    counts = dict.fromkeys(support, 0)
    kept = drafted = 0
    for seed in range(RUNS):
        target.forget()
        forget()
        drafter = drafter_of(seed)
        constraint = Constraint(grammar_of()) if grammar_of else None
        drafter.constraint = constraint
        for event in generate(target, prompt, Sampler(TARGET, seed), spec, drafter, constraint):
            if isinstance(event, Step):  # the first step drafts one token
                kept, drafted = kept + event.n_accepted, drafted + event.n_drafted
            elif isinstance(event, Token):  # the first token is all this test needs
                assert event.id in counts, f"{event.id} is outside the target's support"
                counts[event.id] += 1
                break
    return counts, kept, drafted


def assert_follows(expected: dict[int, float], counts: dict[int, int]) -> None:
    """Each token likely enough for the normal approximation, and the rest as one, within Z
    standard errors of its probability."""
    cells = [([t], p) for t, p in expected.items() if p >= 0.02]
    rest = [t for t, p in expected.items() if p < 0.02]
    cells.append((rest, sum(expected[t] for t in rest)))
    for tokens, p in cells:
        freq = sum(counts[t] for t in tokens) / RUNS
        assert abs(freq - p) <= Z * np.sqrt(p * (1 - p) / RUNS) + 1e-12, f"{tokens}: {freq:.4f} vs {p:.4f}"


def test_first_tokens_follow_target_only_probabilities(model_path):
    path = model_path(SMOL)
    with LlamaModel(ModelSpec(path, name="target", n_ctx=64)) as target, LlamaModel(ModelSpec(path, name="draft", n_ctx=64)) as draft:
        prompt = target.tokenize("My favourite animal is", add_special=True)
        expected = exact_first_token(target, prompt)
        spec = SpecSettings(types=("draft",), draft_max=1, n_predict=2, ignore_eos=True)
        draft_cache = Cache(draft)
        counts, kept, drafted = first_tokens(
            Cache(target), prompt, spec, lambda seed: ModelDrafter(draft_cache, sampler=Sampler(DRAFT, seed + 10**6)),
            draft_cache.forget, expected)
    assert 0 < kept < drafted  # drafts were really rejected, and really kept
    assert_follows(expected, counts)


@pytest.mark.parametrize("arch, kind", [("eagle3", "draft-eagle3"), ("dflash", "draft-dflash"), ("dspark", "draft-dspark"),
                                        ("hy_v3", "draft-mtp"), ("gemma4-assistant", "draft-mtp")])
def test_drafters_of_the_targets_hidden_states_keep_its_probabilities(tmp_path, arch, kind):
    """The same check for the drafters that read the target's hidden states, on the tiny ones of
    tests/tiny_drafters.py and tiny_model.py (hy_v3: two chained NextN layers): each drafts
    its token from its own distribution after a sampler chain of another temperature (the
    Draft's q), and rejection sampling keeps the target's."""
    from tests.tiny_drafters import write_drafter
    from tests.tiny_model import write_model
    from speculative.drafters import TokenHeadDrafter
    from speculative.drafters.block import BlockDrafter
    from speculative.engine.engine import Engine

    if arch == "hy_v3":
        model = ModelSpec(write_model(arch, tmp_path / "hy2.gguf", mtp=2), "target", n_ctx=64, n_threads=1, mtp=True)
    else:
        drafter_file, target_file = write_drafter(arch, tmp_path / f"{arch}.gguf")
        model = ModelSpec(target_file, "target", n_ctx=64, n_threads=1, **(
            {"mtp_sidecar": drafter_file} if kind == "draft-mtp" else {"feature_drafter": drafter_file}))
    with Engine(model) as engine:
        target, head = engine.caches["target"], engine.head_cache
        prompt = engine.prompt_tokens("once upon a time there were")
        expected = exact_first_token(target.model, prompt)
        spec = SpecSettings(types=(kind,), draft_max=1, n_predict=2, ignore_eos=True)

        def drafter_of(seed: int):
            sampler = Sampler(DRAFT, seed + 10**6)
            return (BlockDrafter(head, sampler=sampler) if kind in ("draft-dflash", "draft-dspark")
                    else TokenHeadDrafter(head, target.model.is_eog, sampler=sampler))

        counts, kept, drafted = first_tokens(target, prompt, spec, drafter_of, head.forget, expected)
    assert drafted == RUNS and 0 < kept < drafted
    assert_follows(expected, counts)


ANIMALS = 'root ::= " the " ("cat" | "dog" | "horse" | "bird" | "fish" | "lion" | "tiger" | "rabbit" | "snake") "."'


@pytest.mark.parametrize("drafting", ["draft", "forced"])
def test_first_tokens_under_a_grammar_follow_the_constrained_probabilities(model_path, drafting):
    """Under a grammar the target's distribution is its logits with every token the grammar
    refuses removed, then the sampler chain: computed here from llama.cpp's own verdict on every
    token of the vocabulary. The draft model samples from its masked distribution; the forced
    drafter proposes the start of what the grammar forces (` the `), as the tokenizer spells it
    (` the`, where ` `, ` t` and ` th` are admitted too)."""
    path = model_path(SMOL)
    with LlamaModel(ModelSpec(path, name="target", n_ctx=64)) as target, \
            LlamaModel(ModelSpec(path, name="draft", n_ctx=64)) as draft:
        prompt = target.tokenize("My favourite animal is", add_special=True)
        target.trim(0)
        (row,) = target.decode(prompt, 0, "last")
        admitted = target.grammar(ANIMALS).admitted(np.arange(target.n_vocab, dtype=np.int32))
        ids, probs = Sampler(TARGET, 0).distribution(np.where(admitted, row, -np.inf).astype(np.float32))
        target.trim(0)
        expected = dict(zip(ids.tolist(), probs.tolist()))
        assert len(expected) > 2
        spec = SpecSettings(types=(drafting,), draft_max=1, n_predict=2, ignore_eos=True)
        draft_cache = Cache(draft)
        counts, kept, drafted = first_tokens(
            Cache(target), prompt, spec,
            lambda seed: ModelDrafter(draft_cache, sampler=Sampler(DRAFT, seed + 10**6)) if drafting == "draft"
            else ForcedDrafter(), draft_cache.forget, expected, lambda: target.grammar(ANIMALS))
    assert drafted == RUNS and (drafting == "forced" or 0 < kept < drafted)
    assert_follows(expected, counts)
