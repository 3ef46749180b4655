"""speculate batch: reading requests, the results file, and a real batch killed and resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from speculative.decoding.settings import SamplerSettings, SpecSettings
from speculative.engine.text import StopFilter
from speculative.errors import UsageError
from speculative.llamacpp import interrupt
from speculative.serving import batch
from speculative.serving.batch import Rejected, Request, Results
from tests.conftest import SMOL, SPECULATE, probe_command, speculate, speculate_json

SAMPLING = SamplerSettings(temp=0.0, seed=5)
SPEC = SpecSettings(types=("none",), n_predict=7)


def read(tmp_path, *lines: bytes | str) -> list:
    path = tmp_path / "requests.jsonl"
    path.write_bytes(b"".join((line.encode() if isinstance(line, str) else line) + b"\n" for line in lines))
    return batch.read_requests(path, SAMPLING, SPEC)


def test_requests_take_the_flags_as_defaults_and_override_them(tmp_path):
    messages = [{"role": "user", "content": "hi"}]
    a, b = read(tmp_path, '{"id": "a", "prompt": "x"}', "   ",
                json.dumps({"id": 7, "messages": messages, "n_predict": 3, "temperature": 0.5, "top_p": 0.9,
                            "seed": 11, "stop": "\n"}))
    assert a == Request("a", 1, "x", None, SAMPLING, SPEC)
    assert (b.id, b.line, b.messages, b.stop) == (7, 3, messages, ("\n",))
    assert (b.sampling.temp, b.sampling.top_p, b.sampling.seed, b.spec.n_predict) == (0.5, 0.9, 11, 3)
    assert b.sampling.top_k == SAMPLING.top_k and b.spec.types == SPEC.types


def test_lines_that_are_not_requests_say_why_with_their_line_number(tmp_path):
    items = read(tmp_path, '{"id": "a", "prompt": "x"}', "{oops", b'{"id": "b", "prompt": "\xff"}',
                 '{"id": "a", "prompt": "again"}', '{"id": "c", "prompt": "\\ud800"}', '["a list"]',
                 '{"prompt": "no id"}', '{"id": true, "prompt": "x"}', '{"id": "d"}',
                 '{"id": "e", "prompt": "x", "temperature": -1}', '{"id": "f", "prompt": "x", "stop": [""]}',
                 '{"id": "g", "prompt": "x", "temp": 0}', '{"id": 1, "prompt": "x"}', '{"id": "1", "prompt": "x"}')
    assert isinstance(items[0], Request) and isinstance(items[-1], Request) and isinstance(items[-2], Request)
    errors = {item.line: (item.id, item.error) for item in items[1:-2]}
    assert errors == {
        2: (None, "not JSON (Expecting property name enclosed in double quotes at column 2)"),
        3: (None, "not valid UTF-8 (byte 23)"),
        4: (None, 'duplicate id "a" (first on line 1)'),
        5: (None, "not valid UTF-8 (a lone surrogate escape)"),
        6: (None, "not a JSON object"),
        7: (None, "needs an `id`: a non-empty string or an integer"),
        8: (None, "needs an `id`: a non-empty string or an integer"),
        9: ("d", "needs a string `prompt` or a list of chat `messages`"),
        10: ("e", "`temperature` must be a number >= 0, got -1"),
        11: ("f", '`stop` must be a non-empty string or a list of them, got [""]'),
        12: ("g", "unknown field 'temp' (known: id, prompt, messages, n_predict, temperature, top_p, seed, stop, grammar, json_schema)"),
    }


def test_numbers_and_nesting_python_cannot_take_are_lines_that_are_not_requests(tmp_path):
    huge = "1" + "0" * 400  # an integer literal: no float holds it
    items = read(tmp_path, '{"id": "a", "prompt": "x"}', '{"id": 1%s, "prompt": "x"}' % ("0" * 5000),
                 "[" * 100000 + "]" * 100000, '{"id": "d", "prompt": "x", "stop": %s}' % ("[" * 70 + "]" * 70),
                 '{"id": "t", "prompt": "x", "temperature": %s}' % huge, '{"id": "z", "prompt": "y"}')
    assert [item.id for item in items if isinstance(item, Request)] == ["a", "z"]
    errors = {item.line: (item.id, item.error) for item in items if isinstance(item, Rejected)}
    assert errors == {
        2: (None, "not usable JSON (a number over 4300 digits)"),
        3: (None, "not usable JSON (nested over 64 levels deep)"),
        4: (None, "not usable JSON (nested over 64 levels deep)"),
        5: ("t", f"`temperature` must be a number >= 0, got {huge[:80]}..."),
    }
    out = tmp_path / "results.jsonl"
    results = Results(out)
    summary = batch.run_batch(None, [item for item in items if isinstance(item, Rejected)], results)
    results.close()
    assert summary.failed == 4 and [r["line"] for r in records(out)] == [2, 3, 4, 5]


def test_an_over_long_line_is_refused_unread(tmp_path, monkeypatch):
    monkeypatch.setattr(batch, "MAX_LINE_BYTES", 64)
    items = read(tmp_path, json.dumps({"id": "long", "prompt": "x" * 200}), '{"id": "next", "prompt": "y"}')
    assert items[0] == Rejected(1, None, "line longer than 64 bytes")
    assert items[1].id == "next" and items[1].line == 2


def test_results_resume_after_a_half_written_line_and_refuse_other_files(tmp_path):
    path = tmp_path / "results.jsonl"
    done = {"id": "a", "line": 1, "text": "t", "finish_reason": "stop", "stats": {}}
    failed = {"id": None, "line": 2, "finish_reason": "error", "error": "not JSON"}
    path.write_text(json.dumps(done) + "\n" + json.dumps(failed) + "\n" + '{"id": "b", "line": 3, "te')
    notices = []
    results = Results(path, notices.append)
    assert notices == [f"{path}: dropped a half-written last line (26 bytes)"]
    assert results.recorded(Request("a", 1, "p", None, SAMPLING, SPEC)) is True
    assert results.recorded(Rejected(2, None, "x")) is False
    assert results.recorded(Request("b", 3, "p", None, SAMPLING, SPEC)) is None
    with pytest.raises(UsageError, match="in use by another speculate batch"):
        Results(path)
    results.append({"id": "b", "line": 3, "finish_reason": "error", "error": "e"})
    results.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line)["line"] for line in lines] == [1, 2, 3]

    other = tmp_path / "notes.txt"
    other.write_text("my notes\n")
    with pytest.raises(UsageError, match="not a speculate batch result"):
        Results(other)
    assert other.read_text() == "my notes\n"


@pytest.mark.parametrize("content", [
    b"my notes\nno newline at the end", b'{"note": "one JSON line, no newline"}', b'{"id": 1}', b"{oops",
    b'{"id": "a", "line": 1}\nnotes after a record', b'{"id": "a", "line": 1}\n{"id": "b", "line": 2}\n\n{"note": 1',
    b'{"id": "a", "line": 1}\nmy notes\n{"id": "b", "li'])
def test_a_file_without_a_final_newline_that_is_not_results_is_refused_untouched(tmp_path, content):
    other = tmp_path / "notes.txt"
    other.write_bytes(content)
    with pytest.raises(UsageError, match="not a speculate batch result"):
        Results(other)
    assert other.read_bytes() == content


@pytest.mark.parametrize("tail", [b"{", b'{"i', b'{"id": ', b'{"id": "b", "line": 2, "text": "x"}'])
def test_a_last_line_cut_anywhere_is_dropped(tmp_path, tail):
    path = tmp_path / "results.jsonl"
    path.write_bytes(b'{"id": "a", "line": 1}\n' + tail)
    Results(path).close()
    assert path.read_bytes() == b'{"id": "a", "line": 1}\n'


def test_the_summary_and_the_results_never_replace_the_requests_or_each_other(tmp_path):
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"id": "a", "prompt": "x"}\n')
    out = tmp_path / "[red] [" / "x].jsonl"  # ".../[red] [/x].jsonl": Rich markup, and a bad one
    out.parent.mkdir()
    out.write_text('{"id": "a", "line": 1, "finish_reason": "error", "error": "e"}\n')
    (tmp_path / "link.jsonl").symlink_to(requests)
    before = {path: path.read_bytes() for path in (requests, out)}
    for args, error in ((("-o", str(tmp_path / "link.jsonl")), "-o/--output must not be the requests file"),
                        (("-o", str(out), "--summary", str(out)), "--summary must not be the -o/--output file"),
                        (("-o", str(out), "--summary", str(tmp_path / "link.jsonl")),
                         "--summary must not be the requests file")):
        proc = speculate("batch", str(requests), *args)
        assert (proc.returncode, proc.stderr) == (2, f"speculate: error: {error}\n")
    assert {path: path.read_bytes() for path in before} == before

    with open(out, "ab") as f:
        f.write(b'{"id": "a", "li')
    proc = speculate("batch", str(requests), "-o", str(out))  # nothing to run: no model is loaded
    assert proc.returncode == 1 and f"{out}: dropped a half-written last line (15 bytes)\n" in proc.stderr
    assert out.read_bytes() == before[out]


def test_stop_strings_are_cut_even_across_pieces():
    stops = StopFilter(["</s>", "\n\n"])
    assert [stops.push(p) for p in ("Hello <", "/", "b> x", "\n", "\nafter")] == ["Hello ", "", "</b> x", "", ""]
    assert stops.stopped and stops.flush() == ""
    unstopped = StopFilter(["STOP"])
    assert unstopped.push("a ST") + unstopped.flush() == "a ST" and not unstopped.stopped


def test_success_needs_every_request_recorded_without_error():
    summary = batch.Summary(requests=3, earlier_succeeded=1)
    summary.add({"stats": {"n_prompt": 5, "n_cached": 2, "n_predict": 4, "n_drafted": 2, "n_accept": 1,
                           "t_encode_s": 0.1, "t_decode_s": 0.5}})
    assert not summary.all_succeeded and summary.remaining == 1
    summary.add({"error": "x"})
    assert not summary.all_succeeded and summary.remaining == 0
    s = summary.to_dict()
    assert (s["accept_rate"], s["cached_share"], s["decode_tps"]) == (0.5, 0.4, 8.0)


def test_a_signal_while_a_record_is_written_stops_the_batch_with_that_record_counted(tmp_path, monkeypatch):
    """SIGTERM as the second record reaches the disk (in its fsync, after the line is in the file,
    where a test watching the file would send it): the summary counts what the file holds."""
    out = tmp_path / "results.jsonl"
    results = Results(out)
    synced, fsync = [], os.fsync

    def fsync_then_sigterm(fd: int) -> None:
        fsync(fd)
        synced.append(fd)
        if len(synced) == 2:
            signal.raise_signal(signal.SIGTERM)  # its handler runs here, before append returns

    monkeypatch.setattr(batch.os, "fsync", fsync_then_sigterm)
    previous = signal.signal(signal.SIGTERM, interrupt._handler)  # as `speculate` installs it
    try:
        summary = batch.run_batch(None, [Rejected(line, None, "not JSON") for line in range(1, 6)], results)
    finally:
        signal.signal(signal.SIGTERM, previous)
        results.close()
    assert summary.interrupted and len(records(out)) == 2
    assert (summary.failed, summary.remaining) == (2, 3)


# -- real models ---------------------------------------------------------------

SYSTEM = "You are a concise assistant. Answer in one short sentence."
QUESTIONS = ["What is the capital of France?", "Why is the sky blue?", "What is 2 + 2?", "Name a prime number.",
             "What colour is grass?", "Who wrote Hamlet?", "What is water made of?", "How many legs has a cat?",
             "What is the largest planet?", "What do bees make?", "Name a metal.", "What is ice?",
             "Where is Tokyo?", "What is a noun?", "Name an ocean."]
COUNT = "Count: one, two,"  # request "s", sampled


def requests_file(tmp_path, stop: str):
    """20 requests (15 chats sharing a system prompt, 5 prompts, the last sampled and ended
    by `stop`), a malformed line and a duplicate id."""
    lines = [json.dumps({"id": f"q{i}", "messages": [{"role": "system", "content": SYSTEM},
                                                      {"role": "user", "content": q}]})
             for i, q in enumerate(QUESTIONS, 1)]
    lines += [json.dumps({"id": f"p{i}", "prompt": f"Item {i} of a list of fruits:", "n_predict": 6 + i})
              for i in range(1, 5)]
    lines.append(json.dumps({"id": "s", "prompt": COUNT, "temperature": 0.8, "seed": 3, "stop": [stop]}))
    lines.insert(5, '{"id": "broken", "prompt": ')
    lines.insert(9, json.dumps({"id": "q3", "prompt": "a second q3"}))
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, {f"q{i}" for i in range(1, 16)} | {f"p{i}" for i in range(1, 5)} | {"s"}


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def start_held(requests, out, flags, request: str) -> subprocess.Popen:
    """`speculate batch REQUESTS -o OUT FLAGS` under tests/probe.py, returned once the request
    whose id is `request` (as JSON) has generated its first piece of text: it waits there for a
    signal (the requests before it are recorded, it is not)."""
    env = {**os.environ, "PROBE_PIECES": "1", "PROBE_REQUEST": request}
    proc = subprocess.Popen(probe_command("batch", str(requests), "-o", str(out), *flags),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    seen = []
    while not (line := proc.stderr.readline()).startswith("probe: 1 pieces"):
        if not line:
            proc.wait()
            pytest.fail(f"the batch ended (exit {proc.returncode}) before request {request} ran: {''.join(seen)}")
        seen.append(line)
    return proc


@pytest.mark.real
def test_a_batch_killed_and_resumed_equals_an_uninterrupted_one(model_path, tmp_path, batch_invariant):
    flags = ("-m", str(model_path(SMOL)), "--spec-type", "ngram-simple", "--temp", "0", "-n", "12", "-np", "1")
    # A stop string from what request "s" says without one: which words a sampled answer
    # has depends on the CPU's kernels ("five" may never come).
    alone = speculate_json(*flags, "-p", COUNT, "--temp", "0.8", "--seed", "3")["text"]
    assert len(alone) >= 2, alone
    stop = alone[len(alone) // 2:][:4]
    requests, ids = requests_file(tmp_path, stop)
    full = tmp_path / "full.jsonl"
    proc = speculate("batch", str(requests), "-o", str(full), "--summary", str(tmp_path / "s.json"), *flags)
    assert proc.returncode == 1, proc.stderr  # two lines are not requests
    expected = {r["id"]: r for r in records(full) if r["id"] is not None}
    assert set(expected) == ids and all("error" not in r for r in expected.values())
    errors = [r for r in records(full) if r["id"] is None]
    assert [(r["line"], r["error"].split(" (")[0]) for r in errors] == [(6, "not JSON"), (10, 'duplicate id "q3"')]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert (summary["succeeded"], summary["failed"], summary["all_succeeded"]) == (20, 2, False)
    # Each chat after the first keeps the shared system prompt from the request before.
    assert all(expected[f"q{i}"]["stats"]["n_cached"] > 0 for i in range(2, 16))
    assert summary["n_cached"] == sum(r["stats"]["n_cached"] for r in expected.values()) > 0
    assert expected["s"]["finish_reason"] == "stop" and expected["s"]["text"] == alone[:alone.index(stop)]
    assert "kept in the cache from the request before" in proc.stderr

    out = tmp_path / "resumed.jsonl"
    killed = start_held(requests, out, flags, request='"q9"')  # held in q9 (line 11), after the 10 lines before it
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert out.read_text().count("\n") == 10
    with open(out, "ab") as f:  # as if killed in the middle of writing the next line
        f.write(b'{"id": "q9", "line": 1')

    rerun = speculate("batch", str(requests), "-o", str(out), *flags)
    assert rerun.returncode == 1 and "dropped a half-written last line" in rerun.stderr
    got = records(out)
    assert sorted(r["id"] for r in got if r["id"] is not None) == sorted(ids)  # exactly one each
    assert sorted(r["line"] for r in got if r["id"] is None) == [6, 10]
    assert {r["id"]: r["text"].encode() for r in got if r["id"]} == {i: r["text"].encode() for i, r in expected.items()}

    again = speculate("batch", str(requests), "-o", str(out), *flags)  # nothing left: no model is loaded
    assert again.returncode == 1 and "0 to run" in again.stderr and records(out) == got


@pytest.mark.real
def test_a_failing_request_is_recorded_and_sigterm_stops_the_batch_resumably(model_path, tmp_path):
    path = tmp_path / "requests.jsonl"
    lines = [{"id": "long", "prompt": "word " * 400}, {"id": 1, "prompt": "Once upon a time", "n_predict": 4},
             *({"id": i, "prompt": f"Story {i}: once upon a time"} for i in range(2, 6))]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "results.jsonl"
    args = [SPECULATE, "batch", str(path), "-o", str(out), "-m", str(model_path(SMOL)), "-c", "256",
            "--spec-type", "none", "--temp", "0", "--ignore-eos", "-n", "200"]
    proc = start_held(path, out, [*args[5:], "-np", "1"], request="2")  # request 2 is generating, held there
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)  # a guard against a hang only
    assert proc.returncode == 130, err
    assert "interrupted, 4 left: rerun the same command to resume" in err
    long, first = records(out)
    assert long["line"] == 1 and "the prompt has" in long["error"] and "context holds 256" in long["error"]
    assert first["id"] == 1 and first["finish_reason"] == "length" and first["stats"]["n_predict"] == 4

    rerun = speculate(*args[1:-2], "-n", "4")  # the defaults may change between runs: -n for a quick test
    assert rerun.returncode == 1  # the long prompt failed, in the run before
    assert "4 succeeded, 0 failed (and 1 succeeded, 1 failed in earlier runs)" in rerun.stderr
    ids = [r["id"] for r in records(out)]  # the rerun's, -np 4 at once, as each finished
    assert ids[:2] == ["long", 1] and sorted(ids[2:]) == [2, 3, 4, 5]
