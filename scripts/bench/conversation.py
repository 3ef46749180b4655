"""A code-editing conversation, turn by turn: `speculate -cnv` with and without speculation against
the pinned llama-server's multi-turn chat, without speculation and with --spec-default.

    python -m scripts.bench conversation [--speculate PATH] [--llama-server PATH] [-m MODEL] [-md DRAFT]
                                         [-t 2] [-n 1024] [--only CONFIG_SUBSTRING ...] [--conversations ID,...]
                                         [--repeats 1] [-o results.json]

Each conversation of scripts/conversations.jsonl (one a line: {"id", "source": "prompt-set" or
"held-back", "turns": [user messages]}) opens by asking for a small module whole (the `write`
turn) and then asks for one change at a time, each answer the whole module again (the `edit`
turns): the case where an answer mostly copies the last one and drafting from it pays. Each
conversation runs under each configuration in a fresh process, greedy (temperature 0), -c 8192,
-t THREADS, at most -n tokens an answer:

  speculate none              `speculate -m MODEL -cnv --json --spec-type none`, the turns on its
  speculate auto              standard input, one a line; with --spec-type auto (and -md DRAFT
                              when given: without it auto drafts from n-grams only, as
                              --spec-default does)
  llama-server none           the pinned llama-server (-np 1), the turns sent to
  llama-server spec-default   /v1/chat/completions one after another with the conversation so far
                              (its own earlier answers as the assistant's), cache_prompt on; with
                              --spec-default (llama.cpp's ngram-mod, no draft model)

Both tools re-send the whole conversation each turn and keep what their caches hold of it. Per
turn the table gives the tokens of the first configuration run (speculate none by default), each
configuration's decode speed and the ratios auto / none, spec-default / llama-server none and auto
/ spec-default; then the edit turns together and all turns together, each configuration's tokens
over its decode seconds (the aggregate speed, not a mean of speeds), and how many answers are the
same tool's without speculation, word for word (on a batch-invariant build, greedy speculation
changes none; once an answer differs, the conversations differ from there on). A second table
sums each configuration's turns: prompt tokens processed and kept from the turn before, drafted
and accepted tokens, tokens per target pass, answers cut at -n. With --repeats R every run is
done R times (each repeat runs every conversation and configuration once, in the same order, so
drift hits all alike) and the sums take them all.

A turn's speed is each tool's own: speculate's n_predict over t_decode_s (from the prompt's last
token to the answer's last), llama-server's predicted_n over predicted_ms (from its first
generated token, which its prompt batch yields, to the last: its predicted_per_second). Tokens
per pass: speculate's n_predict / n_steps, llama-server's predicted_n / (predicted_n -
draft_n_accepted), the prompt batch counted as the pass that yields the first token. A
conversation that outgrows -c: speculate drops its oldest exchanges (counted in the second table),
llama-server refuses the turn (the run stops there).

llama-server is --llama-server PATH, or built once from the sdist scripts/test.sh keeps (as for the
`parallel` scenario: 10 to 15 minutes on 2 cores, the first time only); it keeps its own defaults
otherwise (flash attention `auto`: on, on a CPU; speculate leaves it off).
GGML_CPU_TILED_MM is passed on as set (0: batch-invariant CPU kernels on every tool alike). auto's
cost calibration (cached per machine) runs untimed before the first run; a run that calibrated
anyway says so. Prints both tables (`python scripts/tables.py conversation conversation-totals`
renders the same from -o's file) and whether the goals were met: auto at least 1.8x speculate none
on the edit turns, and ahead of llama-server spec-default there. -o writes meta, the tables' rows
and every run with every turn (text and statistics) as JSON. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench import harness
from scripts.bench.servers import Server, llama_server_binary
from scripts.tables import conversation as conversation_table
from scripts.tables import conversation_totals as totals_table

CONVERSATIONS = harness.ROOT / "scripts" / "conversations.jsonl"
CTX = 8192
SOURCES = ("prompt-set", "held-back")


@dataclasses.dataclass(frozen=True)
class Config:
    tool: str  # speculate or llama-server
    spec: str  # none, auto or spec-default

    @property
    def name(self) -> str:
        return f"{self.tool} {self.spec}"


def unsped(config: str) -> str:
    """The configuration of the same tool without speculation, whose answers a configuration's are
    compared with word for word: "speculate auto" -> "speculate none"."""
    return f"{config.rsplit(' ', 1)[0]} none"


CONFIGS = [Config("speculate", "none"), Config("speculate", "auto"), Config("llama-server", "none"),
           Config("llama-server", "spec-default")]
# (label, numerator, denominator): the ratios of decode speeds the table shows
RATIOS = [("auto / none", "speculate auto", "speculate none"),
          ("spec-default / llama-server none", "llama-server spec-default", "llama-server none"),
          ("auto / spec-default", "speculate auto", "llama-server spec-default")]
# (ratio, bound, strictly above, what): issue 45's goals, on the edit turns
GOALS = [("auto / none", 1.8, False, "speculate auto at least 1.8x speculate none on the edit turns"),
         ("auto / spec-default", 1.0, True, "speculate auto ahead of llama-server spec-default on the edit turns")]


def turn_kind(index: int) -> str:
    """The first turn asks for the module (write), every later one for a change to it (edit)."""
    return "write" if index == 0 else "edit"


def load_conversations(path: Path = CONVERSATIONS, ids: list[str] | None = None) -> list[dict]:
    """The conversations of `path` (those of `ids`, in that order, when given), each checked: an
    id, a source, and turns that are one non-empty line each, as speculate's standard input reads
    them: not ending in a backslash (the message would go on on the next line) nor starting with a
    slash (/exit, /clear, /regen: a command). ValueError says what is wrong."""
    conversations = []
    for number, c in harness.jsonl(path, numbered=True):
        if (not isinstance(c, dict) or not isinstance(c.get("id"), str) or c.get("source") not in SOURCES
                or not isinstance(c.get("turns"), list) or not c["turns"]):
            raise ValueError(f"{path}:{number}: a conversation needs an id, a source ({' or '.join(SOURCES)}) "
                             "and turns")
        for turn in c["turns"]:
            if (not isinstance(turn, str) or not turn.strip() or "\n" in turn or turn.endswith("\\")
                    or turn.startswith("/")):
                raise ValueError(f"{path}:{number}: {c['id']}: every turn must be one non-empty line, "
                                 "not starting with / nor ending in \\")
        conversations.append(c)
    return harness.by_ids(conversations, ids, "conversation", path)


# -- one run: a conversation under a configuration, in a fresh process -----------------


def speculate_turn(line: dict) -> dict:
    """A turn as `speculate -cnv --json` reports it (one JSON object), in the record every tool's shares;
    `dropped`: the oldest exchanges it left out to fit the context (llama-server refuses instead)."""
    return {"tokens": line["n_predict"], "decode_s": line["t_decode_s"],
            "prompt_processed": line["n_prompt"] - line["n_cached"], "prompt_kept": line["n_cached"],
            "drafted": line["n_drafted"], "accepted": line["n_accept"], "passes": line["n_steps"],
            "finish_reason": line["finish_reason"], "dropped": line.get("dropped", 0), "text": line["text"],
            "stats": {k: v for k, v in line.items() if k not in ("text", "tokens")}}


def server_turn(answer: dict) -> dict:
    """A turn as llama-server's /v1/chat/completions answers it, in the same record."""
    timings, choice = answer["timings"], answer["choices"][0]
    accepted = timings.get("draft_n_accepted", 0)  # absent without speculation
    return {"tokens": timings["predicted_n"], "decode_s": timings["predicted_ms"] / 1000,
            "prompt_processed": timings["prompt_n"], "prompt_kept": timings["cache_n"],
            "drafted": timings.get("draft_n", 0), "accepted": accepted, "passes": timings["predicted_n"] - accepted,
            "finish_reason": choice["finish_reason"], "dropped": 0, "text": choice["message"]["content"],
            "stats": timings}


def log_turn(cfg: Config, conversation: dict, index: int, turn: dict) -> None:
    speed = turn["tokens"] / turn["decode_s"] if turn["decode_s"] > 0 else 0.0
    print(f"  {conversation['id']} turn {index + 1} {cfg.name:26s} {turn['tokens']:5d} tokens "
          f"{speed:7.2f} t/s  prompt {turn['prompt_processed']} processed, {turn['prompt_kept']} kept  "
          f"accepted {turn['accepted']}/{turn['drafted']}  {turn['finish_reason']}", file=sys.stderr, flush=True)


def speculate_command(bench: argparse.Namespace, spec: str, *extra: str) -> list[str]:
    draft = ["-md", bench.draft] if bench.draft and spec == "auto" else []
    return [bench.speculate, "-m", bench.model, *draft, "-t", str(bench.threads), "-c", str(CTX), "--temp", "0",
            "--spec-type", spec, *extra]


def run_speculate(cfg: Config, bench: argparse.Namespace, conversation: dict, work: Path) -> dict:
    """`speculate -cnv --json`, the turns on its standard input, each turn's JSON read as it comes."""
    turns_file, log = work / f"{conversation['id']}.turns", work / f"{conversation['id']}-{cfg.spec}.log"
    turns_file.write_text("".join(t + "\n" for t in conversation["turns"]))
    cmd = speculate_command(bench, cfg.spec, "-cnv", "--json", "-n", str(bench.n_predict))
    turns = []
    with open(turns_file) as stdin, open(log, "wb") as stderr:
        proc = subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.PIPE, stderr=stderr, text=True, env=bench.env)
        for line in proc.stdout:
            if not line.strip():
                continue
            try:
                reported = json.loads(line)
                turn = speculate_turn(reported)
            except (ValueError, KeyError, TypeError) as e:
                proc.kill()
                sys.exit(f"{' '.join(cmd)}: not a turn's JSON ({e!r}): {line[:300]}")
            if reported.get("turn") != len(turns) + 1:
                proc.kill()
                sys.exit(f"{' '.join(cmd)}: turn {reported.get('turn')} reported where {len(turns) + 1} was due")
            turns.append(turn)
            log_turn(cfg, conversation, len(turns) - 1, turn)
        proc.wait()
    output = log.read_text(errors="replace")
    if proc.returncode or len(turns) != len(conversation["turns"]):
        sys.exit(f"{' '.join(cmd)} < {turns_file} exited {proc.returncode} after {len(turns)} of "
                 f"{len(conversation['turns'])} turns:\n{output[-3000:]}")
    return {"turns": turns, "calibrated": "calibrating" in output, "command": cmd}


def run_llama_server(cfg: Config, bench: argparse.Namespace, conversation: dict, work: Path) -> dict:
    """A fresh llama-server, the conversation sent turn by turn with its own earlier answers."""
    flags = ["-m", bench.target_file, "-t", str(bench.threads), "-c", str(CTX), "-np", "1",
             *(["--spec-default"] if cfg.spec == "spec-default" else [])]
    server = Server(flags, work / f"{conversation['id']}-llama-server-{cfg.spec}.log",
                    command=[str(bench.llama_server)], env=bench.env)
    messages, turns = [], []
    try:
        for index, text in enumerate(conversation["turns"]):
            messages.append({"role": "user", "content": text})
            status, answer = server.post("/v1/chat/completions", {
                "messages": messages, "max_tokens": bench.n_predict, "temperature": 0, "cache_prompt": True})
            if status != 200:
                sys.exit(f"{cfg.name}: {conversation['id']} turn {index + 1} failed ({status}): {answer}")
            turns.append(server_turn(answer))
            messages.append({"role": "assistant", "content": turns[-1]["text"]})
            log_turn(cfg, conversation, index, turns[-1])
    finally:
        server.close()
    return {"turns": turns, "calibrated": False, "command": [str(bench.llama_server), *flags]}


def calibrate(bench: argparse.Namespace, work: Path) -> None:
    """auto's cost curves, untimed: a short one-shot run, which measures them now if this machine
    has not cached them yet for these settings."""
    cmd = speculate_command(bench, "auto", "-p", "def add(a, b):", "-n", "8")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=bench.env)
    (work / "calibrate.log").write_text(proc.stderr)
    if proc.returncode:
        harness.failed(cmd, proc.returncode, proc.stderr)
    if "calibrating" in proc.stderr:
        print("calibrated auto (cached for later runs)", file=sys.stderr, flush=True)


def measure(cfg: Config, bench: argparse.Namespace, conversation: dict, work: Path, repeat: int,
            runner=None, kind=turn_kind) -> dict:
    """One run of `conversation` under `cfg` by `runner` (default: this scenario's, for cfg's tool),
    each turn numbered and given its kind (`kind(index)`), the run its labels and the time it took."""
    started = time.monotonic()
    runner = runner or (run_speculate if cfg.tool == "speculate" else run_llama_server)
    run = runner(cfg, bench, conversation, work)
    for index, turn in enumerate(run["turns"]):
        turn.update(turn=index + 1, kind=kind(index))
    run.update(config=cfg.name, conversation=conversation["id"], repeat=repeat, process_s=time.monotonic() - started)
    tokens, seconds = sum(t["tokens"] for t in run["turns"]), sum(t["decode_s"] for t in run["turns"])
    print(f"repeat {repeat + 1}  {conversation['id']}  {cfg.name:26s} {tokens:6d} tokens in {seconds:7.1f} s of "
          f"decoding ({tokens / seconds if seconds else 0:.2f} t/s)"
          + ("  (calibrated auto in this run)" if run["calibrated"] else ""), file=sys.stderr, flush=True)
    return run


# -- the summary ------------------------------------------------------------------------


def turn_records(runs: list[dict]) -> list[dict]:
    """Every turn of every run, with its run's configuration, conversation and repeat, and
    `same_as_unsped`: whether its text is the same tool's without speculation at the same turn and
    repeat (None where that did not run). Greedy speculation on a batch-invariant build changes no
    answer; once one differs, the conversation differs from there on."""
    records = [{**turn, "config": run["config"], "conversation": run["conversation"], "repeat": run["repeat"]}
               for run in runs for turn in run["turns"]]
    texts = {(r["config"], r["conversation"], r["turn"], r["repeat"]): r["text"] for r in records}
    for r in records:
        unsped_text = texts.get((unsped(r["config"]), r["conversation"], r["turn"], r["repeat"]))
        r["same_as_unsped"] = None if unsped_text is None else r["text"] == unsped_text
    return records


def aggregate(records: list[dict]) -> dict:
    """Turns together: their tokens over their decode seconds (the aggregate speed), and how many
    answers are their tool's without speculation."""
    tokens, seconds = sum(r["tokens"] for r in records), sum(r["decode_s"] for r in records)
    compared = [r["same_as_unsped"] for r in records if r["same_as_unsped"] is not None]
    return {"turns": len(records), "tokens": tokens, "seconds": seconds,
            "tps": tokens / seconds if seconds > 0 else None,
            "identical": sum(compared) if compared else None, "compared": len(compared)}


def summary_row(label: dict, records: list[dict], configs: list[str]) -> dict:
    """One row of the table: per configuration its aggregate over `records`, the first
    configuration's tokens per repeat, and the ratios of speeds of the configurations that ran."""
    per_config = {c: aggregate([r for r in records if r["config"] == c]) for c in configs}
    first = [r for r in records if r["config"] == configs[0]]
    repeats = len({r["repeat"] for r in first}) or 1
    ratios = {}
    for name, numerator, denominator in RATIOS:  # those of configurations that ran
        if numerator in per_config and denominator in per_config:
            top, bottom = per_config[numerator]["tps"], per_config[denominator]["tps"]
            ratios[name] = top / bottom if top and bottom else None
    return {**label, "tokens": sum(r["tokens"] for r in first) / repeats, "configs": per_config, "ratios": ratios}


def conversation_kinds(conversation: dict) -> list[str]:
    return [turn_kind(index) for index in range(len(conversation["turns"]))]


def summarise(runs: list[dict], configs: list[str], conversations: list[dict], kinds=conversation_kinds,
              timed: str = "edit") -> dict:
    """The rows of the per-turn table (a row for each of `kinds(conversation)`), its summary rows
    (the `timed` turns, all turns) and the totals table."""
    records = turn_records(runs)
    rows = [summary_row({"conversation": c["id"], "turn": index + 1, "kind": kind},
                        [r for r in records if r["conversation"] == c["id"] and r["turn"] == index + 1], configs)
            for c in conversations for index, kind in enumerate(kinds(c))]
    summary = [summary_row({"conversation": "all", "turn": f"{timed} turns", "kind": timed},
                           [r for r in records if r["kind"] == timed], configs),
               summary_row({"conversation": "all", "turn": "all turns", "kind": "all"}, records, configs)]
    totals = []
    for c in configs:
        mine = [r for r in records if r["config"] == c]
        passes = sum(r["passes"] for r in mine)
        totals.append({"config": c, **aggregate(mine),
                       **{k: sum(r[k] for r in mine)
                          for k in ("prompt_processed", "prompt_kept", "drafted", "accepted")},
                       "tokens_per_pass": sum(r["tokens"] for r in mine) / passes if passes else None,
                       "cut": sum(r["finish_reason"] == "length" for r in mine),
                       "dropped": sum(r["dropped"] for r in mine)})
    return {"configs": configs, "rows": rows, "summary": summary, "totals": totals}


def goals(summary: list[dict], wanted=GOALS) -> list[dict]:
    """The goals `wanted` (issue 45's by default), judged on the aggregate speeds of the timed turns,
    summarise's first summary row (None: not measured)."""
    timed = summary[0]
    found = []
    for ratio, bound, strictly, what in wanted:
        value = timed["ratios"].get(ratio)
        met = None if value is None else (value > bound if strictly else value >= bound)
        found.append({"goal": what, "ratio": ratio, "value": value, "bound": bound, "met": met})
    return found


def print_report(table: dict, found: list[dict], bench: argparse.Namespace, conversations: list[dict]) -> None:
    print(f"{len(conversations)} conversation(s) ({', '.join(c['id'] for c in conversations)}), greedy, at most "
          f"{bench.n_predict} tokens an answer, -c {CTX} -t {bench.threads}, {bench.repeats} repeat(s); "
          f"t/s: tokens over decode seconds, summed over the repeats")
    print("\n".join(conversation_table(table)))
    print()
    print("\n".join(totals_table(table)))
    print()
    print_goals(found)


def print_goals(found: list[dict]) -> None:
    for g in found:
        verdict = "not measured" if g["met"] is None else ("met" if g["met"] else "NOT met")
        print(f"goal: {g['goal']}: {verdict}" + ("" if g["value"] is None else f" ({g['value']:.2f}x)"))


# -- the command ------------------------------------------------------------------------


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The options this scenario shares with the `agent` scenario: the tools, the model, the
    settings, the configurations, the repeats and the output."""
    harness.add_speculate(parser)
    parser.add_argument("--llama-server", type=Path,
                        help="the llama-server executable (default: built once from the pinned sdist, as "
                             "the `parallel` scenario builds it)")
    parser.add_argument("-m", "--model", default="qwen2.5-coder-1.5b-instruct", help="target (path or registry name)")
    parser.add_argument("-md", "--model-draft", dest="draft",
                        help="a draft model for speculate auto (default: none, n-grams only, as --spec-default)")
    harness.add_threads(parser, default=2)
    parser.add_argument("-n", "--n-predict", type=int, default=1024, help="most tokens an answer (default %(default)s)")
    parser.add_argument("--only", nargs="+", action="extend", default=[], metavar="CONFIG_SUBSTRING",
                        help="run only the configurations whose name holds one of these, as 'speculate', "
                             "'llama-server', 'none', 'speculate auto'")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every conversation and configuration (default 1)")
    harness.add_output(parser, "the tables' rows and every turn of every run")


def check_common_arguments(parser: argparse.ArgumentParser, bench: argparse.Namespace) -> None:
    """add_common_arguments' options checked (parser.error, exit 2), and the configurations picked."""
    if bench.threads < 1 or bench.n_predict < 1 or bench.repeats < 1:
        parser.error("-t, -n and --repeats take a positive number")
    bench.configs = [c for c in CONFIGS if not bench.only or any(s in c.name for s in bench.only)]
    if not bench.configs:
        parser.error(f"--only {' '.join(bench.only)}: no such configuration; there are: "
                     + ", ".join(c.name for c in CONFIGS))
    for option, path in (("--speculate", bench.speculate), ("--llama-server", bench.llama_server)):
        if path is not None and not os.access(path, os.X_OK):
            parser.error(f"{option} {path}: not an executable")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.parser(__name__, __doc__)
    add_common_arguments(parser)
    parser.add_argument("--conversations", help="ids of scripts/conversations.jsonl, comma-separated (default: all)")
    bench = harness.parse(parser, argv)
    check_common_arguments(parser, bench)
    try:
        bench.picked = load_conversations(ids=bench.conversations.split(",") if bench.conversations else None)
    except ValueError as e:
        parser.error(f"--conversations: {e}" if bench.conversations else str(e))
    return bench


def prepare(bench: argparse.Namespace, work: Path) -> None:
    """What the configurations need before the first run: the environment every tool gets, the
    speculate executable (found if not given), the target's file as that speculate resolves it and
    the llama-server executable (built if not given), auto's calibration."""
    bench.env = dict(os.environ)
    bench.speculate = harness.speculate(bench.speculate)
    if any(c.tool == "llama-server" for c in bench.configs):
        bench.target_file = str(harness.model_file(bench.model, bench.speculate))
        bench.llama_server = bench.llama_server or llama_server_binary()
    if any(c.spec == "auto" for c in bench.configs):
        calibrate(bench, work)


def run_all(bench: argparse.Namespace, conversations: list[dict], prefix: str, **how) -> list[dict]:
    """Every conversation under every configuration, --repeats times (each repeat all of them, in the
    same order, so drift hits all alike), after prepare(); `how`: measure's runner and kind."""
    pairs = [(conversation, cfg) for conversation in conversations for cfg in bench.configs]
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        prepare(bench, Path(tmp))
        return [measure(cfg, bench, conversation, Path(tmp), repeat, **how)
                for repeat, (conversation, cfg) in harness.interleaved(pairs, bench.repeats)]


def run_meta(bench: argparse.Namespace, **extra) -> dict:
    """The -o file's meta: harness.meta with the tools, the model and the settings; plus `extra`."""
    return harness.meta(speculate=bench.speculate, model=bench.model, draft=bench.draft, threads=bench.threads,
                        ctx=CTX, n_predict=bench.n_predict, repeats=bench.repeats,
                        llama_server=str(bench.llama_server) if bench.llama_server else None,
                        GGML_CPU_TILED_MM=os.environ.get("GGML_CPU_TILED_MM"), **extra)


def main(argv: list[str] | None = None) -> int:
    bench = parse_args(argv)
    conversations = bench.picked
    runs = run_all(bench, conversations, "bench-conversation-")
    table = summarise(runs, [c.name for c in bench.configs], conversations)
    found = goals(table["summary"])
    print_report(table, found, bench, conversations)
    if bench.output:
        harness.write(bench.output, {
            "meta": run_meta(bench, conversations=[c["id"] for c in conversations]),
            "conversations": conversations, **table, "goals": found, "runs": runs})
    return 0
