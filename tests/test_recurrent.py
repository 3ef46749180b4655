"""Recurrent and hybrid models (Mamba, Mamba-2, RWKV-7, LFM2, Qwen3.5, Granite-4-H) run,
and speculation on them is exact.

The models are tiny random-weight GGUFs written here by tests/tiny_model.py (no
download, nothing binary committed). A recurrent state is one value per sequence, so a
rejected draft is undone through llama.cpp's snapshots (n_rs_seq: LFM2, Qwen3.5) or a
checkpoint of the state and a decode of the accepted tokens again (the others); see
speculative/decoding/cache.py. Greedy identity is checked with drafts forced to be rejected at every
position. Qwen3.5's delta-net scores a batch with a chunked kernel and single tokens with
another, so its identity is asserted where `doctor`'s measurement finds them equal, and
otherwise the measured difference is what the test reports. That doctor finds such a
difference in recurrent layers is shown on a fake recurrent model whose batches drift (no
model needed, so not marked `real`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import gguf
import llama_cpp as ll

from speculative.cli.main import app
from speculative.decoding.cache import Cache
from speculative.decoding.drafter import Draft, Drafter
from speculative.decoding.events import Step, Token
from tests.fakes import generate
from speculative.decoding.sampling import Sampler
from speculative.decoding.settings import ModelSpec, SamplerSettings, SpecSettings
from speculative.engine.engine import Engine
from speculative.engine.parallel import Parallel
from speculative.llamacpp.doctor import batch_invariance, probe_tokens
from speculative.llamacpp.decode import Part
from speculative.llamacpp.model import LlamaModel

from tests.conftest import speculate, speculate_json
from tests.fakes import FakeBackend, ToyModel
from tests.gguf_builder import write_out
from tests.test_serve import start_server, stop_server
from tests.tiny_model import ARCH_INFO, write_model

real = pytest.mark.real  # all but the fake-backend test of doctor's probe

GENERATIVE = [a for a, info in ARCH_INFO.items() if info.generative]
RECURRENT = [a for a, info in ARCH_INFO.items() if info.recurrent or info.hybrid]
THREADS = 1  # tiny models decode in microseconds: more threads only wait for each other
GREEDY = SamplerSettings(temp=0.0)
PROMPT = "once upon a time there were a cat and a dog. once upon a time there were"
N = 64  # room for every rejection position at --draft-max 8 (1 + 2 + ... + 9 tokens)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """arch -> path of its tiny model, written once per module."""
    folder = tmp_path_factory.mktemp("tiny")
    made: dict[str, Path] = {}

    def get(arch: str, **kw) -> Path:
        key = arch + "".join(f"-{k}{v}" for k, v in sorted(kw.items()))
        if key not in made:
            made[key] = write_model(arch, folder / f"{key}.gguf", **kw)
        return made[key]

    return get


def tokens_of(events) -> list[int]:
    return [e.id for e in events if isinstance(e, Token)]


def steps_of(events) -> list[Step]:
    return [e for e in events if isinstance(e, Step)]


class Forced(Drafter):
    """Proposes the reference continuation with one token wrong, at a position that moves
    on every step: rejections at every position of the draft."""

    name = "forced"

    def __init__(self, prompt: list[int], reference: list[int], n_vocab: int):
        self.text = prompt + reference
        self.n_vocab = n_vocab
        self.steps = 0

    def propose(self, context, k):
        right = self.text[len(context) : len(context) + k]
        if not right:
            return self.nothing()
        wrong_at = self.steps % (k + 1)  # k: every drafted token right
        self.steps += 1
        if wrong_at < len(right):
            right[wrong_at] = (right[wrong_at] + 1) % self.n_vocab
        return Draft(right, self.name)


def run(cache: Cache, prompt: list[int], drafter: Drafter | None = None, draft_max: int = 8,
        sampling: SamplerSettings = GREEDY, seed: int = 1) -> list:
    spec = SpecSettings(n_predict=N, draft_max=draft_max, ignore_eos=True)
    banned = cache.model.eog_tokens()
    return list(generate(cache, prompt, Sampler(sampling, seed, banned), spec, drafter))


@real
@pytest.mark.parametrize("arch", GENERATIVE)
def test_every_generating_architecture_runs(tiny, arch):
    out = speculate_json("-m", str(tiny(arch)), "-p", PROMPT, "-n", "16", "--temp", "0", "--ignore-eos",
                         "--spec-type", "none", "-t", str(THREADS))
    assert out["n_predict"] == 16 and out["finish_reason"] == "length"


@real
@pytest.mark.parametrize("arch, why", [("bert", "an embedding model"), ("dream", "a diffusion model"),
                                       ("llada", "a diffusion model")])
def test_what_cannot_generate_exits_3_with_one_line(tiny, arch, why):
    proc = speculate("-m", str(tiny(arch)), "-p", "hi", "-n", "4", "--spec-type", "none", "-t", "1", timeout=120)
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("speculate: error: "), proc.stderr
    assert why in lines[0] and f"({arch})" in lines[0]
    assert proc.stdout == b""


@real
@pytest.mark.parametrize("arch", RECURRENT)
def test_rejections_at_every_position_keep_greedy_output(tiny, arch, batch_invariant):
    """Drafts of 1..8 tokens with the wrong token at every position in turn: the output is
    target-only decoding's, through snapshots (lfm2, qwen35) or checkpoints (the others)."""
    path = tiny(arch)
    rollback = ARCH_INFO[arch].rollback
    with LlamaModel(ModelSpec(path, name=arch, n_ctx=512, n_rs_seq=8, n_threads=THREADS)) as model:
        assert model.recurrent and model.rollback_limit == (8 if rollback else 0)
        cache = Cache(model)
        differences = [c.max_abs_diff for c in batch_invariance(cache, depths=(16,))]
        if max(differences) > 0 and arch == "qwen35":  # its chunked delta-net, on some CPUs
            pytest.skip(f"{arch} scores a batch differently from token by token here "
                        f"(max |logit difference| {max(differences):.3g}): greedy identity is not expected")
        assert max(differences) == 0, "a rollback or checkpoint left the wrong state"
        prompt = model.tokenize(PROMPT, add_special=True)
        reference = tokens_of(run(cache, prompt))
        assert len(set(reference)) > 4
        for draft_max in range(1, 9):
            events = run(cache, prompt, Forced(prompt, reference, model.n_vocab), draft_max)
            assert tokens_of(events) == reference, f"draft_max {draft_max}"
            rejected_at = {s.n_accepted for s in steps_of(events) if s.n_accepted < s.n_drafted}
            assert rejected_at == set(range(draft_max)), f"draft_max {draft_max}"


@real
@pytest.mark.parametrize("arch", ["lfm2", "mamba"])
def test_a_hybrid_or_recurrent_draft_model_drafts_exactly(tiny, arch, batch_invariant):
    """A recurrent draft model drafts one token per decode and comes back to its checkpoint."""
    target = tiny("llama")
    draft = tiny(arch, seed=1)
    with Engine(ModelSpec(target, "target", n_ctx=512, n_threads=THREADS),
                ModelSpec(draft, "draft", n_ctx=512, n_threads=THREADS)) as engine:
        prompt = engine.prompt_tokens(PROMPT)
        spec = SpecSettings(types=("draft",), n_predict=N, draft_max=6, ignore_eos=True)
        drafted = list(engine.run(prompt, GREEDY, spec, seed=1))
        alone = list(engine.run(prompt, GREEDY, SpecSettings(types=("none",), n_predict=N, ignore_eos=True), 1))
    assert tokens_of(drafted) == tokens_of(alone)
    steps = steps_of(drafted)
    assert sum(s.n_accepted for s in steps) > 0 and any(s.n_accepted < s.n_drafted for s in steps)


@real
@pytest.mark.parametrize("arch", ["lfm2", "granitehybrid"])
def test_a_seeded_sampled_run_repeats_and_prefix_reuse_equals_a_fresh_engine(tiny, arch):
    """Sampled with n-gram drafts: the same seed gives the same text twice; a second prompt
    that shares the first one's prompt and part of its output gives what a fresh engine does."""
    spec = SpecSettings(types=("ngram-simple",), n_predict=N, draft_max=6, ignore_eos=True)
    sampling = SamplerSettings(temp=0.8)
    target = ModelSpec(tiny(arch), arch, n_ctx=512, n_rs_seq=6, n_threads=THREADS)
    with Engine(target) as engine:
        prompt = engine.prompt_tokens(PROMPT)
        first = tokens_of(engine.run(prompt, sampling, spec, seed=7))
        again = tokens_of(engine.run(prompt, sampling, spec, seed=7))
        follow_up = prompt + first[:10] + engine.target.tokenize(" and then", add_special=False)
        reused = list(engine.run(follow_up, GREEDY, spec, seed=1))
    assert first == again
    assert reused[0].n_cached > 0
    with Engine(target) as fresh:
        assert tokens_of(reused) == tokens_of(fresh.run(follow_up, GREEDY, spec, seed=1))


@real
def test_a_drafting_sidecar_given_as_the_model_exits_3(tmp_path):
    path = tmp_path / "eagle3.gguf"
    w = gguf.GGUFWriter(str(path), "eagle3")
    w.add_block_count(1)
    w.add_tensor("fc.weight", np.zeros((4, 4), dtype=np.float32))
    write_out(w, path)
    proc = speculate("-m", str(path), "-p", "hi", "-n", "4", timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.splitlines() == [f"speculate: error: {path}: an EAGLE-3 drafter (eagle3): it drafts for "
                                        "another model and cannot generate on its own"]


@real
def test_draft_trees_on_a_recurrent_target_exit_2(tiny):
    proc = speculate("-m", str(tiny("lfm2")), "-md", str(tiny("llama")), "--spec-type", "draft", "-np", "2",
                     "-p", "hi", "-n", "4", "-t", "1", timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "recurrent state" in proc.stderr and "-np 1" in proc.stderr
    assert len(proc.stderr.splitlines()) == 1


@real
def test_prompt_cache_and_batch_on_a_hybrid_model(tiny, tmp_path, batch_invariant):
    """The prompt cache file restores a hybrid model's state; `batch` runs it."""
    model = str(tiny("lfm2"))
    args = ("-m", model, "-p", PROMPT, "-n", "16", "--temp", "0", "--ignore-eos", "--spec-type", "ngram-simple",
            "-t", "1")
    cache = str(tmp_path / "prompt.cache")
    first = speculate_json(*args, "--prompt-cache", cache)
    second = speculate_json(*args, "--prompt-cache", cache)
    assert second["n_restored"] > 0 and second["tokens"] == first["tokens"]
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"id": 1, "prompt": "once upon a time"}\n{"id": 2, "prompt": "once upon a dog"}\n')
    proc = speculate("batch", str(requests), "-o", str(tmp_path / "out.jsonl"), "-m", model, "-n", "8",
                     "--temp", "0", "--spec-type", "ngram-simple", "-t", "1")
    assert proc.returncode == 0, proc.stderr
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2


class BatchVariant(FakeBackend):
    """A recurrent fake model (one state, no snapshots: it comes back to checkpoints, as Mamba
    does) that scores batches of `from_batch` tokens or more with another kernel, as Qwen3.5's
    chunked delta-net does: row i of such a batch is i * `drift` off what decoding the tokens
    one by one gives. Its first row is exact, so only a probe of every position sees it."""

    rollback_limit = 0
    # what doctor's report shows of a loaded model
    placement, n_gpu_layers, n_threads, flash_attn, kernels, recurrent, arch = "cpu", 0, 1, "off", [], True, "toy"
    flash_attn_on, cache_types = False, ("f16", "f16")

    def __init__(self, from_batch: int, drift: float):
        super().__init__(ToyModel(seed=4), n_ctx=512)
        self.from_batch, self.drift = from_batch, drift

    def decode(self, tokens, pos, outputs):
        rows = super().decode(tokens, pos, outputs)
        if outputs == "all" and len(tokens) >= self.from_batch:
            rows = [row + np.float32(i * self.drift) for i, row in enumerate(rows)]
        return rows


def test_doctor_finds_a_recurrent_kernel_that_changes_with_the_batch():
    """Batches of 9 and more drift by 0.25 a logit per position: doctor finds (b - 1) * 0.25 in
    each of them, after 16 cached tokens and after 300, and nothing in smaller batches; every
    batch starts again from the recurrent state's checkpoint."""
    backend = BatchVariant(from_batch=9, drift=0.25)
    checks = batch_invariance(Cache(backend))
    expected = {(cached, b): (b - 1) * 0.25 if b >= 9 else 0.0 for cached in (16, 300) for b in range(2, 17)}
    assert {(c.cached, c.batch): c.max_abs_diff for c in checks} == pytest.approx(expected, abs=1e-5)
    assert backend.checkpoints["restored"] >= 2 * 15 and backend.cache == []


class DoctorEngine:
    """What `speculate doctor` loads, with the fake model in place of the GGUF's."""

    def __init__(self, model: FakeBackend):
        self.target = model
        self.caches = {"target": Cache(model)}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


@pytest.mark.parametrize("drift", [0.25, 0.0])
def test_doctors_verdict_is_what_it_measured(monkeypatch, tmp_path, capsys, drift):
    """The command's verdict and report, over the fake: not batch-invariant where batches of 9
    and more differ (as the JSON and as text), batch-invariant where nothing does."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(28))  # doctor's -m check reads the magic; the fake loads nothing
    monkeypatch.delenv("COLUMNS", raising=False)  # the report's lines whole (captured: no terminal)
    monkeypatch.setattr("speculative.engine.engine.Engine",
                        lambda spec, **callbacks: DoctorEngine(BatchVariant(9, drift)))
    app(args=["doctor", "-m", str(path), "-np", "1", "--json"], standalone_mode=False, prog_name="speculate")
    report = json.loads(capsys.readouterr().out)
    assert report["recurrent"] is True and len(report["checks"]) == 30
    assert report["batch_invariant"] is (drift == 0.0)
    app(args=["doctor", "-m", str(path), "-np", "1"], standalone_mode=False, prog_name="speculate")
    text = capsys.readouterr().out
    if drift:
        differ = "differs in batches 9, 10, 11, 12, 13, 14, 15, 16 (max |logit difference| 3.75)"
        assert text.count(differ) == 2 and "verdict: not batch-invariant" in text, text
    else:
        assert text.count("bit-identical in every batch") == 2 and "verdict: batch-invariant" in text, text


@real
def test_doctor_probes_recurrent_layers(tiny):
    """On the tiny Qwen3.5 (gated delta-net layers), the command measures what decoding in fresh
    contexts, without checkpoints, measures: the same difference (or none) at every batch size
    after 16 cached tokens, so the checkpoints doctor comes back to add none of their own."""
    path = tiny("qwen35")
    report = speculate_json("doctor", "-m", str(path), "-t", str(THREADS))
    assert report["recurrent"] is True and report["architecture"] == "qwen35"
    assert len(report["checks"]) == 30 and all(np.isfinite(c["max_abs_diff"]) for c in report["checks"])
    with LlamaModel(ModelSpec(path, name="qwen35", n_ctx=512, n_batch=512, n_threads=THREADS)) as model:
        tokens = probe_tokens(np.random.default_rng(0), model.n_vocab, 16 + 16)  # doctor's first probe
        model.decode(tokens[:16], 0, "none")
        alone = np.array([model.decode([t], 16 + i, "last")[0].copy() for i, t in enumerate(tokens[16:])])
        fresh = {}
        for b in range(2, 17):
            model.trim(0)  # a recurrent state may be dropped whole
            model.decode(tokens[:16], 0, "none")
            fresh[b] = float(np.abs(np.array(model.decode(tokens[16 : 16 + b], 16, "all")) - alone[:b]).max())
    assert {c["batch"]: c["max_abs_diff"] for c in report["checks"] if c["cached"] == 16} == fresh


@real
def test_serve_on_a_hybrid_model_keeps_the_conversation_where_exact(tiny, tmp_path, model_path):
    """A second chat turn restores the hybrid state at the end of the first prompt (its
    checkpoint) and answers as the one-shot command does."""
    lfm2 = str(tiny("lfm2"))
    server = start_server(model_path, tmp_path, "-t", "1", "--spec-type", "ngram-simple", model=lfm2)
    try:
        client = server.client()
        turn = [{"role": "user", "content": "once upon a time there were a cat and a dog"}]
        first = client.chat.completions.create(model="any", messages=turn, max_tokens=12, temperature=0)
        turn += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "and then?"}]
        second = client.chat.completions.create(model="any", messages=turn, max_tokens=12, temperature=0)
        assert second.model_extra["timings"]["cache_n"] >= first.usage.prompt_tokens - 1
        status, _, answer = server.request("POST", "/v1/completions", {
            "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
        assert status == 200, answer
    finally:
        assert stop_server(server) == 0
    one_shot = speculate_json("-m", lfm2, "-p", PROMPT, "--no-escape", "-n", "16", "--temp", "0", "--ignore-eos",
                              "--spec-type", "ngram-simple", "-t", "1")
    assert answer["choices"][0]["text"] == one_shot["text"]


@real
@pytest.mark.parametrize("arch", ["lfm2", "mamba", "qwen35"])
def test_requests_at_once_keep_a_recurrent_state_each(tiny, tmp_path, arch, batch_invariant):
    """batch -np 3 on a recurrent or hybrid model, drafted for by another of its kind: each request
    has its own recurrent states (and snapshots, and checkpoints past them: --draft-max 8), in
    streams of their own; every request's greedy output is its output alone, rejections
    included."""
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": PROMPT[i:], "n_predict": 20 + 7 * i}) + "\n"
                            for i in range(6)))
    flags = ("-m", str(tiny(arch)), "-md", str(tiny(arch, seed=1)), "--temp", "0", "--spec-type", "draft",
             "--draft-max", "8", "--ignore-eos", "-t", str(THREADS), "-c", "256")
    texts = {}
    for np_flags in (("-np", "1"), ("-np", "3", "--no-kv-unified", "-c", "768")):
        out = tmp_path / f"out{np_flags[1]}.jsonl"
        proc = speculate("batch", str(path), "-o", str(out), *flags, *np_flags)
        assert proc.returncode == 0, proc.stderr
        records = [json.loads(line) for line in out.read_text().splitlines()]
        texts[np_flags[1]] = {r["id"]: r["text"] for r in records}
        drafted = sum(r["stats"]["n_drafted"] for r in records)
        assert 0 < sum(r["stats"]["n_accept"] for r in records) < drafted
    assert texts["3"] == texts["1"]


@real
@pytest.mark.parametrize("arch", ["qwen35", "lfm2"])
@pytest.mark.parametrize("unified", [True, False], ids=["unified", "streams"])
@pytest.mark.parametrize("first", [(1, 0, 2), (2, 0, 1)], ids=lambda order: "".join(map(str, order)))
def test_a_slots_rollback_survives_the_batches_of_others(tiny, arch, unified, first, batch_invariant):
    """llama.cpp gathers the states of a ubatch's sequences into adjacent cells, and moves a cell
    of another sequence lying between them without its snapshots: a slot whose latest decode is
    then undone would go on from someone else's state. The slots' prompts come in an order that
    leaves the cells out of order; slot 0 decodes 9 tokens beside slots 1 and 2 decoding 5 (in
    one batch, which llama.cpp splits), or alone, before a batch of a token of each of the others
    (a draft model's slot waits for the target while the others draft). Rolled back by 3, slot 0
    goes on as a model of its own does."""
    tokens = [int(t) for t in np.random.default_rng(3).integers(10, 200, 40)]
    spec = ModelSpec(tiny(arch), arch, n_ctx=256, n_batch=256, n_threads=THREADS, n_rs_seq=8)

    def part(slot: int, start: int, end: int, outputs: str) -> Part:
        return Part(tokens[start:end], range(start, end), [(slot,)] * (end - start), outputs, slot)

    with LlamaModel(spec) as alone:
        alone.decode(tokens[:10], 0, "none")
        alone.decode(tokens[10:19], 10, "all")
        alone.trim(16)
        want = alone.decode(tokens[30:31], 16, "last")[0].copy()
    with LlamaModel(replace(spec, n_ctx=768, n_slots=3, kv_unified=unified)) as shared:
        for how in ("next batch", "one batch"):
            shared.clear()
            for slot in first:
                shared.decode_parts([part(slot, 0, 10, "none")])
            if how == "one batch":
                shared.decode_parts([part(0, 10, 19, "all"), part(1, 10, 15, "all"), part(2, 10, 15, "all")])
            else:
                shared.decode_parts([part(0, 10, 19, "all")])
                shared.decode_parts([part(1, 10, 11, "last"), part(2, 10, 11, "last")])
            shared.memory.slots[0].trim(16)
            got = shared.decode_parts([Part(tokens[30:31], [16], [(0,)], "last", 0)])[0][0]
            # a unified cache's other cells change the attention's sums in their last bits; a wrong
            # state changes logits by units
            assert np.array_equal(got, want) if not unified else np.allclose(got, want, rtol=0, atol=1e-4), \
                (how, float(np.abs(got - want).max()))


@real
@pytest.mark.parametrize("arch, unified", [("llama", True), ("llama", False), ("lfm2", True), ("mamba", True)],
                         ids=["attention unified", "attention streams", "hybrid", "recurrent"])
def test_auto_prices_the_pass_of_several_requests_for_each_memory(tiny, arch, unified, tmp_path, monkeypatch):
    """-np 3: auto's prices of a pass with one request's b tokens and one token of each of 1 and 2
    others come from one request's calibration, as llama.cpp runs such a pass for the memory: one
    batch in a unified cache, equal slices per sequence (split_equal) with streams or a recurrent
    state. Nothing is measured on the slots' sequences (every one empty after), and once the
    slots run requests nothing more is calibrated (it would decode into their sequences)."""
    monkeypatch.setenv("SPECULATE_HOME", str(tmp_path))
    spec = ModelSpec(tiny(arch), arch, n_ctx=512, n_threads=THREADS, n_rs_seq=4, n_slots=3, kv_unified=unified)
    with Engine(spec) as engine:
        auto = engine.factory.make(SpecSettings(types=("auto",), draft_max=4))
        assert [len(row) for row in auto.shared] == [6, 6]  # v_o(b) at index b, b = 1..5
        costs = engine.book.model(engine.target.identity())
        one_batch = unified and not engine.target.recurrent
        for o, row in enumerate(auto.shared, 1):
            for b in range(1, 6):
                tokens, sequences = b + o, o + 1
                ratio = costs.ratio(tokens) if one_batch else costs.ratio(sequences) + (
                    costs.ratio(tokens - sequences) if tokens > sequences else 0.0)
                assert row[b] == pytest.approx(costs.price(1) * ratio)
        assert costs.measured() == [1, 2, 3, 4, 5]  # one request's sizes, nothing of -np's
        assert len(engine.book._models) == 1
        model = engine.target
        assert all(ll.llama_memory_seq_pos_max(model._mem, s) == -1 for s in range(model.n_slots * model.n_seq))
        Parallel(engine, 3)
        assert len(engine.costs("target", 9, 3)) == 9  # sizes 6-9 priced beyond what was calibrated ...
        assert costs.measured() == [1, 2, 3, 4, 5]  # ... not measured
