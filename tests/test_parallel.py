"""Many requests at once (`batch -np N`, engine/parallel.py): each request's output is its output
alone; a shared pool of cells that runs out ends a request with finish_reason length; what
cannot run together is refused before anything loads; a batch killed with requests in flight
loses none and runs none twice.

Identity is asserted where the build and the configuration promise it: the batch-invariant
build, and separate KV streams (--no-kv-unified), so a request's cells sit where they sit alone.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from gguf import GGUFReader

from speculative.cli.options import SlotOptions
from speculative.decoding.settings import ModelSpec, SpecSettings
from tests.conftest import SMOL, speculate, speculate_here
from tests.gguf_builder import write_lora
from tests.test_batch import records, start_held

PROMPTS = ["Once upon a time", "The three primary colours are", "def fibonacci(n):", "List five fruits:",
           "The capital of France is", "Write a haiku about rain.", "import numpy as np\n", "1, 2, 3, 4,"]


def requests(tmp_path: Path, n_predicts=(24, 9, 31, 5, 17, 40, 12, 28)) -> Path:
    """Eight requests of different lengths (so they leave, and the next join, at different
    steps), the last one sampled with its own seed."""
    lines = [{"id": i, "prompt": p, "n_predict": n} for i, (p, n) in enumerate(zip(PROMPTS, n_predicts))]
    lines[-1].update(temperature=0.8, seed=7)
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def run_batch(path: Path, out: Path, *flags: str) -> dict:
    proc = speculate("batch", str(path), "-o", str(out), *flags)
    assert proc.returncode == 0, proc.stderr
    return {r["id"]: r for r in records(out)}


@pytest.fixture(scope="module")
def strong_lora(model_path, tmp_path_factory) -> str:
    """An adapter that makes SmolLM2, as a draft of itself, disagree at most positions: its
    drafts are rejected at every depth."""
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in GGUFReader(model_path(SMOL)).tensors}
    names = {f"blk.{i}.{w}.weight" for i in range(30) for w in ("attn_q", "attn_v")}
    return str(write_lora(tmp_path_factory.mktemp("lora") / "lora.gguf", {n: shapes[n] for n in names}, std=0.5))


@pytest.mark.real
@pytest.mark.parametrize("spec", [
    ("--spec-type", "none"),
    ("--spec-type", "ngram-simple", "--draft-max", "6"),
    ("--spec-type", "draft", "--draft-max", "5", "-md", "{smol}", "--lora-draft", "{lora}"),
], ids=["none", "ngram-simple", "draft rejected at every depth"])
@pytest.mark.parametrize("n", [2, 8])
def test_each_request_is_its_output_alone(model_path, tmp_path, batch_invariant, strong_lora, spec, n):
    smol = str(model_path(SMOL))
    spec = [arg.format(smol=smol, lora=strong_lora) for arg in spec]
    path = requests(tmp_path)
    alone = run_batch(path, tmp_path / "alone.jsonl", "-m", smol, "--temp", "0", *spec, "-np", "1", "-c", "512")
    together = run_batch(path, tmp_path / "together.jsonl", "-m", smol, "--temp", "0", *spec, "-np", str(n),
                         "--no-kv-unified", "-c", str(512 * n))
    assert {i: r["text"] for i, r in together.items()} == {i: r["text"] for i, r in alone.items()}
    assert all(together[i]["stats"]["n_predict"] == alone[i]["stats"]["n_predict"] for i in alone)
    if "--lora-draft" in spec:
        drafted = sum(r["stats"]["n_drafted"] for r in together.values())
        assert 0 < sum(r["stats"]["n_accept"] for r in together.values()) < drafted  # rejections happened


@pytest.mark.real
def test_draft_trees_run_in_each_slot(model_path, tmp_path):
    """Each slot's draft-tree branches are sequences of its own in the unified pool: every
    request completes, with branched steps verified (what the cells' placement does to the
    last bits is not asserted here)."""
    smol = str(model_path(SMOL))
    got = run_batch(requests(tmp_path), tmp_path / "out.jsonl", "-m", smol, "-md", smol, "--temp", "0",
                    "--spec-type", "draft", "--draft-max", "4", "--draft-branches", "3", "-np", "3")
    assert sorted(got) == list(range(len(PROMPTS))) and all("error" not in r for r in got.values())
    assert sum(r["stats"]["n_predict"] for r in got.values()) > 100
    assert sum(r["stats"]["tree_steps"] for r in got.values()) > 0


@pytest.mark.real
def test_a_pool_without_cells_left_ends_the_request_that_cannot_get_one(model_path, tmp_path):
    """-c 256 shared by 4 requests that each fit alone (about 10 + 200 tokens) but not together:
    those that find no cell left end with finish_reason length, every request is recorded, none
    fails."""
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(PROMPTS[:4])))
    out = tmp_path / "out.jsonl"
    got = run_batch(path, out, "-m", str(model_path(SMOL)), "--temp", "0", "--spec-type", "none", "-c", "256",
                    "-n", "200", "--ignore-eos", "-np", "4", "-kvu")
    assert sorted(got) == [0, 1, 2, 3] and all("error" not in r for r in got.values())
    assert all(r["finish_reason"] == "length" for r in got.values())
    cut = [r for r in got.values() if r["stats"]["n_predict"] < 200]
    assert cut, "four requests of 200 tokens fitted in 256 cells"
    assert sum(r["stats"]["n_prompt"] + r["stats"]["n_predict"] for r in got.values()) <= 256 + 4


@pytest.mark.parametrize("parallel, kv_unified, branches, unified", [
    (-1, None, 1, True), (4, None, 1, False), (1, None, 1, False), (4, None, 3, True),
    (4, True, 1, True), (-1, False, 1, False),
])
def test_the_kv_cache_is_unified_as_llama_server_makes_it_unless_asked(parallel, kv_unified, branches, unified):
    """llama-server: one pool with -np -1 (auto), -c / N cells each with -np N; draft trees need the pool."""
    slots = SlotOptions(parallel, kv_unified).for_spec(SpecSettings(branches=branches, types=("draft",)))
    assert slots.kv_unified is unified and slots.apply(ModelSpec(Path("t.gguf"), "t")).kv_unified is unified


@pytest.mark.parametrize("command", ["batch", "serve"])
@pytest.mark.parametrize("flags, message", [
    (("-np", "0"), "-np/--parallel must be >= 1, or -1 (auto: 4), got 0"),
    (("-np", "-2"), "-np/--parallel must be >= 1, or -1 (auto: 4), got -2"),
    (("-np", "128", "--draft-branches", "3"), "-np 128 requests with --draft-branches 3 each need 384 sequences"),
    (("--no-kv-unified", "--draft-branches", "2"), "--no-kv-unified: draft trees (--draft-branches > 1) need"),
    (("--prefill-budget", "-1"), "--prefill-budget must be a number of milliseconds >= 0"),
    (("-sps", "1.5"), "-sps/--slot-prompt-similarity must be in [0, 1]"),
])
def test_what_cannot_run_together_is_refused_before_anything_loads(tmp_path, command, flags, message):
    if command == "batch" and flags[0] == "--prefill-budget":  # nothing streams there
        message = "--prefill-budget is a flag of `speculate serve`, not of `speculate batch`"
    args = ["batch", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")] if command == "batch" else ["serve"]
    proc = speculate_here(*args, "-m", "/nonexistent.gguf", "--spec-type", "draft", "-md", "/nonexistent.gguf", *flags)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.real
def test_a_context_that_cannot_be_made_for_n_sequences_fails_at_start_in_one_line(model_path, tmp_path):
    path = requests(tmp_path)
    proc = speculate("batch", str(path), "-o", str(tmp_path / "out.jsonl"), "-m", str(model_path(SMOL)),
                     "-c", "50000000", "-np", "8", "--spec-type", "none")
    assert proc.returncode == 3, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "could not create a context (n_ctx=50000000, 8 parallel sequences): " in line and "alloc" in line
    assert "Traceback" not in proc.stderr and not (tmp_path / "out.jsonl").read_text()


@pytest.mark.real
def test_a_batch_killed_with_requests_in_flight_loses_none_and_runs_none_twice(model_path, tmp_path):
    """-np 2: request 3 is held after its first piece (the other slot then waits on it), the
    batch is killed; the rerun runs the requests in flight again and those recorded not at all."""
    path = requests(tmp_path)
    flags = ("-m", str(model_path(SMOL)), "--temp", "0", "--spec-type", "ngram-simple", "-np", "2",
             "--no-kv-unified", "-c", "1024")
    whole = run_batch(path, tmp_path / "whole.jsonl", *flags)
    out = tmp_path / "out.jsonl"
    killed = start_held(path, out, flags, request="3")
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    before = records(out)
    assert 3 not in {r["id"] for r in before} and len(before) < len(PROMPTS)
    rerun = speculate("batch", str(path), "-o", str(out), *flags)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{len(before)} already in" in rerun.stderr
    after = records(out)
    assert after[:len(before)] == before and sorted(r["id"] for r in after) == list(range(len(PROMPTS)))
    assert {r["id"]: r["text"] for r in after} == {i: r["text"] for i, r in whole.items()}
