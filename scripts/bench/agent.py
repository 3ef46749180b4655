"""A coding agent's session with tools, turn by turn: `speculate serve` with and without speculation
against the pinned llama-server, without speculation and with --spec-default, all through
/v1/chat/completions.

    python -m scripts.bench agent [--speculate PATH] [--llama-server PATH] [-m MODEL] [-md DRAFT] [-t 2]
                                  [-n 2048] [--only CONFIG_SUBSTRING ...] [--sessions ID,...]
                                  [--calls tools|grammar] [--repeats 1] [-o results.json]

Each session of scripts/agent_sessions.jsonl (one a line: {"id", "path", "edits": [user
messages], "text": the file's text}) is what an agent does to change a file: every request offers
two tools, read_file(path) and write_file(path, content). How a turn gets its call (--calls):
`tools` (default), the turn's tool named in tool_choice ({"type": "function", "function":
{"name": ...}}) and the call read by the server (the pinned llama-server reads a named
tool_choice as `auto`, with a warning, and its `required` lets text come before the call, so
neither forces a call there); `grammar`, tool_choice `none` and a grammar holding the answer to
the turn's call as Qwen2.5's template writes one, read back by this script (the same forced call
on both servers, for a model that does not call by itself). The user asks for the first edit; the model calls read_file
(the `read` turn), and the script answers with a `tool` message holding the file's text; the
model calls write_file with the whole file changed (a `rewrite` turn), the script answers "ok"
and the user asks for the next edit, which the model makes to the file as it last wrote it (in
the history, as that call's arguments), and so on. A turn whose call is not the one asked for
(that tool, the session's file, JSON arguments with a string `content` for write_file; a call cut
at -n is not) ends its session there: the agent has no file to go on from. The ids of the calls
are the script's (call_1, call_2, ...), so every configuration sends the same history whatever ids
its server draws. Each session runs under each configuration in a fresh server, greedy
(temperature 0), -c 8192, -t THREADS, -np 1, --jinja, cache_prompt on, at most -n tokens an
answer (default 2048: a rewrite is the whole file, 700 to 1,000 tokens as JSON):

  speculate none              `speculate serve -m MODEL --spec-type none`
  speculate auto              the same with --spec-type auto (and -md DRAFT when given: without it
                              auto drafts from n-grams only, as --spec-default does)
  llama-server none           the pinned llama-server
  llama-server spec-default   the same with --spec-default (llama.cpp's ngram-mod, no draft model)

Both servers answer with llama-server's `timings`: a turn's speed is predicted_n over
predicted_ms, its tokens per pass predicted_n / (predicted_n - draft_n_accepted). Per turn the
table gives the tokens of the first configuration run, each configuration's decode speed and the
ratios auto / none, spec-default / llama-server none and auto / spec-default; then the rewrite
turns together and all turns together, each configuration's tokens over its decode seconds (the
aggregate speed, not a mean of speeds), and how many answers (content and calls, word for word)
are the same server's without speculation. A second table sums each configuration's turns as
the `conversation` scenario's does, with the calls as asked, the lines of the file its rewrites
kept and the sessions ended early.
--repeats R runs everything R times, in the same order.

llama-server, the calibration of auto, GGML_CPU_TILED_MM and the options shared with the
`conversation` scenario work as there. Prints both tables (`python scripts/tables.py agent
agent-totals` renders the same from -o's file) and whether the goals were met: auto at least 1.5x
speculate none on the rewrite turns, and ahead of llama-server spec-default there. -o writes meta,
the sessions, the tables' rows and every run: each turn's statistics, usage, timings and message,
and the session's whole history. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path

from scripts.bench import harness
from scripts.bench.conversation import (CTX, Config, add_common_arguments, check_common_arguments, goals,
                                        log_turn, print_goals, run_all, run_meta, server_turn, summarise)
from scripts.bench.servers import Server
from scripts.tables import agent as agent_table
from scripts.tables import agent_totals as totals_table

SESSIONS = harness.ROOT / "scripts" / "agent_sessions.jsonl"
N_PREDICT = 2048

SYSTEM = ("You are a coding agent working in a repository. You see and change its files only through your tools: "
          "read_file(path) gives a file's whole text, write_file(path, content) replaces a file's whole text with "
          "content. To change a file, read it once, then write it back whole with the change made and every other "
          "line exactly as it was. Paths are from the repository's root.")
PATH = {"type": "string", "description": "the file's path from the repository's root"}
CALL_TAGS = ("<tool_call>\n", "\n</tool_call>")
JSON_STRING = r'''string ::= "\"" char* "\""
char ::= [^"\\\x7F\x00-\x1F] | [\\] (["\\bfnrt] | "u" [0-9a-fA-F]{4})
'''
TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository: its whole text.",
        "parameters": {"type": "object", "properties": {"path": PATH}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Write a file of the repository: content replaces its whole text.",
        "parameters": {"type": "object",
                       "properties": {"path": PATH, "content": {"type": "string",
                                                                "description": "the file's whole new text"}},
                       "required": ["path", "content"]}}},
]
# --calls: how a turn gets its call
CALLS = {"tools": "each turn's tool named in tool_choice, the call read by the server",
         "grammar": "tool_choice none, each turn's call forced by a grammar and read by the script"}
# (ratio, bound, strictly above, what): issue 46's goals, on the rewrite turns
GOALS = [("auto / none", 1.5, False, "speculate auto at least 1.5x speculate none on the rewrite turns"),
         ("auto / spec-default", 1.0, True, "speculate auto ahead of llama-server spec-default on the rewrite turns")]


def turn_kind(index: int) -> str:
    """The first turn reads the file (read), every later one writes it back changed (rewrite)."""
    return "read" if index == 0 else "rewrite"


def session_kinds(session: dict) -> list[str]:
    """A read, then a rewrite for each edit."""
    return [turn_kind(index) for index in range(len(session["edits"]) + 1)]


def wanted_tool(kind: str) -> str:
    return "read_file" if kind == "read" else "write_file"


def tool_choice(kind: str) -> dict:
    """The turn's tool, named."""
    return {"type": "function", "function": {"name": wanted_tool(kind)}}


def call_grammar(kind: str, path: str) -> str:
    """--calls grammar: the GBNF of the turn's call as Qwen2.5's template writes one (Hermes' form:
    CALL_TAGS around the JSON of the name and arguments) on the session's file `path` (an agent
    changing one file knows which; the 1.5B target read another file the edit mentioned), its
    content any JSON string (the string rule of llama.cpp's json-schema-to-grammar). json.dumps
    writes a GBNF literal."""
    opening = json.dumps(f'{CALL_TAGS[0]}{{"name": "{wanted_tool(kind)}", "arguments": {{"path": {json.dumps(path)}')
    content = " " + json.dumps(', "content": ') + " string" if kind == "rewrite" else ""
    return (f"root ::= {opening}{content} {json.dumps('}}' + CALL_TAGS[1])}\n"
            + JSON_STRING)


def grammar_call(message: dict) -> dict:
    """--calls grammar: the answer's text read as the call the grammar held it to (the message a
    server would have answered with tool_calls); a text that is not one (cut at -n) stays content."""
    text = message.get("content") or ""
    if not (text.startswith(CALL_TAGS[0]) and text.endswith(CALL_TAGS[1])):
        return message
    try:
        call = json.loads(text[len(CALL_TAGS[0]):-len(CALL_TAGS[1])])
        function = {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}
    except (ValueError, KeyError, TypeError):
        return message
    return {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": function}]}


def load_sessions(path: Path = SESSIONS, ids: list[str] | None = None) -> list[dict]:
    """The sessions of `path` (those of `ids`, in that order, when given), each checked: an id, the
    file's path and text, and edits that are non-empty messages each naming the file. ValueError
    says what is wrong."""
    sessions = []
    for number, s in harness.jsonl(path, numbered=True):
        if (not isinstance(s, dict)
                or not all(isinstance(s.get(k), str) and s[k].strip() for k in ("id", "path", "text"))
                or not isinstance(s.get("edits"), list) or not s["edits"]):
            raise ValueError(f"{path}:{number}: a session needs an id, a path, the file's text and edits")
        for edit in s["edits"]:
            if not isinstance(edit, str) or s["path"] not in edit:
                raise ValueError(f"{path}:{number}: {s['id']}: every edit must be a message naming {s['path']}")
        sessions.append(s)
    return harness.by_ids(sessions, ids, "session", path)


# -- a session's messages --------------------------------------------------------------


def opening(session: dict) -> list[dict]:
    """The agent's instructions and the first edit asked."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": session["edits"][0]}]


def request(messages: list[dict], kind: str, path: str, n_predict: int, calls: str = "tools") -> dict:
    """A turn's /v1/chat/completions body: the history, the tools, greedy; the turn's tool named in
    tool_choice (--calls tools), or no call asked and its text held to the call of the session's
    file `path` by a grammar (--calls grammar)."""
    body = {"messages": messages, "tools": TOOLS, "max_tokens": n_predict, "temperature": 0, "cache_prompt": True}
    if calls == "tools":
        return {**body, "tool_choice": tool_choice(kind), "parallel_tool_calls": False}
    return {**body, "tool_choice": "none", "grammar": call_grammar(kind, path)}


def answer_text(message: dict) -> str:
    """What an answer is compared by, word for word: its content and its calls' names and arguments."""
    calls = [[c["function"]["name"], c["function"]["arguments"]] for c in message.get("tool_calls") or []]
    return json.dumps([message.get("content"), calls], ensure_ascii=False)


def the_call(message: dict, finish_reason: str, kind: str, session: dict) -> tuple[dict | None, str | None]:
    """The turn's call and its arguments, (call, None) when it is the one the turn asks for, else
    (None, what is wrong)."""
    calls, tool = message.get("tool_calls") or [], wanted_tool(kind)
    if not calls:
        cut = " (cut at -n)" if finish_reason == "length" else ""
        return None, f"no tool call{cut}, content {(message.get('content') or '')[:80]!r}"
    if finish_reason == "length":
        return None, "cut at -n"
    if len(calls) != 1:
        return None, f"{len(calls)} tool calls, not one"
    function = calls[0]["function"]
    if function["name"] != tool:
        return None, f"called {function['name']}, not {tool}"
    try:
        arguments = json.loads(function["arguments"])
    except (TypeError, ValueError):
        return None, "arguments not JSON"
    if not isinstance(arguments, dict) or arguments.get("path") != session["path"]:
        return None, f"path is not {session['path']}"
    if tool == "write_file" and not isinstance(arguments.get("content"), str):
        return None, "no content"
    return calls[0], None


def follow_up(session: dict, index: int, call: dict) -> list[dict]:
    """What the history gets after turn `index`'s call: the call (under the script's id), the tool's
    answer (the file's text for read_file, "ok" for write_file) and the next edit, if any."""
    call_id = f"call_{index + 1}"
    function = call["function"]
    messages = [{"role": "assistant", "content": None,
                 "tool_calls": [{"id": call_id, "type": "function",
                                 "function": {"name": function["name"], "arguments": function["arguments"]}}]},
                {"role": "tool", "tool_call_id": call_id,
                 "content": session["text"] if function["name"] == "read_file" else "ok"}]
    if index > 0 and index < len(session["edits"]):  # after a rewrite, the next edit
        messages.append({"role": "user", "content": session["edits"][index]})
    return messages


def agent_turn(answer: dict, kind: str, session: dict, calls: str = "tools") -> dict:
    """A turn as a server answers it: server_turn's record, the text compared word for word (the
    server's message), the call (tool and arguments text; with --calls grammar, read from the text),
    whether it is the call asked for (`call`: as the history gets it; None: it is not, `problem`
    says why), the usage and the message."""
    turn = server_turn(answer)
    choice = answer["choices"][0]
    message = choice["message"] if calls == "tools" else grammar_call(choice["message"])
    call, problem = the_call(message, choice["finish_reason"], kind, session)
    made = message.get("tool_calls") or []
    turn.update(text=answer_text(choice["message"]), message=choice["message"], usage=answer.get("usage"),
                tool=made[0]["function"]["name"] if made else None,
                arguments=made[0]["function"]["arguments"] if made else None,
                call=call, call_ok=call is not None, problem=problem)
    return turn


def kept_lines(before: str, after: str) -> int:
    """How many lines of `before` a rewrite kept, in order (difflib's longest matching blocks)."""
    matcher = difflib.SequenceMatcher(None, before.splitlines(), after.splitlines(), autojunk=False)
    return sum(block.size for block in matcher.get_matching_blocks())


def play(session: dict, post, n_predict: int, calls: str = "tools", on_turn=None) -> dict:
    """The session, each turn's request given to `post` (body -> the server's answer): its turns,
    its whole history, and where it ended early (None: it did not). A rewrite's turn also says how
    many lines the file had and how many of them it kept (a model that writes a fragment of the
    file, or something else, times other work than an agent's). `on_turn(index, turn)` sees each
    turn as it comes."""
    messages, turns, file = opening(session), [], session["text"]
    for index, kind in enumerate(session_kinds(session)):
        turn = agent_turn(post(request(messages, kind, session["path"], n_predict, calls)), kind, session, calls)
        turns.append(turn)
        if turn["call"] is not None and kind == "rewrite":
            written = json.loads(turn["call"]["function"]["arguments"])["content"]
            turn.update(lines_before=len(file.splitlines()), lines_kept=kept_lines(file, written))
            file = written
        if on_turn:
            on_turn(index, turn)
        if turn["call"] is None:
            return {"turns": turns, "messages": messages, "ended": {"turn": index + 1, "problem": turn["problem"]}}
        messages = messages + follow_up(session, index, turn["call"])
    return {"turns": turns, "messages": messages, "ended": None}


# -- one run: a session under a configuration, in a fresh server ----------------------


def server_command(cfg: Config, bench: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The server of a configuration: its command and its flags (--port is Server's)."""
    common = ["-t", str(bench.threads), "-c", str(CTX), "-np", "1", "--jinja"]
    if cfg.tool == "speculate":
        draft = ["-md", bench.draft] if bench.draft and cfg.spec == "auto" else []
        return [bench.speculate, "serve"], ["-m", bench.model, *draft, *common, "--spec-type", cfg.spec]
    return [str(bench.llama_server)], ["-m", bench.target_file, *common,
                                       *(["--spec-default"] if cfg.spec == "spec-default" else [])]


def run_session(cfg: Config, bench: argparse.Namespace, session: dict, work: Path) -> dict:
    """A fresh server of `cfg`, the session played against it; stops the script on a refused request."""
    command, flags = server_command(cfg, bench)
    log = work / f"{session['id']}-{cfg.tool}-{cfg.spec}.log"
    server = Server(flags, log, command=command, env=bench.env)
    asked = []

    def post(body: dict) -> dict:
        asked.append(body)
        where = f"{cfg.name}: {session['id']} turn {len(asked)}"
        try:
            status, answer = server.post("/v1/chat/completions", body)
        except (OSError, ValueError) as e:  # the server died, or answered something else than JSON
            sys.exit(f"{where}: no answer ({e}):\n{log.read_text(errors='replace')[-3000:]}")
        if status != 200:
            sys.exit(f"{where}: refused ({status}): {answer}")
        if not isinstance(answer.get("timings"), dict) or not answer.get("choices"):
            sys.exit(f"{where}: not a chat completion with timings: {str(answer)[:300]}")
        return answer

    try:
        run = play(session, post, bench.n_predict, bench.calls, lambda index, turn: log_turn(cfg, session, index, turn))
    finally:
        server.close()
    if run["ended"]:
        print(f"  {session['id']} {cfg.name}: ended at turn {run['ended']['turn']}: {run['ended']['problem']}",
              file=sys.stderr, flush=True)
    return {**run, "calibrated": "calibrating" in log.read_text(errors="replace"), "command": [*command, *flags]}


# -- the summary ------------------------------------------------------------------------


def summarise_agent(runs: list[dict], configs: list[str], sessions: list[dict]) -> dict:
    """The `conversation` scenario's summary (the rewrite turns timed), each configuration's totals
    with the calls as asked, the file's lines its rewrites kept, and the sessions that ended early."""
    table = summarise(runs, configs, sessions, kinds=session_kinds, timed="rewrite")
    for total in table["totals"]:
        mine = [run for run in runs if run["config"] == total["config"]]
        turns = [t for run in mine for t in run["turns"]]
        total.update(calls_ok=sum(t["call_ok"] for t in turns), sessions=len(mine),
                     ended_early=sum(run["ended"] is not None for run in mine),
                     **{k: sum(t.get(k, 0) for t in turns) for k in ("lines_kept", "lines_before")})
    return table


def print_report(table: dict, found: list[dict], bench: argparse.Namespace, sessions: list[dict],
                 runs: list[dict]) -> None:
    print(f"{len(sessions)} session(s) ({', '.join(s['id'] for s in sessions)}), greedy, --calls {bench.calls} "
          f"({CALLS[bench.calls]}), at most {bench.n_predict} tokens an answer, -c {CTX} -t {bench.threads}, "
          f"{bench.repeats} repeat(s); t/s: tokens over decode seconds, summed over the repeats")
    print("\n".join(agent_table(table)))
    print()
    print("\n".join(totals_table(table)))
    print()
    for run in runs:
        if run["ended"]:
            print(f"ended early: {run['conversation']} under {run['config']} (repeat {run['repeat'] + 1}) at turn "
                  f"{run['ended']['turn']}: {run['ended']['problem']}")
    print_goals(found)


# -- the command ------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.parser(__name__, __doc__)
    add_common_arguments(parser)
    parser.set_defaults(n_predict=N_PREDICT)
    parser.add_argument("--sessions", help="ids of scripts/agent_sessions.jsonl, comma-separated (default: all)")
    parser.add_argument("--calls", choices=CALLS, default="tools",
                        help="how a turn gets its call: 'tools', the tool named in tool_choice and the call read by "
                             "the server (default); 'grammar', tool_choice none, the text held to the call in "
                             "Qwen2.5's form by a grammar and read by this script (for a server that will not call)")
    bench = harness.parse(parser, argv)
    check_common_arguments(parser, bench)
    try:
        bench.picked = load_sessions(ids=bench.sessions.split(",") if bench.sessions else None)
    except ValueError as e:
        parser.error(f"--sessions: {e}" if bench.sessions else str(e))
    return bench


def main(argv: list[str] | None = None) -> int:
    bench = parse_args(argv)
    sessions = bench.picked
    runs = run_all(bench, sessions, "bench-agent-", runner=run_session, kind=turn_kind)
    table = summarise_agent(runs, [c.name for c in bench.configs], sessions)
    found = goals(table["summary"], GOALS)
    print_report(table, found, bench, sessions, runs)
    if bench.output:
        harness.write(bench.output, {
            "meta": run_meta(bench, calls=bench.calls, sessions=[s["id"] for s in sessions]),
            "system": SYSTEM, "tools": TOOLS, "sessions": sessions, **table, "goals": found, "runs": runs})
    return 0
