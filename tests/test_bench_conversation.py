"""The `conversation` scenario without a model: its conversations are what issue 45 asks for, its
sums are aggregate speeds, and a whole run against a fake `speculate -cnv` and a fake llama-server
sends each tool what it should and reads back what each reports, turn by turn."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.bench.conversation import CONFIGS, CONVERSATIONS, goals, load_conversations, summarise, turn_kind
from scripts.tables import conversation, conversation_totals

ROOT = Path(__file__).resolve().parent.parent
NAMES = [c.name for c in CONFIGS]


def test_the_conversations_are_code_edits_of_at_least_six_turns_from_the_prompt_set_and_held_back():
    conversations = load_conversations()  # exits on a malformed line
    assert len(conversations) >= 3
    assert len({c["id"] for c in conversations}) == len(conversations)
    sources = [c["source"] for c in conversations]
    assert sources.count("prompt-set") >= 1 and sources.count("held-back") >= 2
    for c in conversations:
        assert len(c["turns"]) >= 6, c["id"]
        assert "whole module in one code block" in c["turns"][0]
        assert all("whole updated module" in turn for turn in c["turns"][1:]), c["id"]
    assert [turn_kind(i) for i in range(3)] == ["write", "edit", "edit"]


@pytest.mark.parametrize("turn", ["two\nlines", "goes on \\", "/clear the cache", "  ", 7])
def test_a_turn_that_is_not_one_line_is_refused(tmp_path, turn):
    bad = tmp_path / "conversations.jsonl"
    bad.write_text(json.dumps({"id": "x", "source": "held-back", "turns": ["Write a module.", turn]}) + "\n")
    with pytest.raises(ValueError, match="one non-empty line"):
        load_conversations(bad)


def test_conversations_are_picked_by_id_in_the_order_given_and_an_unknown_id_is_named():
    ids = [c["id"] for c in load_conversations()]
    assert [c["id"] for c in load_conversations(CONVERSATIONS, ids[::-1])] == ids[::-1]
    with pytest.raises(ValueError, match="no conversation nope"):
        load_conversations(CONVERSATIONS, [ids[0], "nope"])


def turn(tokens: int, seconds: float, text: str = "same", **extra) -> dict:
    return {"tokens": tokens, "decode_s": seconds, "text": text, "prompt_processed": 10, "prompt_kept": 5,
            "drafted": 0, "accepted": 0, "passes": tokens, "finish_reason": "stop", "dropped": 0, **extra}


def run(config: str, repeat: int, turns: list[dict], conversation: str = "c") -> dict:
    for index, t in enumerate(turns):
        t.update(turn=index + 1, kind=turn_kind(index))
    return {"config": config, "conversation": conversation, "repeat": repeat, "turns": turns}


def test_speeds_are_tokens_over_seconds_summed_over_turns_and_repeats_not_means_of_speeds():
    conversations = [{"id": "c", "turns": ["write", "edit 1", "edit 2"]}]
    runs = [run("speculate none", 0, [turn(100, 10), turn(100, 1), turn(300, 3)]),
            run("speculate none", 1, [turn(100, 10), turn(100, 4), turn(300, 3)]),
            run("speculate auto", 0, [turn(100, 10), turn(100, 1), turn(300, 1, "other", drafted=200, accepted=150,
                                                                           passes=150)]),
            run("speculate auto", 1, [turn(100, 10), turn(100, 1), turn(300, 1)])]
    table = summarise(runs, ["speculate none", "speculate auto"], conversations)
    rows = {r["turn"]: r for r in table["rows"]}
    assert rows[2]["configs"]["speculate none"]["tps"] == pytest.approx(200 / 5)  # not (100 + 25) / 2
    assert rows[2]["tokens"] == 100 and rows[2]["kind"] == "edit" and rows[1]["kind"] == "write"
    assert rows[3]["ratios"]["auto / none"] == pytest.approx((600 / 2) / (600 / 6))
    edit, every = table["summary"]
    assert edit["turn"] == "edit turns" and every["turn"] == "all turns"
    assert edit["configs"]["speculate none"]["tps"] == pytest.approx(800 / 11)
    assert edit["configs"]["speculate auto"]["tps"] == pytest.approx(800 / 4)
    assert every["configs"]["speculate auto"]["tps"] == pytest.approx(1000 / 24)
    assert edit["tokens"] == 400 and every["tokens"] == 500  # speculate none's, per repeat
    assert edit["ratios"]["auto / none"] == pytest.approx(200 / (800 / 11))
    assert list(edit["ratios"]) == ["auto / none"]  # llama-server did not run
    assert every["configs"]["speculate auto"]["identical"] == 5 and every["configs"]["speculate auto"]["compared"] == 6
    totals = {t["config"]: t for t in table["totals"]}
    assert totals["speculate auto"]["accepted"] == 150 and totals["speculate auto"]["drafted"] == 200
    assert totals["speculate auto"]["tokens_per_pass"] == pytest.approx(1000 / 850)
    assert totals["speculate none"]["tokens_per_pass"] == 1 and totals["speculate none"]["turns"] == 6
    found = {g["ratio"]: g for g in goals(table["summary"])}
    assert found["auto / none"]["met"] is True and found["auto / spec-default"]["met"] is None

    lines = conversation(table)
    assert len(lines) == 2 + 3 + 2 + 1 and lines[0].count("|") == 4 + 2 + 1 + 1
    assert lines[-1].startswith("| answers identical to the same tool's without speculation |")
    assert lines[-1].endswith("| 6/6 | 5/6 |  |")
    assert "| all | edit turns | edit | 400 | 72.73 | 200.00 | 2.75x |" in lines
    assert len(conversation_totals(table)) == 2 + 2


FAKE_SPECULATE = """\
import json, sys
args = sys.argv[1:]
if args[:2] == ["models", "path"]:
    print("/models/" + args[2] + ".gguf")
    sys.exit(0)
open(LOG, "a").write(json.dumps(args) + "\\n")
if "-cnv" not in args:  # the calibration's one-shot run
    sys.exit(0)
auto = args[args.index("--spec-type") + 1] == "auto"
kept = 0
for n, line in enumerate(sys.stdin, 1):
    tokens, speed = 100 * n, 40.0 if auto and n > 1 else 20.0
    accepted = tokens // 2 if auto else 0
    print(json.dumps({"turn": n, "text": "module v%d%s" % (n, "'" if auto and n == 3 else ""),
                      "tokens": list(range(tokens)), "finish_reason": "length" if n == 6 else "stop",
                      "n_prompt": kept + 50, "n_cached": kept, "n_predict": tokens, "n_drafted": 2 * accepted,
                      "n_accept": accepted, "n_steps": tokens - accepted, "t_decode_s": tokens / speed,
                      "decode_tps": speed, "plans": [], "dropped": 1 if n == 6 else 0}), flush=True)
    kept += 50 + tokens
"""

FAKE_LLAMA_SERVER = """\
import http.server, json, sys
args = sys.argv[1:]
spec = "--spec-default" in args
open(LOG, "a").write(json.dumps(args) + "\\n")

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.reply({"status": "ok"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        open(LOG, "a").write(json.dumps(body) + "\\n")
        n = (len(body["messages"]) + 1) // 2
        tokens, speed = 100 * n, 30.0 if spec and n > 1 else 20.0
        timings = {"cache_n": 10 * n, "prompt_n": 50, "prompt_ms": 5.0, "predicted_n": tokens,
                   "predicted_ms": 1000 * tokens / speed, "predicted_per_second": speed}
        if spec:
            timings.update(draft_n=tokens, draft_n_accepted=tokens // 4)
        self.reply({"choices": [{"finish_reason": "stop", "message": {"role": "assistant",
                    "content": "server v%d%s" % (n, "'" if spec and n == 4 else "")}}],
                    "timings": timings})
"""

# The end of a fake server's script: its Handler's reply (JSON) and the server on --port.
SERVED = """
    def reply(self, answer):
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Handler).serve_forever()
"""


def fake(path: Path, source: str, log: Path) -> Path:
    path.write_text(f"#!{sys.executable}\nLOG = {str(log)!r}\n{source}")
    path.chmod(0o755)
    return path


def test_a_whole_run_against_fake_tools_reports_every_turn_of_every_configuration(tmp_path):
    """One conversation under the four configurations: speculate gets the turns on its standard
    input, one a line, with -cnv --json and the settings; llama-server gets -np 1 (and --spec-default)
    and, each turn, the conversation so far with its own answers; each turn's figures come back as
    each tool reported them, the table and the goals are printed, and -o holds it all."""
    speculate = fake(tmp_path / "speculate", FAKE_SPECULATE, tmp_path / "speculate.log")
    server = fake(tmp_path / "llama-server", FAKE_LLAMA_SERVER + SERVED, tmp_path / "server.log")
    out = tmp_path / "out.json"
    conversation = load_conversations()[0]
    proc = subprocess.run([sys.executable, "-m", "scripts.bench", "conversation", "--speculate", str(speculate),
                           "--llama-server", str(server), "-m", "tiny", "-n", "64", "-t", "1",
                           "--conversations", conversation["id"], "-o", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(r["config"], r["conversation"]) for r in result["runs"]] == [(n, conversation["id"]) for n in NAMES]
    assert result["meta"]["conversations"] == [conversation["id"]] and result["meta"]["n_predict"] == 64

    started = [json.loads(line) for line in (tmp_path / "speculate.log").read_text().splitlines()]
    assert len(started) == 3 and "-p" in started[0]  # auto's calibration first, untimed
    for args, spec in zip(started[1:], ("none", "auto")):
        assert {"-cnv", "--json"} <= set(args) and args[args.index("--spec-type") + 1] == spec
        assert [args[args.index(f) + 1] for f in ("-m", "-n", "-t", "-c", "--temp")] == ["tiny", "64", "1", "8192", "0"]
        assert "-md" not in args
    sent = [json.loads(line) for line in (tmp_path / "server.log").read_text().splitlines()]
    starts = [s for s in sent if isinstance(s, list)]
    assert [s[s.index("-m") + 1] for s in starts] == ["/models/tiny.gguf"] * 2
    assert ["--spec-default" in s for s in starts] == [False, True] and all("-np" in s for s in starts)
    chats = [s for s in sent if isinstance(s, dict)]
    assert len(chats) == 2 * len(conversation["turns"])
    last = chats[len(conversation["turns"]) - 1]
    assert [m["role"] for m in last["messages"]] == ["user", "assistant"] * 5 + ["user"]
    assert [m["content"] for m in last["messages"][::2]] == conversation["turns"]
    assert [m["content"] for m in last["messages"][1::2]] == [f"server v{n}" for n in range(1, 6)]
    assert all(c["temperature"] == 0 and c["max_tokens"] == 64 and c["cache_prompt"] for c in chats)

    by_config = {r["config"]: r["turns"] for r in result["runs"]}
    auto = by_config["speculate auto"]
    assert [t["prompt_kept"] for t in auto] == [0, 150, 400, 750, 1200, 1750]
    assert [t["finish_reason"] for t in auto][-2:] == ["stop", "length"] and auto[1]["passes"] == 100
    assert by_config["llama-server spec-default"][1]["accepted"] == 50
    assert by_config["llama-server none"][1]["drafted"] == 0  # llama-server leaves draft_n out
    assert [t["dropped"] for t in result["totals"]] == [1, 1, 0, 0]
    edit = {g["ratio"]: g for g in result["goals"]}
    assert edit["auto / none"]["value"] == pytest.approx(2.0) and edit["auto / none"]["met"] is True
    assert edit["auto / spec-default"]["value"] == pytest.approx(40 / 30) and edit["auto / spec-default"]["met"]
    every = result["summary"][-1]["configs"]
    assert [every[n]["identical"] for n in NAMES] == [6, 5, 6, 5]  # each against its own tool's none
    assert proc.stdout.count("\n| " + conversation["id"] + " |") == len(conversation["turns"])
    assert "goal: speculate auto at least 1.8x speculate none on the edit turns: met (2.00x)" in proc.stdout


@pytest.mark.parametrize("args, said", [(["--only", "nothing-like-it"], "no such configuration; there are: speculate"),
                                        (["--conversations", "nope"], "--conversations: no conversation nope"),
                                        (["--speculate", "/nonexistent/speculate"], "not an executable"),
                                        (["--repeats", "0"], "positive number")])
def test_a_usage_error_is_one_line_and_exit_2_before_anything_runs(args, said):
    proc = subprocess.run([sys.executable, "-m", "scripts.bench", "conversation", *args], capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr
