"""The pool of earlier outputs (speculative/drafters/pool.py): drafting from it, its bound, its file
(atomic, merged, damaged or foreign files), and the commands that keep one: speculate with
--spec-pool FILE across processes, batch across requests, bench without a run drafting from
its own configuration's output."""

from __future__ import annotations

import json
import select
import subprocess
import sys

import pytest

from speculative.decoding.drafter import AGREED
from speculative.drafters.pool import MAGIC, Pool, PoolDrafter, PoolFile, check_pool_file, fingerprint
from speculative.errors import UsageError
from speculative.files import locked

from .conftest import SMOL, plant_costs, speculate, speculate_json

A = fingerprint([b"a", b"b"], "gpt2", 1, 2)
B = fingerprint([b"a", b"c"], "gpt2", 1, 2)


def output(start: int, n: int = 40) -> list[int]:
    return list(range(start, start + n))


def test_the_pool_proposes_what_followed_the_longest_match():
    pool = Pool(n=4)
    pool.add([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    drafter = PoolDrafter(pool)
    assert drafter.propose([50, 1, 2, 3, 4, 5], 3).tokens == [6, 7, 8]  # one earlier output: its continuation
    assert drafter.propose([7, 7, 7, 7], 5).tokens == []  # no earlier output has it
    assert not PoolDrafter(Pool()).can_draft([1, 2, 3])


def test_several_earlier_outputs_are_drafted_only_as_far_as_they_agree():
    pool = Pool(n=4)
    pool.add([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    pool.add([9, 9, 2, 3, 4, 5, 6, 7, 8, 70, 71, 72])   # the same skeleton, another value after 8
    pool.add([8, 8, 2, 3, 4, 5, 60, 61, 62, 63, 64, 65])
    draft = PoolDrafter(pool).propose([50, 1, 2, 3, 4, 5], 6)  # longest match: the first output
    assert draft.tokens == [6, 7, 8] and draft.kind == AGREED and draft.source == "ngram-pool"
    assert PoolDrafter(pool).propose([8, 8, 2, 3, 4, 5], 6).tokens == []  # nobody else goes on 60, 61


def test_the_pool_keeps_its_bound_and_forgets_the_oldest_first():
    pool = Pool(n=4, max_tokens=100)
    for i in range(10):
        pool.add(output(1000 * i))
    assert pool.tokens <= 100 and len(pool) == 2
    assert pool.occurrences(output(0)[:4]) == []  # the oldest went, and its index entries too
    assert PoolDrafter(pool).propose(output(9000)[:10], 4).tokens == output(9000)[10:14]
    pool.add([1, 2, 3])  # too short to teach anything
    assert len(pool) == 2


def test_a_pool_file_round_trips_and_merges_what_two_processes_saved(tmp_path):
    path = tmp_path / "pool"
    notices: list[str] = []
    first, second = Pool(), Pool()
    one, two = PoolFile(path, A, notices.append), PoolFile(path, A, notices.append)
    one.load(first)
    two.load(second)  # both started from an empty file, as two shell jobs in parallel
    first.add(output(100))
    second.add(output(200))
    one.save(first)
    two.save(second)
    merged = Pool()
    PoolFile(path, A, notices.append).load(merged)
    assert list(merged.outputs) == [output(100), output(200)] and notices == []
    assert path.read_bytes().startswith(MAGIC)
    bounded = Pool(max_tokens=50)
    bounded.add(output(300))
    PoolFile(path, A, notices.append).save(bounded)  # the file keeps the newest within the bound
    kept = Pool()
    PoolFile(path, A, notices.append).load(kept)
    assert list(kept.outputs) == [output(300)]


SAVER = """
import sys
from pathlib import Path
from speculative.drafters.pool import Pool, PoolFile
path, tokenizer, start = Path(sys.argv[1]), bytes.fromhex(sys.argv[2]), int(sys.argv[3])
pool = Pool()
pool.add(list(range(start, start + 40)))
PoolFile(path, tokenizer, lambda message: print(message, file=sys.stderr, flush=True)).save(pool)
"""


def test_savers_that_find_the_pool_file_locked_wait_and_merge_what_each_saved(tmp_path):
    """The test holds the file's lock; two processes save meanwhile: each says it waits (an
    event, seen before the lock goes), and once released both outputs are in the file, with
    what it held before."""
    path = tmp_path / "pool"
    earlier = Pool()
    earlier.add(output(100))
    PoolFile(path, A, print).save(earlier)
    before = path.read_bytes()
    with locked(path):
        savers = [subprocess.Popen([sys.executable, "-c", SAVER, str(path), A.hex(), str(start)],
                                   stderr=subprocess.PIPE, text=True) for start in (200, 300)]
        for saver in savers:
            ready, _, _ = select.select([saver.stderr], [], [], 120)  # a guard against a hang only
            line = saver.stderr.readline() if ready else "(nothing in 120 s)"
            assert "another process is saving it; waiting" in line, line
        assert path.read_bytes() == before  # neither wrote past the lock
    for saver in savers:
        assert saver.wait(timeout=120) == 0, saver.stderr.read()
    merged = Pool()
    PoolFile(path, A, print).load(merged)
    assert list(merged.outputs)[0] == output(100)
    assert sorted(merged.outputs) == [output(100), output(200), output(300)]


def test_a_damaged_pool_file_is_ignored_with_a_notice_and_rewritten(tmp_path):
    path = tmp_path / "pool"
    pool = Pool()
    pool.add(output(100))
    PoolFile(path, A, print).save(pool)
    data = path.read_bytes()
    for damaged in (data[:-5], data[:20], data[:60] + bytes([data[60] ^ 1]) + data[61:]):
        path.write_bytes(damaged)
        notices: list[str] = []
        fresh = Pool()
        file = PoolFile(path, A, notices.append)
        file.load(fresh)
        assert len(fresh) == 0 and len(notices) == 1 and "ignored" in notices[0]
        fresh.add(output(500))
        file.save(fresh)
        again = Pool()
        PoolFile(path, A, notices.append).load(again)
        assert list(again.outputs) == [output(500)]


def test_another_tokenizers_pool_is_neither_used_nor_overwritten(tmp_path):
    path = tmp_path / "pool"
    pool = Pool()
    pool.add(output(100))
    PoolFile(path, A, print).save(pool)
    before = path.read_bytes()
    notices: list[str] = []
    other = Pool()
    file = PoolFile(path, B, notices.append)
    file.load(other)
    assert len(other) == 0 and "another tokenizer" in notices[0]
    other.add(output(700))
    file.save(other)
    assert path.read_bytes() == before


def test_a_file_that_is_not_a_pool_is_refused_before_anything_loads(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    with pytest.raises(UsageError, match="not a speculate pool file; refusing to overwrite it"):
        check_pool_file(notes)
    with pytest.raises(UsageError, match="no directory"):
        check_pool_file(tmp_path / "missing" / "pool")
    check_pool_file(tmp_path / "new-pool")  # a new file is fine


# -- the commands ---------------------------------------------------------------------------

PROMPT = "List the numbers from 1 to 30, one per line, as words:"
FLAGS = ("-n", "48", "--temp", "0", "-t", "1")


@pytest.fixture
def flat_costs(model_path, tmp_path) -> dict:
    """The environment of a speculate home whose book of costs says a batch of any size costs as
    much as one token, and less than this machine ever takes: whether auto drafts from a proposal
    then does not depend on costs measured under whatever load there is."""
    env = {"SPECULATE_HOME": str(tmp_path / "home")}
    proc = speculate("-m", str(model_path(SMOL)), "-p", "hi", "-n", "1", "--temp", "0", "-t", "1", env=env)
    assert proc.returncode == 0 and "calibrating" in proc.stderr, proc.stderr
    plant_costs(tmp_path / "home", lambda identity, b: 1e-4)
    return env


@pytest.mark.real
def test_separate_runs_draft_from_what_earlier_runs_wrote(model_path, tmp_path, batch_invariant, flat_costs):
    model = str(model_path(SMOL))
    pool = tmp_path / "runs.pool"
    alone = speculate_json("-m", model, "-p", PROMPT, *FLAGS, "--spec-type", "none")
    first = speculate_json("-m", model, "-p", PROMPT, *FLAGS, "--spec-pool", str(pool), env=flat_costs)
    assert pool.is_file() and not any(p["drafter"] == "ngram-pool" for p in first["plans"])
    second = speculate_json("-m", model, "-p", PROMPT, *FLAGS, "--spec-pool", str(pool), env=flat_costs)
    pooled = [p for p in second["plans"] if p["drafter"] == "ngram-pool"]
    assert pooled and second["n_accept"] > 0
    assert first["text"] == second["text"] == alone["text"]
    explicit = speculate_json("-m", model, "-p", PROMPT, *FLAGS, "--spec-pool", str(pool),
                              "--spec-type", "ngram-pool")
    assert explicit["text"] == alone["text"] and explicit["n_drafted"] > 0
    refused = speculate("-m", model, "-p", PROMPT, "--spec-pool", str(pool), "--spec-pool-tokens", "0")
    assert refused.returncode == 2 and "--spec-pool-tokens must be > 0" in refused.stderr


@pytest.mark.real
def test_a_batch_drafts_from_its_earlier_requests(model_path, tmp_path, flat_costs):
    model = str(model_path(SMOL))
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"id": i, "prompt": PROMPT}) + "\n" for i in range(3)))

    def plans(*flags: str) -> list[list[str]]:
        out = tmp_path / f"out{len(flags)}.jsonl"
        # one at a time: each request starts after the one before has added its output to the pool
        proc = speculate("batch", str(requests), "-o", str(out), "-m", model, *FLAGS, "-np", "1", *flags,
                         env=flat_costs)
        assert proc.returncode == 0, proc.stderr
        records = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["id"])
        return [[p["drafter"] for p in r["stats"]["plans"]] for r in records]

    pooled = plans()
    assert "ngram-pool" not in pooled[0] and all("ngram-pool" in p for p in pooled[1:])
    assert not any("ngram-pool" in p for p in plans("--spec-pool-tokens", "0"))


@pytest.mark.real
def test_bench_runs_never_draft_from_their_own_prompts_output(model_path, tmp_path, flat_costs):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": PROMPT}) + "\n" for i in range(2)))
    out = tmp_path / "bench.json"
    proc = speculate("bench", str(prompts), "-m", str(model_path(SMOL)), "-C", "auto", "--repeat", "2", "-n", "32",
                     "-t", "1", "-o", str(out), env=flat_costs)
    assert proc.returncode == 0, proc.stderr
    runs = [r for r in json.loads(out.read_text())["runs"] if r["config"] == "auto"]
    pooled = {r["prompt"]: [p for p in r["plans"] if p["drafter"] == "ngram-pool"] for r in runs}
    assert pooled["p0"] == []  # both repeats of the first prompt: the pool was empty before it
    assert pooled["p1"]        # the second prompt drafts from the first prompt's output
