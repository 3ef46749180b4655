"""--spec-type draft-eagle3: an EAGLE-3 drafter (-md) drafts from the target's layer inputs.

The real tests run the tiny EAGLE-3 drafters tests/tiny_drafters.py writes with their tiny
llama target: one with its own token embeddings, one with a reduced vocabulary (a d2t map),
one that takes the target's embeddings through ctx_other. Their drafts follow the target some
of the time, so drafts are accepted and rejected at varied depths. The bindings' tests need
only the installed llama.cpp.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from speculative.decoding.settings import ModelSpec, SamplerSettings, SpecSettings
from speculative.engine.engine import Engine
from speculative.errors import ModelError
from speculative.files import content_identity
from speculative.llamacpp import ext
from speculative.drafters import TokenHeadDrafter
from tests.conftest import alone_and_together, speculate, speculate_json
from tests.driver_harness import build_driver_harness, harness_drafts, record_drafts
from tests.test_mtp import steps_of, tokens_of
from tests.tiny_drafters import write_drafter

GREEDY = SamplerSettings(temp=0.0)
PROMPT = "once upon a time there were a cat and a dog. once upon a time there were"
N = 48
real = pytest.mark.real


# -- the bindings ---------------------------------------------------------------------


def test_every_ext_function_is_exported_by_its_itanium_name():
    for function in ext.FUNCTIONS:
        assert function.resolve() is not None, function.name
        assert function.names[1].startswith("_Z") and function.names[2].startswith("?")


def test_a_missing_function_fails_only_the_drafter_that_needs_it(monkeypatch):
    monkeypatch.setattr(ext.get_embeddings_layer_inp, "names", ("no_such_symbol", "_Zno_such_symbol", "?no@@"))
    monkeypatch.setattr(ext.get_embeddings_layer_inp, "_func", None)
    ext.require("draft-mtp")  # needs none of it
    with pytest.raises(ModelError, match="--spec-type draft-eagle3: this build of llama.cpp .* lacks "
                                         "llama_get_embeddings_layer_inp"):
        ext.require("draft-eagle3")
    assert ModelError.exit_code == 3


# -- the tiny EAGLE-3 drafters ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-eagle3")
    own, target = write_drafter("eagle3", folder / "eagle3.gguf")
    files = {"own": own, "target": target,
             "d2t": write_drafter("eagle3", folder / "eagle3-d2t.gguf", d2t=True)[0],
             "shared": write_drafter("eagle3", folder / "eagle3-shared.gguf", own_embd=False)[0],
             "beyond": write_drafter("eagle3", folder / "eagle3-beyond.gguf", target_layers=(0, 2, 9))[0],
             "wide": write_drafter("eagle3", folder / "eagle3-wide.gguf", target_n_embd=128, own_output=True)[0]}
    files["outside"] = folder / "eagle3-outside.gguf"  # a d2t map naming a token the target lacks
    files["outside"].write_bytes(files["d2t"].read_bytes())
    d2t = next(t for t in gguf.GGUFReader(str(files["outside"])).tensors if t.name == "d2t")
    with open(files["outside"], "r+b") as f:
        f.seek(int(d2t.data_offset) + 8 * 5)
        f.write(np.int64(100_000).tobytes())
    return files


def spec(types: tuple[str, ...], draft_max: int = 4, n: int = N) -> SpecSettings:
    return SpecSettings(types=types, n_predict=n, draft_max=draft_max, ignore_eos=True)


def target(tiny, drafter: str | None = "own", n_ctx: int = 512) -> ModelSpec:
    return ModelSpec(tiny["target"], "tiny-llama", n_ctx=n_ctx, n_threads=1,
                     feature_drafter=tiny[drafter] if drafter else None)


@real
@pytest.mark.parametrize("drafter", ["own", "d2t", "shared"])
def test_greedy_eagle3_drafts_keep_target_only_output(tiny, batch_invariant, drafter):
    with Engine(target(tiny, None)) as alone:
        reference = tokens_of(alone.run(alone.prompt_tokens(PROMPT), GREEDY, spec(("none",)), 1))
    with Engine(target(tiny, drafter)) as engine:
        assert engine.head_cache is not None and engine.head_cache.head.kind == "draft-eagle3"
        prompt = engine.prompt_tokens(PROMPT)
        lengths = set()
        for draft_max in range(1, 9):
            events = list(engine.run(prompt, GREEDY, spec(("draft-eagle3",), draft_max), 1))
            assert tokens_of(events) == reference, f"draft_max {draft_max}"
            steps = steps_of(events)
            assert {s.drafter for s in steps if s.n_drafted} == {"draft-eagle3"}
            assert any(s.n_accepted < s.n_drafted for s in steps), f"draft_max {draft_max}: nothing rejected"
            lengths |= {s.n_accepted for s in steps if s.n_drafted}
        assert len(lengths) >= 3, f"{drafter}: rejections only at depths {sorted(lengths)}"


@real
def test_prefix_reuse_equals_a_fresh_engine(tiny, batch_invariant):
    """A follow-up prompt keeps the target's cache and the drafter's entries: what they hold is
    what a fresh engine makes of the whole prompt, down to every draft."""
    with Engine(target(tiny)) as engine:
        prompt = engine.prompt_tokens(PROMPT)
        first = tokens_of(engine.run(prompt, GREEDY, spec(("draft-eagle3",)), 1))
        follow_up = prompt + first[:10] + engine.target.tokenize(" and then", add_special=False)
        reused = list(engine.run(follow_up, GREEDY, spec(("draft-eagle3", "ngram-simple")), 1))
        assert reused[0].n_cached > 0 and engine.head_cache.shared_prefix(follow_up) > len(prompt)
    with Engine(target(tiny)) as fresh:
        alone = list(fresh.run(follow_up, GREEDY, spec(("draft-eagle3", "ngram-simple")), 1))
    assert tokens_of(reused) == tokens_of(alone)
    assert [(s.n_drafted, s.n_accepted) for s in steps_of(reused)] == [(s.n_drafted, s.n_accepted)
                                                                      for s in steps_of(alone)]


@real
def test_a_seeded_sampled_run_repeats(tiny):
    """Speculative sampling: the drafter samples from its own distribution after the sampler
    chain (the Draft's q), so rejection sampling stays exact; the same seed, the same text."""
    sampling = SamplerSettings(temp=0.8)
    with Engine(target(tiny)) as engine:
        prompt = engine.prompt_tokens(PROMPT)
        first = list(engine.run(prompt, sampling, spec(("draft-eagle3",)), seed=7))
        again = list(engine.run(prompt, sampling, spec(("draft-eagle3",)), seed=7))
    assert tokens_of(first) == tokens_of(again)
    assert sum(s.n_accepted for s in steps_of(first)) > 0


def cli(tiny, *args: str, drafter: str = "own") -> tuple[str, ...]:
    return ("-m", str(tiny["target"]), "-md", str(tiny[drafter]), "-p", PROMPT, "-n", "32", "--temp", "0",
            "--ignore-eos", "-t", "1", "-c", "512", *args)


@real
def test_auto_takes_the_drafter_from_the_file(tiny, tmp_path):
    """-md eagle3.gguf with the default spec type (auto): the file says what it is."""
    out = speculate_json(*cli(tiny), env={"SPECULATE_HOME": str(tmp_path)})
    assert out["draft"] is None and out["target"]["feature_drafter"] == str(tiny["own"])
    named = speculate_json(*cli(tiny, "--spec-type", "draft-eagle3"), env={"SPECULATE_HOME": str(tmp_path)})
    assert named["tokens"] == out["tokens"] and named["n_drafted"] > 0
    assert {p["drafter"] for p in named["plans"]} - {"none"} == {"draft-eagle3"}
    # auto's choices include it, calibrated as a head (what auto then does is this machine's business)
    stored = json.loads((tmp_path / "costs.json").read_text())["models"]
    head = content_identity(tiny["own"])
    assert any(entry["identity"].get("head") == head for entry in stored.values())


@real
@pytest.mark.parametrize("case, code, message", [
    ("beyond", 3, "drafts from layer 9 of its target, but eagle3.target.gguf has 4 layers (0-3, and 4 for"),
    ("wide", 3, "drafts from hidden states of width 128"),
    ("outside", 3, "its d2t map names token 100000, outside"),
])
def test_a_drafter_that_cannot_draft_for_the_target_exits_3(tiny, case, code, message):
    proc = speculate(*cli(tiny, "--spec-type", "draft-eagle3", drafter=case), timeout=120)
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("speculate: error: "), lines


@real
def test_an_eagle3_file_is_no_model_and_no_draft_model(tiny):
    proc = speculate("-m", str(tiny["own"]), "-p", "hi", "-n", "4", "-t", "1", timeout=120)
    assert proc.returncode == 3 and "an EAGLE-3 drafter (eagle3): it drafts for another model" in proc.stderr
    for types in ("draft", "ngram-simple"):
        proc = speculate(*cli(tiny, "--spec-type", types), timeout=120)
        if types == "draft":
            assert proc.returncode == 2 and "is an EAGLE-3 drafter, not a draft model" in proc.stderr, proc.stderr
        else:  # not wanted: -md is not loaded at all, as a draft model would not be
            assert proc.returncode == 0, proc.stderr


@real
def test_each_slot_drafts_as_it_would_alone(tiny, tmp_path, batch_invariant):
    """batch -np 3 with draft-eagle3 (each slot's features and entries in its own sequences, the
    slots' entries decoded together, the encoder between): each request's text, and what it
    drafted and had accepted, are as alone (-np 1)."""
    results = alone_and_together(tmp_path, "-m", str(tiny["target"]), "-md", str(tiny["own"]),
                                 "--spec-type", "draft-eagle3", "--draft-max", "4")
    assert results[3] == results[1]
    assert 0 < sum(a for _, _, a in results[3].values()) < sum(d for _, d, _ in results[3].values())


@real
def test_the_prompt_cache_brings_the_features_along(tiny, tmp_path, batch_invariant):
    """The prompt cache file keeps the target's layer inputs beside its cache: after a restore
    the drafter catches up from them and drafts as without the file."""
    args = cli(tiny, "--spec-type", "draft-eagle3", "--prompt-cache", str(tmp_path / "p.cache"))
    first, second = speculate_json(*args), speculate_json(*args)
    assert second["n_restored"] > 0 and second["tokens"] == first["tokens"]
    assert (second["n_drafted"], second["n_accept"]) == (first["n_drafted"], first["n_accept"]) and not second["notes"]


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    return build_driver_harness(tmp_path_factory.mktemp("driver-harness"))


@real
@pytest.mark.parametrize("drafter", ["own", "d2t", "shared"])
def test_its_drafts_are_llama_cpps_own(tiny, harness, batch_invariant, monkeypatch, drafter):
    """llama.cpp's own draft-eagle3 driver (common/speculative.cpp through libllama-common: the
    harness) and speculate's port draft the same token ids after every context both draft
    after. Their loops cut steps differently (llama.cpp drafts first after its first generated
    token, speculate after the prompt), so the contexts compared are those both reach."""
    ours = record_drafts(monkeypatch, TokenHeadDrafter)
    with Engine(target(tiny, drafter)) as engine:
        prompt = engine.prompt_tokens(PROMPT)
        list(engine.run(prompt, GREEDY, spec(("draft-eagle3",), 4, n=64), 1))
    theirs = harness_drafts(harness, "draft-eagle3", tiny["target"], tiny[drafter], 4, prompt)
    both = sorted(set(ours) & set(theirs))
    assert len(both) >= 10, (sorted(ours), sorted(theirs))
    assert [(c, ours[c]) for c in both] == [(c, theirs[c]) for c in both]
