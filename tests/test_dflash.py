"""--spec-type draft-dflash and draft-dspark: a DFlash or DSpark drafter (-md) drafts a block of
tokens in one decode from the target's layer inputs.

The real tests run the tiny drafters tests/tiny_drafters.py writes with their tiny llama
target: DFlash (non-causal, causal, DFlash2 with its candidate selector) and DSpark (from the
anchor or after it, with a confidence head). DFlash drafts the anchor's successor at every
mask, DSpark's Markov head follows the successor chain, so drafts are accepted at varied
depths. llama.cpp's own driver runs beside ours (tests/spec_driver_harness.cpp).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from speculative.decoding.settings import ModelSpec, SamplerSettings, SpecSettings
from speculative.drafters.block import BlockDrafter
from speculative.engine.engine import Engine
from tests.conftest import alone_and_together, speculate, speculate_json
from tests.driver_harness import build_driver_harness, harness_drafts, record_drafts
from tests.test_mtp import steps_of, tokens_of
from tests.tiny_drafters import write_drafter

GREEDY = SamplerSettings(temp=0.0)
PROMPT = "once upon a time there were a cat and a dog. once upon a time there were"
real = pytest.mark.real
# name -> (architecture written, write_drafter's arguments, its --spec-type)
DRAFTERS = {"dflash": ("dflash", {}, "draft-dflash"),
            "causal": ("dflash", {"causal": True}, "draft-dflash"),
            "dflash2": ("dflash", {"selector_top_k": 7}, "draft-dflash"),
            "dspark": ("dspark", {}, "draft-dspark"),
            "dspark-after-anchor": ("dspark", {"sample_from_anchor": False}, "draft-dspark"),
            "dspark-no-confidence": ("dspark", {"confidence": False}, "draft-dspark")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tiny-dflash")
    files = {}
    for name, (arch, kw) in ((n, d[:2]) for n, d in DRAFTERS.items()):
        files[name], files["target"] = write_drafter(arch, folder / f"{name}.gguf", **kw)
    files["beyond"] = write_drafter("dflash", folder / "beyond.gguf", target_layers=(1, 4))[0]
    return files


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    return build_driver_harness(tmp_path_factory.mktemp("driver-harness"))


def spec(kind: str, draft_max: int, n: int = 48, p_min: float = 0.0) -> SpecSettings:
    return SpecSettings(types=(kind,), n_predict=n, draft_max=draft_max, ignore_eos=True, draft_p_min=p_min)


def target(tiny, drafter: str | None = None) -> ModelSpec:
    return ModelSpec(tiny["target"], "tiny-llama", n_ctx=512, n_threads=1,
                     feature_drafter=tiny[drafter] if drafter else None)


@real
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_block_drafts_keep_target_only_output(tiny, batch_invariant, drafter):
    kind = DRAFTERS[drafter][2]
    with Engine(target(tiny)) as alone:
        reference = tokens_of(alone.run(alone.prompt_tokens(PROMPT), GREEDY, spec("none", 1), 1))
    with Engine(target(tiny, drafter)) as engine:
        assert engine.head_cache.head.kind == kind
        prompt = engine.prompt_tokens(PROMPT)
        for draft_max in (1, 2, 4, 7):
            events = list(engine.run(prompt, GREEDY, spec(kind, draft_max), 1))
            assert tokens_of(events) == reference, f"draft_max {draft_max}"
            steps = steps_of(events)
            assert {s.drafter for s in steps if s.n_drafted} == {kind}
            assert max(s.n_drafted for s in steps) == draft_max
            assert sum(s.n_accepted for s in steps) > 0 and any(s.n_accepted < s.n_drafted for s in steps)


@real
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_its_drafts_are_llama_cpps_own(tiny, harness, batch_invariant, monkeypatch, drafter):
    """speculate's drafts are those of llama.cpp's own driver after every context both reach
    (speculate cuts a draft where -n leaves no room for it: compared up to its length there)."""
    kind = DRAFTERS[drafter][2]
    ours = record_drafts(monkeypatch, BlockDrafter)
    with Engine(target(tiny, drafter)) as engine:
        prompt = engine.prompt_tokens(PROMPT)
        list(engine.run(prompt, GREEDY, spec(kind, 6, n=64), 1))
    theirs = harness_drafts(harness, kind, tiny["target"], tiny[drafter], 6, prompt)
    both = sorted(set(ours) & set(theirs))
    assert len(both) >= 10 and sum(len(ours[c]) == 6 for c in both) >= 10
    assert [(c, ours[c]) for c in both] == [(c, theirs[c][: len(ours[c])]) for c in both]


@real
def test_dspark_cuts_drafts_by_its_confidence(tiny):
    with Engine(target(tiny, "dspark")) as engine:
        prompt = engine.prompt_tokens(PROMPT)
        every = steps_of(engine.run(prompt, GREEDY, spec("draft-dspark", 6), 1))
        confident = steps_of(engine.run(prompt, GREEDY, spec("draft-dspark", 6, p_min=0.9), 1))
    assert sum(s.n_drafted for s in confident) < sum(s.n_drafted for s in every)


@real
def test_each_slot_drafts_as_it_would_alone(tiny, tmp_path, batch_invariant):
    results = alone_and_together(tmp_path, "-m", str(tiny["target"]), "-md", str(tiny["dspark"]),
                                 "--spec-type", "draft-dspark", "--draft-max", "4")
    assert results[3] == results[1]
    assert 0 < sum(a for _, _, a in results[3].values()) < sum(d for _, d, _ in results[3].values())


def cli(tiny, drafter: str, *args: str) -> tuple[str, ...]:
    return ("-m", str(tiny["target"]), "-md", str(tiny[drafter]), "-p", PROMPT, "-n", "32", "--temp", "0",
            "--ignore-eos", "-t", "1", "-c", "512", *args)


@real
def test_the_type_comes_from_the_file(tiny, tmp_path):
    """auto (the default) takes -md's drafter as llama.cpp's common_speculative_types_from_gguf
    tells it (DSpark by its Markov head); a type the file is not exits 2."""
    for drafter, kind in (("dflash", "draft-dflash"), ("dspark", "draft-dspark")):
        out = speculate_json(*cli(tiny, drafter), env={"SPECULATE_HOME": str(tmp_path)})
        assert out["draft"] is None and out["target"]["feature_drafter"] == str(tiny[drafter])
        named = speculate_json(*cli(tiny, drafter, "--spec-type", kind), env={"SPECULATE_HOME": str(tmp_path)})
        assert named["tokens"] == out["tokens"] and named["n_drafted"] > 0
    proc = speculate(*cli(tiny, "dspark", "--spec-type", "draft-eagle3"))
    assert proc.returncode == 2 and "is a DSpark drafter, not what this --spec-type drafts with" in proc.stderr


@real
def test_the_prompt_cache_brings_the_features_along(tiny, tmp_path, batch_invariant):
    args = cli(tiny, "dspark", "--spec-type", "draft-dspark", "--prompt-cache", str(tmp_path / "p.cache"))
    first, second = speculate_json(*args), speculate_json(*args)
    assert second["n_restored"] > 0 and second["tokens"] == first["tokens"]
    assert (second["n_drafted"], second["n_accept"]) == (first["n_drafted"], first["n_accept"]) and not second["notes"]


@real
@pytest.mark.parametrize("args, code, message", [
    (("-md", "beyond", "--spec-type", "draft-dflash"), 3, "drafts from layer 4 of its target, but"),
    (("-md", "dspark-no-confidence", "--spec-type", "draft-dspark", "--draft-p-min", "0.5"), 2,
     "has no confidence head to cut its drafts with; give --draft-p-min 0"),
    (("-m", "dflash"), 3, "a DFlash drafter (dflash): it drafts for another model"),
])
def test_bad_drafters_exit_with_one_line(tiny, args, code, message):
    named = [str(tiny[a]) if a in tiny else a for a in args]
    model = () if "-m" in args else ("-m", str(tiny["target"]))
    proc = speculate(*model, *named, "-p", "hi", "-n", "4", "-t", "1", "-c", "512", timeout=120)
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and message in lines[0], lines


@real
@pytest.mark.parametrize("target_arch", ["lfm2", "qwen35"])
@pytest.mark.parametrize("arch, kind", [("eagle3", "draft-eagle3"), ("dspark", "draft-dspark")])
def test_recurrent_and_hybrid_targets(tmp_path, batch_invariant, target_arch, arch, kind):
    """A hybrid target (LFM2's short convolutions, Qwen3.5's delta-net) rolls back through its
    recurrent state's snapshots; the layer inputs the drafter reads are cut with it."""
    from speculative.llamacpp.doctor import batch_invariance

    drafter, target_file = write_drafter(arch, tmp_path / f"{arch}.gguf", target_arch=target_arch)
    model = ModelSpec(target_file, target_arch, n_ctx=512, n_threads=1, n_rs_seq=4)
    with Engine(model) as alone:
        if max(c.max_abs_diff for c in batch_invariance(alone.caches["target"], depths=(16,))) > 0:
            pytest.skip(f"{target_arch} scores a batch differently from token by token here: identity is not expected")
        reference = tokens_of(alone.run(alone.prompt_tokens(PROMPT), GREEDY, spec("none", 1), 1))
    with Engine(ModelSpec(target_file, target_arch, n_ctx=512, n_threads=1, n_rs_seq=4,
                          feature_drafter=drafter)) as engine:
        events = list(engine.run(engine.prompt_tokens(PROMPT), GREEDY, spec(kind, 4), 1))
    assert tokens_of(events) == reference
    steps = steps_of(events)
    assert sum(s.n_accepted for s in steps) > 0 and any(s.n_accepted < s.n_drafted for s in steps)


@real
def test_serve_drafts_with_it_for_requests_at_once(tiny, tmp_path, model_path, batch_invariant):
    """serve -np 2 with a DSpark drafter: two clients at once each get the one-shot command's
    greedy answer; a request asking for a drafter the server has not loaded is a 400."""
    from tests.test_serve import at_once, start_server, stop_server

    server = start_server(model_path, tmp_path, "-md", str(tiny["dspark"]), "--spec-type", "draft-dspark", "-np", "2",
                          "--no-kv-unified", "-c", "1024", "-t", "1", model=str(tiny["target"]))
    try:
        prompts = (PROMPT, "the dog and the cat")
        answers = at_once(server, prompts, max_tokens=24)
        status, _, refused = server.request("POST", "/v1/completions", {
            "prompt": "hi", "max_tokens": 4, "speculative.type": "draft-eagle3"})
    finally:
        stop_server(server)
    for p in prompts:
        alone = speculate_json("-m", str(tiny["target"]), "-md", str(tiny["dspark"]), "--spec-type", "draft-dspark",
                               "-p", p, "-n", "24", "--temp", "0", "-t", "1", "-c", "512")
        assert answers[p]["choices"][0]["text"] == alone["text"], p
    assert status == 400 and "draft-eagle3 needs an EAGLE-3 drafter" in refused["error"]["message"], refused
