"""The `agent` scenario without a model: its sessions are real modules with edits that name them,
each turn sends the history an agent would (the file read into a tool message, each rewrite's
call as its arguments, the next edit), a call that is not the one asked for ends the session,
the sums are aggregate speeds, and a whole run against a fake `speculate serve` and a fake
llama-server starts each server as it should and reads back what each answers."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.bench.agent import (CALL_TAGS, GOALS, SESSIONS, SYSTEM, TOOLS, call_grammar, goals, grammar_call,
                                 kept_lines, load_sessions, play, session_kinds, summarise_agent, the_call)
from scripts.bench.conversation import CONFIGS
from scripts.tables import agent, agent_totals
from tests.test_bench_conversation import SERVED, fake
from speculative.grammar.gbnf import check

ROOT = Path(__file__).resolve().parent.parent
NAMES = [c.name for c in CONFIGS]


def test_the_sessions_are_real_python_modules_with_edits_that_name_them():
    sessions = load_sessions()  # raises on a malformed line
    assert len(sessions) >= 3 and len({s["id"] for s in sessions}) == len(sessions)
    for s in sessions:
        assert 60 <= len(s["text"].splitlines()) <= 150, s["id"]
        ast.parse(s["text"], s["path"])  # a module that compiles
        assert s["path"].endswith(".py") and s["text"].endswith("\n")
        assert 2 <= len(s["edits"]) <= 3 and all(s["path"] in e for e in s["edits"])
        assert session_kinds(s) == ["read"] + ["rewrite"] * len(s["edits"])


@pytest.mark.parametrize("session, said", [
    ({"id": "x", "path": "a.py", "text": "pass\n", "edits": ["Change b.py."]}, "every edit must be a message naming a.py"),
    ({"id": "x", "path": "a.py", "edits": ["Change a.py."]}, "needs an id, a path, the file's text and edits"),
    ({"id": "x", "path": "a.py", "text": "pass\n", "edits": []}, "needs an id, a path, the file's text and edits"),
])
def test_a_malformed_session_is_refused(tmp_path, session, said):
    bad = tmp_path / "sessions.jsonl"
    bad.write_text(json.dumps(session) + "\n")
    with pytest.raises(ValueError, match=said):
        load_sessions(bad)


def test_sessions_are_picked_by_id_in_the_order_given_and_an_unknown_id_is_named():
    ids = [s["id"] for s in load_sessions()]
    assert [s["id"] for s in load_sessions(SESSIONS, ids[::-1])] == ids[::-1]
    with pytest.raises(ValueError, match="no session nope"):
        load_sessions(SESSIONS, [ids[0], "nope"])


# -- a session's turns, against a fake server ------------------------------------------

SESSION = {"id": "s", "path": "m.py", "text": "x = 1\n", "edits": ["In m.py, one.", "In m.py, two.", "In m.py, three."]}


def answer(message: dict, finish: str = "stop", tokens: int = 10) -> dict:
    return {"choices": [{"index": 0, "finish_reason": finish, "message": {"role": "assistant", **message}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": tokens},
            "timings": {"predicted_n": tokens, "predicted_ms": 100.0, "prompt_n": 5, "cache_n": 0}}


def called(name: str, arguments: dict, call_id: str = "server-id") -> dict:
    return {"content": None, "tool_calls": [{"id": call_id, "type": "function",
                                             "function": {"name": name, "arguments": json.dumps(arguments)}}]}


class FakeServer:
    """Answers each turn with the call the request names, the file rewritten with the turn's number."""

    def __init__(self, calls: str = "tools"):
        self.bodies, self.calls = [], calls

    def __call__(self, body: dict) -> dict:
        self.bodies.append(json.loads(json.dumps(body)))  # as sent, not as later changed
        n = len(self.bodies)
        name = "read_file" if n == 1 else "write_file"
        arguments = {"path": "m.py", **({"content": f"x = {n}\n"} if n > 1 else {})}
        if self.calls == "tools":
            return answer(called(name, arguments, f"drawn-{n}"))
        return answer({"content": CALL_TAGS[0] + json.dumps({"name": name, "arguments": arguments}) + CALL_TAGS[1]})


def test_each_turn_sends_the_history_an_agent_would_with_the_turns_tool_named():
    server = FakeServer()
    run = play(SESSION, server, 64)
    assert run["ended"] is None and len(run["turns"]) == 4 == len(server.bodies)
    for body, tool in zip(server.bodies, ["read_file", "write_file", "write_file", "write_file"]):
        assert body["tool_choice"] == {"type": "function", "function": {"name": tool}}
        assert body["tools"] == TOOLS and body["parallel_tool_calls"] is False and "grammar" not in body
        assert body["temperature"] == 0 and body["max_tokens"] == 64 and body["cache_prompt"] is True
    first, second, third, fourth = (b["messages"] for b in server.bodies)
    assert first == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "In m.py, one."}]
    assert second[:2] == first and [m["role"] for m in second[2:]] == ["assistant", "tool"]
    assert second[2]["tool_calls"][0]["id"] == "call_1" == second[3]["tool_call_id"]  # the script's ids
    assert json.loads(second[2]["tool_calls"][0]["function"]["arguments"]) == {"path": "m.py"}
    assert second[3]["content"] == SESSION["text"]  # the file read, whole
    assert third[:4] == second and [m["role"] for m in third[4:]] == ["assistant", "tool", "user"]
    assert json.loads(third[4]["tool_calls"][0]["function"]["arguments"])["content"] == "x = 2\n"
    assert third[5] == {"role": "tool", "tool_call_id": "call_2", "content": "ok"}
    assert third[6] == {"role": "user", "content": "In m.py, two."}  # no second read: the file is in the call
    assert fourth[:7] == third and fourth[-1] == {"role": "user", "content": "In m.py, three."}
    assert run["messages"][-2]["tool_calls"][0]["function"]["arguments"] == json.dumps({"path": "m.py", "content": "x = 4\n"})
    assert [t["tool"] for t in run["turns"]] == ["read_file"] + ["write_file"] * 3
    assert [(t.get("lines_before"), t.get("lines_kept")) for t in run["turns"]] == [(None, None)] + [(1, 0)] * 3
    assert all(t["call_ok"] and t["problem"] is None and t["tokens"] == 10 and t["decode_s"] == 0.1
               for t in run["turns"])


def test_with_calls_grammar_the_text_is_held_to_the_call_and_read_back_by_the_script():
    server = FakeServer("grammar")
    run = play(SESSION, server, 64, "grammar")
    assert run["ended"] is None
    assert [b["tool_choice"] for b in server.bodies] == ["none"] * 4
    assert [b["grammar"] for b in server.bodies] == [call_grammar("read", "m.py")] + [call_grammar("rewrite", "m.py")] * 3
    assert run["turns"][1]["call"]["function"] == {"name": "write_file",
                                                   "arguments": json.dumps({"path": "m.py", "content": "x = 2\n"})}
    assert server.bodies[2]["messages"][4]["tool_calls"][0]["function"]["name"] == "write_file"


def grammar_regex(grammar: str) -> re.Pattern:
    """The root rule of call_grammar's GBNF as a regular expression: its literals as they are, each
    `string` a JSON string."""
    root = grammar.splitlines()[0].removeprefix("root ::= ")
    json_string = r'"(?:[^"\\\x00-\x1f\x7f]|\\(?:["\\bfnrt]|u[0-9a-fA-F]{4}))*"'
    parts = re.findall(r'"(?:[^"\\]|\\.)*"|string', root)
    return re.compile("".join(json_string if p == "string" else re.escape(json.loads(p)) for p in parts), re.S)


@pytest.mark.parametrize("kind, arguments", [("read", {"path": "m.py"}),
                                             ("rewrite", {"path": "m.py", "content": 'print("a\\tb")\n\u00e9\n'})])
def test_the_call_grammar_is_gbnf_llama_cpp_reads_and_holds_the_text_to_the_call_as_the_template_writes_it(
        kind, arguments):
    grammar = call_grammar(kind, "m.py")
    check(grammar)  # GrammarError where llama.cpp would refuse it
    name = "read_file" if kind == "read" else "write_file"
    written = CALL_TAGS[0] + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + CALL_TAGS[1]
    assert grammar_regex(grammar).fullmatch(written)
    other = "write_file" if kind == "read" else "read_file"
    assert not grammar_regex(grammar).fullmatch(written.replace(name, other))
    assert not grammar_regex(grammar).fullmatch(written.replace("m.py", "n.py"))  # the session's file only
    assert grammar_call({"content": written})["tool_calls"][0]["function"] == {
        "name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
    assert grammar_call({"content": written[:-3]}) == {"content": written[:-3]}  # cut: stays content


@pytest.mark.parametrize("message, finish, kind, problem", [
    (called("write_file", {"path": "m.py", "content": ""}), "stop", "read", "called write_file, not read_file"),
    (called("read_file", {"path": "other.py"}), "stop", "read", "path is not m.py"),
    (called("write_file", {"path": "m.py"}), "stop", "rewrite", "no content"),
    ({"content": None, "tool_calls": [{"type": "function", "function": {"name": "write_file", "arguments": "{\"pa"}}]},
     "stop", "rewrite", "arguments not JSON"),
    (called("write_file", {"path": "m.py", "content": "x"}), "length", "rewrite", "cut at -n"),
    ({"content": "```json\n{}\n```"}, "stop", "read", "no tool call, content '```json"),
    ({"content": "<tool_ca"}, "length", "read", "no tool call (cut at -n)"),
    ({"content": None, "tool_calls": called("read_file", {"path": "m.py"})["tool_calls"] * 2}, "stop", "read",
     "2 tool calls, not one"),
])
def test_a_call_that_is_not_the_one_asked_for_says_why(message, finish, kind, problem):
    call, said = the_call(message, finish, kind, SESSION)
    assert call is None and said.startswith(problem)


def test_a_turn_whose_call_is_not_the_one_asked_for_ends_the_session_there():
    def server(body):
        return answer(called("write_file", {"path": "m.py", "content": "x"}, "id"),
                      finish="length" if len(body["messages"]) > 2 else "stop")

    run = play(SESSION, server, 64)
    assert len(run["turns"]) == 1 and run["ended"] == {"turn": 1, "problem": "called write_file, not read_file"}

    def cut(body):
        if len(body["messages"]) == 2:
            return answer(called("read_file", {"path": "m.py"}))
        return answer({"content": "<tool_call>\n{\"name\": \"write_file\", \"arg"}, finish="length")

    run = play(SESSION, cut, 64)
    assert len(run["turns"]) == 2 and run["ended"]["turn"] == 2 and "cut at -n" in run["ended"]["problem"]
    assert [m["role"] for m in run["messages"]] == ["system", "user", "assistant", "tool"]


# -- the summary ----------------------------------------------------------------------


def turn(tokens: int, seconds: float, kind: str, text: str = "same", ok: bool = True) -> dict:
    lines = {"lines_before": 90, "lines_kept": 85} if kind == "rewrite" and ok else {}
    return {"tokens": tokens, "decode_s": seconds, "text": text, "kind": kind, "prompt_processed": 10,
            "prompt_kept": 5, "drafted": 0, "accepted": 0, "passes": tokens, "finish_reason": "stop", "dropped": 0,
            "call_ok": ok, **lines}


def run(config: str, turns: list[dict], ended: dict | None = None, session: str = "s") -> dict:
    for index, t in enumerate(turns):
        t["turn"] = index + 1
    return {"config": config, "conversation": session, "repeat": 0, "turns": turns, "ended": ended}


def test_the_tables_time_the_rewrite_turns_and_count_the_calls_and_the_sessions_ended_early():
    sessions = [{"id": "s", "edits": ["one", "two"]}]
    runs = [run("speculate none", [turn(20, 1, "read"), turn(300, 10, "rewrite"), turn(300, 10, "rewrite")]),
            run("speculate auto", [turn(20, 1, "read"), turn(300, 3, "rewrite"), turn(300, 5, "rewrite", "other")]),
            run("llama-server none", [turn(20, 1, "read"), turn(300, 10, "rewrite", ok=False)],
                {"turn": 2, "problem": "cut at -n"}),
            run("llama-server spec-default", [turn(20, 1, "read", ok=False)], {"turn": 1, "problem": "no tool call"})]
    table = summarise_agent(runs, NAMES, sessions)
    assert [(r["turn"], r["kind"]) for r in table["rows"]] == [(1, "read"), (2, "rewrite"), (3, "rewrite")]
    rewrite, every = table["summary"]
    assert rewrite["turn"] == "rewrite turns" and every["turn"] == "all turns"
    assert rewrite["configs"]["speculate auto"]["tps"] == pytest.approx(600 / 8)
    assert rewrite["ratios"]["auto / none"] == pytest.approx((600 / 8) / (600 / 20))
    assert rewrite["configs"]["llama-server spec-default"]["tps"] is None  # ended before its rewrite turns
    totals = {t["config"]: t for t in table["totals"]}
    assert (totals["speculate auto"]["calls_ok"], totals["speculate auto"]["ended_early"]) == (3, 0)
    assert (totals["llama-server none"]["calls_ok"], totals["llama-server none"]["ended_early"]) == (1, 1)
    assert totals["llama-server spec-default"]["sessions"] == 1
    found = {g["ratio"]: g for g in goals(table["summary"], GOALS)}
    assert found["auto / none"]["met"] is True and found["auto / none"]["bound"] == 1.5
    assert found["auto / spec-default"]["met"] is None  # spec-default has no rewrite turn

    lines = agent(table)
    assert lines[0].startswith("| session | turn | kind | tokens (speculate none) |")
    assert "| s | 3 | rewrite | 300 | 30.00 | 60.00 | - | - | 2.00x | - | - |" in lines
    assert lines[-1].endswith("| 3/3 | 2/3 | 2/2 | 1/1 |  |  |  |")
    totals_lines = agent_totals(table)
    assert totals_lines[0].endswith("| calls as asked | file lines the rewrites kept | sessions ended early |")
    assert totals_lines[3].endswith("| 0 | 3/3 | 170/180 | 0/1 |")
    assert totals_lines[4].startswith("| `llama-server none` | 2 |") and totals_lines[4].endswith("| 0 | 1/2 | 0/0 | 1/1 |")


def test_the_lines_a_rewrite_kept_are_those_of_the_file_before_it_in_order():
    before = "a\nb\nc\nd\n"
    assert kept_lines(before, before) == 4
    assert kept_lines(before, "a\nb\nx\nc\nd\n") == 4  # a line added
    assert kept_lines(before, "a\nB\nc\nd\n") == 3  # a line changed
    assert kept_lines(before, "d\n") == 1 and kept_lines(before, "") == 0  # a fragment


# -- the whole script, against fake servers ------------------------------------------

FAKE_SERVER = """\
import http.server, json, re, sys
args = sys.argv[1:]
if args[:2] == ["models", "path"]:
    print("/models/" + args[2] + ".gguf")
    sys.exit(0)
open(LOG, "a").write(json.dumps(args) + "\\n")
if "--port" not in args:  # speculate's one-shot calibration
    sys.exit(0)

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.reply({"status": "ok"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        open(LOG, "a").write(json.dumps(body) + "\\n")
        name = body["tool_choice"]["function"]["name"]
        path = re.search(r"`([^`]+)`", body["messages"][1]["content"])[1]
        n = sum(m["role"] == "assistant" for m in body["messages"]) + 1
        arguments = {"path": path} if name == "read_file" else {"path": path, "content": "v%d\\n" % n}
        tokens = 20 if n == 1 else 300
        self.reply({"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                        "role": "assistant", "content": None,
                        "tool_calls": [{"id": "x", "type": "function",
                                        "function": {"name": name, "arguments": json.dumps(arguments)}}]}}],
                    "usage": {"completion_tokens": tokens},
                    "timings": {"cache_n": 0, "prompt_n": 50, "predicted_n": tokens,
                                "predicted_ms": tokens * (10.0 if SPEC in args else 30.0),
                                "draft_n": 0, "draft_n_accepted": 0}})

"""


def fake_server(path: Path, log: Path, spec_flag: str) -> Path:
    """A server that is fast (10 ms a token) when started with `spec_flag`, else 30 ms a token."""
    return fake(path, f"SPEC = {spec_flag!r}\n{FAKE_SERVER}{SERVED}", log)


def test_a_whole_run_against_fake_servers_reports_every_turn_of_every_configuration(tmp_path):
    """One session under the four configurations: each in a fresh server started with the same
    settings (speculate serve with --spec-type, llama-server with --spec-default), -np 1 and
    --jinja; the turns go through /v1/chat/completions, the table and the goals are printed, and
    -o holds it all."""
    speculate = fake_server(tmp_path / "speculate", tmp_path / "speculate.log", "auto")
    server = fake_server(tmp_path / "llama-server", tmp_path / "server.log", "--spec-default")
    out = tmp_path / "out.json"
    session = load_sessions()[0]
    proc = subprocess.run([sys.executable, "-m", "scripts.bench", "agent", "--speculate", str(speculate),
                           "--llama-server", str(server), "-m", "tiny", "-n", "64", "-t", "1",
                           "--sessions", session["id"], "-o", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(r["config"], r["conversation"]) for r in result["runs"]] == [(n, session["id"]) for n in NAMES]
    assert result["meta"]["sessions"] == [session["id"]] and result["meta"]["calls"] == "tools"

    started = [json.loads(line) for line in (tmp_path / "speculate.log").read_text().splitlines()]
    starts = [s for s in started if isinstance(s, list)]
    assert len(starts) == 3 and "-p" in starts[0]  # auto's calibration first, untimed
    for args, spec in zip(starts[1:], ("none", "auto")):
        assert args[0] == "serve" and args[args.index("--spec-type") + 1] == spec
        assert [args[args.index(f) + 1] for f in ("-m", "-t", "-c", "-np")] == ["tiny", "1", "8192", "1"]
        assert "--jinja" in args and "-md" not in args
    served = [json.loads(line) for line in (tmp_path / "server.log").read_text().splitlines()]
    starts = [s for s in served if isinstance(s, list)]
    assert [s[s.index("-m") + 1] for s in starts] == ["/models/tiny.gguf"] * 2
    assert ["--spec-default" in s for s in starts] == [False, True] and all("--jinja" in s for s in starts)
    chats = [s for s in served if isinstance(s, dict)]
    assert len(chats) == 2 * (len(session["edits"]) + 1)
    assert chats[1]["messages"][3] == {"role": "tool", "tool_call_id": "call_1", "content": session["text"]}

    assert all(run["ended"] is None for run in result["runs"])
    assert all(t["call_ok"] for run in result["runs"] for t in run["turns"])
    found = {g["ratio"]: g for g in result["goals"]}
    assert found["auto / none"]["value"] == pytest.approx(3.0) and found["auto / none"]["met"] is True
    assert found["auto / spec-default"]["value"] == pytest.approx(1.0) and found["auto / spec-default"]["met"] is False
    assert proc.stdout.count(f"\n| {session['id']} |") == len(session["edits"]) + 1
    assert "goal: speculate auto at least 1.5x speculate none on the rewrite turns: met (3.00x)" in proc.stdout


@pytest.mark.parametrize("args, said", [(["--only", "nothing-like-it"], "no such configuration; there are: speculate"),
                                        (["--sessions", "nope"], "--sessions: no session nope"),
                                        (["--calls", "json"], "invalid choice: 'json'"),
                                        (["--llama-server", "/nonexistent/llama-server"], "not an executable")])
def test_a_usage_error_is_one_line_and_exit_2_before_anything_runs(args, said):
    proc = subprocess.run([sys.executable, "-m", "scripts.bench", "agent", *args], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr
