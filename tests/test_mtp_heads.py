"""draft-mtp against llama.cpp's own driver: one NextN layer, several chained, and a Gemma-4
MTP assistant that reads the target's KV cache.

A model with several NextN (MTP) layers drafts its i-th token with layer i, as llama.cpp's
draft-mtp driver chains them (Step-3.5, MiMo-V2, Hunyuan-V3). The tiny Hunyuan-V3 of
tests/tiny_model.py (`hy_v3 --mtp-heads N`) has N of them, each favouring the successor its
trunk favours, so drafts are accepted and rejected; tests/tiny_drafters.py writes a tiny
Gemma-4 assistant with its gemma4 target. llama.cpp's driver runs beside ours through
libllama-common (tests/spec_driver_harness.cpp).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import json

from speculative.decoding.settings import ModelSpec, SamplerSettings, SpecSettings
from speculative.drafters import TokenHeadDrafter
from speculative.engine.engine import Engine
from tests.conftest import alone_and_together, speculate
from tests.driver_harness import build_driver_harness, harness_drafts, record_drafts
from tests.test_mtp import steps_of, tokens_of
from tests.tiny_drafters import write_drafter
from tests.tiny_model import write_model

GREEDY = SamplerSettings(temp=0.0)
PROMPT = "once upon a time there were a cat and a dog. once upon a time there were"
real = pytest.mark.real
HEADS = {"qwen35": 1, "hy1": 1, "hy2": 2, "hy3": 3, "assistant": 1}  # NextN layers chained


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tiny-mtp-chain")
    return {"hy1": write_model("hy_v3", folder / "hy1.gguf", mtp=1),
            "hy2": write_model("hy_v3", folder / "hy2.gguf", mtp=2),
            "hy3": write_model("hy_v3", folder / "hy3.gguf", mtp=3),
            "qwen35": write_model("qwen35", folder / "qwen35-mtp.gguf", mtp=1),
            "qwen35x2": write_model("qwen35", folder / "qwen35-mtp2.gguf", mtp=2),
            "hy-plain": write_model("hy_v3", folder / "hy.gguf"),  # what --no-nextn converts
            "hy2-head": write_model("hy_v3", folder / "mtp-hy2.gguf", mtp=2, mtp_only=True),
            **dict(zip(("assistant", "gemma4"), write_drafter("gemma4-assistant", folder / "assistant.gguf")))}


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    return build_driver_harness(tmp_path_factory.mktemp("driver-harness"))


def target(path: Path, mtp: bool = True, sidecar: Path | None = None) -> ModelSpec:
    return ModelSpec(path, path.stem, n_ctx=512, n_threads=1, mtp=mtp and sidecar is None, n_rs_seq=8,
                     mtp_sidecar=sidecar)


def with_head(models, model: str) -> ModelSpec:
    """A model with its NextN layers, or the Gemma-4 assistant's target with it."""
    return target(models["gemma4"], sidecar=models["assistant"]) if model == "assistant" else target(models[model])


def spec(types: tuple[str, ...], draft_max: int, n: int = 48) -> SpecSettings:
    return SpecSettings(types=types, n_predict=n, draft_max=draft_max, ignore_eos=True)


def drafts_by_context(spec_: ModelSpec, draft_max: int, monkeypatch) -> tuple[dict[int, list[int]], list[int]]:
    """What speculate's draft-mtp drafts after each context of a greedy run, by its length; and the prompt."""
    drafts = record_drafts(monkeypatch, TokenHeadDrafter)
    with Engine(spec_) as engine:
        prompt = engine.prompt_tokens(PROMPT)
        list(engine.run(prompt, GREEDY, spec(("draft-mtp",), draft_max, n=64), 1))
    monkeypatch.undo()
    return drafts, prompt


@real
@pytest.mark.parametrize("model, draft_max, compared", [
    ("qwen35", 4, 4), ("hy1", 4, 4), ("hy2", 4, 2),
    # llama.cpp's driver reads a chained head's NextN row of the first entry of its decode, not of
    # the last (masked rows of a graph that computes them for every entry): from the third head
    # on its drafts follow another row than speculate's (docs/drafters.md)
    ("hy3", 6, 2), ("assistant", 4, 4),
])
def test_its_drafts_are_llama_cpps_own(models, harness, batch_invariant, monkeypatch, model, draft_max, compared):
    spec_ = with_head(models, model)
    ours, prompt = drafts_by_context(spec_, draft_max, monkeypatch)
    theirs = harness_drafts(harness, "draft-mtp", spec_.path, spec_.mtp_sidecar, draft_max, prompt)
    both = sorted(set(ours) & set(theirs))
    assert len(both) >= 10, (sorted(ours), sorted(theirs))
    assert [(c, ours[c][:compared]) for c in both] == [(c, theirs[c][:compared]) for c in both]
    heads = HEADS[model]
    assert max(map(len, ours.values())) == (min(draft_max, heads) if heads > 1 else draft_max)


@real
@pytest.mark.parametrize("model", ["hy2", "hy3", "assistant"])
def test_chained_heads_and_the_assistant_keep_target_only_output(models, batch_invariant, model):
    plain = models["gemma4" if model == "assistant" else model]
    with Engine(target(plain, mtp=False)) as alone:
        reference = tokens_of(alone.run(alone.prompt_tokens(PROMPT), GREEDY, spec(("none",), 4), 1))
    with Engine(with_head(models, model)) as engine:
        assert engine.head_cache.head.n_heads == HEADS[model]
        prompt = engine.prompt_tokens(PROMPT)
        for draft_max in range(1, 7):
            events = list(engine.run(prompt, GREEDY, spec(("draft-mtp",), draft_max), 1))
            assert tokens_of(events) == reference, f"draft_max {draft_max}"
            steps = steps_of(events)
            assert max(s.n_drafted for s in steps) == min(draft_max, engine.head_cache.head.max_draft or draft_max)
            assert sum(s.n_accepted for s in steps) > 0 and any(s.n_accepted < s.n_drafted for s in steps)


@real
def test_chained_heads_draft_unlike_the_first_head_alone(models, monkeypatch):
    """The second drafted token is the second head's: unlike what the first head drafts next."""
    one, _ = drafts_by_context(target(models["hy1"]), 2, monkeypatch)
    two, _ = drafts_by_context(target(models["hy2"]), 2, monkeypatch)
    both = sorted(set(one) & set(two))
    assert [one[c][0] for c in both] == [two[c][0] for c in both]  # the first head is the same
    assert [one[c][1:] for c in both] != [two[c][1:] for c in both]


@real
def test_a_head_file_with_several_layers_chains_them_as_the_combined_file(models):
    runs = []
    for spec_ in (target(models["hy2"]), ModelSpec(models["hy-plain"], "hy", n_ctx=512, n_threads=1,
                                                   mtp_sidecar=models["hy2-head"])):
        with Engine(spec_) as engine:
            assert engine.head_cache.head.n_heads == 2
            events = list(engine.run(engine.prompt_tokens(PROMPT), GREEDY, spec(("draft-mtp",), 4), 1))
            runs.append((tokens_of(events), [(s.n_drafted, s.n_accepted) for s in steps_of(events)]))
    assert runs[0] == runs[1]


@real
def test_several_nextn_layers_that_llama_cpp_cannot_chain_exit_3(models):
    """llama.cpp's qwen35 MTP graph asserts a single NextN layer (it aborts the process)."""
    proc = speculate("-m", str(models["qwen35x2"]), "--spec-type", "draft-mtp", "-p", "hi", "-n", "4", "-t", "1",
                     timeout=120)
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "2 NextN (MTP) layers, but llama.cpp's qwen35 graph runs one" in lines[0], lines


@real
def test_each_slot_drafts_with_the_assistant_as_it_would_alone(models, tmp_path, batch_invariant):
    """batch -np 3: the assistant reads each slot's own cells of the target's cache (its context
    mirrors the target's sequences); each request's text and drafts are as alone (-np 1)."""
    results = alone_and_together(tmp_path, "-m", str(models["gemma4"]), "-md", str(models["assistant"]),
                                 "--spec-type", "draft-mtp", "--draft-max", "4")
    assert results[3] == results[1]
    assert 0 < sum(a for _, _, a in results[3].values()) < sum(d for _, d, _ in results[3].values())


@real
def test_the_assistant_is_an_mtp_head_not_a_model(models):
    """auto takes it from the file; --spec-type draft refuses it (2), -m too (3)."""
    args = ("-p", PROMPT, "-n", "24", "--temp", "0", "--ignore-eos", "-t", "1", "-c", "512")
    proc = speculate("-m", str(models["gemma4"]), "-md", str(models["assistant"]), *args, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["draft"] is None and out["target"]["mtp_head"] == str(models["assistant"])
    proc = speculate("-m", str(models["gemma4"]), "-md", str(models["assistant"]), "--spec-type", "draft", *args)
    assert proc.returncode == 2 and "is an MTP head" in proc.stderr, proc.stderr
    proc = speculate("-m", str(models["assistant"]), *args)
    assert proc.returncode == 3 and "a Gemma-4 MTP assistant" in proc.stderr, proc.stderr
