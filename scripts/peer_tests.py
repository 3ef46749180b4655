#!/usr/bin/env python3
"""llama.cpp's own server tests, run against `speculate serve` or a llama-server, on local models.

    scripts/peer_tests.py run --server speculate|PATH [--server ...] [TEST ...] [--out DIR]
                              [--python PY] [--speculate PATH] [--timeout 120] [--slow] [-k EXPR]
    scripts/peer_tests.py summary DIR
    scripts/peer_tests.py compare DIR_A DIR_B [-o FILE] [--json FILE]

The suite is the pinned llama.cpp's `tools/server/tests` (pytest, one `unit/` file per feature),
copied out of the sdist scripts/test.sh keeps (.cache/sdist) into DIR/suite, fresh for every
`run`: its files are never edited. A TEST is `unit/test_completion.py`, `test_completion` or a
node id (`unit/test_completion.py::test_consistent_result_same_seed`); none: every `unit/` file.
Each file runs on its own (`-p no:cacheprovider`, a per-test timeout of --timeout seconds with
pytest-timeout, `-m "not slow"` as the suite's tests.sh unless --slow, which sets SLOW_TESTS=1
as well), one server at a time, on a free port (PORT).

A --server is `speculate` (`speculate serve`, from --speculate, default the one on PATH, else
the one beside this Python) or the path of a llama-server binary. The suite starts the binary named by
LLAMA_SERVER_BIN_PATH with llama-server's flags; that binary is a small wrapper (DIR/LABEL/bin)
that turns the model's location (--hf-repo/--hf-file, -hf, --model-url) into `-m LOCAL.gguf` of
a stand-in (STAND_INS below) and execs the server with every other flag unchanged: a flag the
server refuses fails the test, as it would for a user. `speculate serve` started with no model
(the router preset) gets NO_MODEL_STAND_IN.

Nothing reaches the network: this file is also the pytest plugin the runs load (`-p peer_tests`),
which makes `download_file(url)` give a local stand-in (DOWNLOADS) or skip the test, makes
`ServerPreset.load_all()` (the session's model download) do nothing, skips a test whose model
has no stand-in before its server starts, and puts an offline `wget` in place of the package.

Per run: DIR/LABEL/FILE.xml (junit, captured output included), FILE.log (pytest's output),
commands.log (each server command line the wrapper ran), DIR/LABEL/summary.json (each
test's outcome, and for a failure the first line of its reason and what the server said last)
and DIR/LABEL/summary.md (passed/failed/error/skipped per file, the failures grouped by reason,
each failed test), of which the first two parts are printed. Two --server: both run, one after the
other, then the comparison; `compare` makes it from two earlier runs. Exit 0 when every test
that ran passed, 1 when one failed, 2 on a usage error.

The suite's Python (--python) needs its requirements.txt and pytest-timeout: by default
.venv-peer, created on first use from PyPI.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tarfile
import types
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, also when loaded as a plugin
from scripts.bench import harness  # noqa: E402
from scripts.bench.harness import ROOT, model_file  # noqa: E402
from scripts.bench.servers import LLAMA_VERSION, SDIST  # noqa: E402

SUITE_IN_SDIST = f"llama_cpp_python-{LLAMA_VERSION}/vendor/llama.cpp/"
# what the suite reads besides itself, as it lies in vendor/llama.cpp: chat templates
# (../../../models/templates from the tests' folder) and the image test_security serves
SUITE_PARTS = ("tools/server/tests/", "models/templates/", "tools/mtmd/test-1.jpeg")
TESTS_DIR = "tools/server/tests"
PEER_VENV = ROOT / ".venv-peer"
CONFIG_ENV = "PEER_TESTS_CONFIG"
DEFAULT_TIMEOUT = 120

# The local model that stands in for each model the suite names: the first row whose pattern
# is found (case-insensitively) in "REPO/FILE" of --hf-repo/--hf-file, or in --model-url.
# Tests that check what a stories model writes fail on every server with a stand-in: compare
# servers per test. A model matched by no row (embeddings, reranking, vision, Gemma, Mistral)
# skips its test.
STAND_INS = [
    # pattern,                        registry model,                why
    (r"stories260K-infill",           "qwen2.5-coder-1.5b-instruct", "/infill needs FIM tokens"),
    (r"stories|tinyllamas",           "smollm2-135m-instruct",       "the smallest real model"),
    (r"qwen|phi|llama|hermes|functionary", "qwen2.5-coder-1.5b-instruct",
     "an instruct model with a chat template and FIM tokens"),
]
# Files the suite downloads itself (download_file): the first row whose pattern is found in the
# URL; any other (LoRAs, images) skips its test.
DOWNLOADS = [
    # pattern,                        registry model,          why
    (r"/stories15M-q4_0\.gguf$",      "smollm2-135m-instruct",
     "test_speculative's draft, for a stories target: it must share the target stand-in's vocabulary"),
]

# A server started with no model at all (the suite's router preset, for llama-server's router mode,
# which its CORS tests use): speculate serve has no router mode and would load its default pair,
# minutes on a small CPU, past the suite's 60 s for a server to start; it gets this model instead.
# llama-server runs as the suite asks.
NO_MODEL_STAND_IN = "smollm2-135m-instruct"
MODEL_FLAGS = ("-m", "--model")

# llama-server's flags that say where the model is, and which part of the location each gives
LOCATION_FLAGS = {**dict.fromkeys(("-hf", "-hfr", "--hf-repo"), "repo"), **dict.fromkeys(("-hff", "--hf-file"), "file"),
                  **dict.fromkeys(("-mu", "--model-url"), "url")}


def stand_in(reference: str, table: list[tuple[str, str, str]]) -> str | None:
    """The registry model of the first row of `table` whose pattern `reference` contains."""
    for pattern, model, _why in table:
        if re.search(pattern, reference, re.IGNORECASE):
            return model
    return None


# -- the wrapper the suite starts in place of llama-server ------------------------------------

def split_model_location(args: list[str]) -> tuple[str | None, list[str], int]:
    """(the model's location given by LOCATION_FLAGS as "REPO/FILE" or the URL, the other
    arguments, the index in them where the location stood)."""
    found: dict[str, str] = {}
    rest: list[str] = []
    at = -1
    i = 0
    while i < len(args):
        flag, eq, inline = args[i].partition("=")
        part = LOCATION_FLAGS.get(flag)
        if part and (eq or i + 1 < len(args)):
            found[part] = inline if eq else args[i + 1]
            i += 1 if eq else 2
            at = len(rest) if at < 0 else at
            continue
        rest.append(args[i])
        i += 1
    reference = found.get("url") or (f"{found['repo']}/{found.get('file', '')}" if "repo" in found else None)
    return reference, rest, at


def wrapped_command(config: dict, args: list[str]) -> list[str]:
    """The real server's command line for the suite's `args`: the model location made local."""
    reference, rest, at = split_model_location(args)
    if reference is None:
        given = any(arg.partition("=")[0] in MODEL_FLAGS for arg in args)
        chosen = ["-m", config["no_model"]] if config.get("no_model") and not given else []
        return [*config["server"], *chosen, *args]
    model = stand_in(reference, STAND_INS)
    if model is None:
        sys.exit(f"peer_tests: no local stand-in for {reference}")
    return [*config["server"], *rest[:at], "-m", config["paths"][model], *rest[at:]]


def write_wrapper(path: Path, config_path: Path) -> None:
    """An executable for LLAMA_SERVER_BIN_PATH: this script's `wrap`, in this Python."""
    path.write_text("#!/bin/sh\nexec " + shlex.join([sys.executable, str(Path(__file__).resolve()), "wrap",
                                                     str(config_path)]) + ' "$@"\n')
    path.chmod(0o755)


# -- the pytest plugin (-p peer_tests), loaded in the suite's folder ---------------------------

def pytest_load_initial_conftests(early_config, parser, args) -> None:
    """Before the suite's conftest imports utils: no download can happen in this session."""
    import pytest

    config = json.loads(Path(os.environ[CONFIG_ENV]).read_text())
    sys.modules["wget"] = offline_wget()
    sys.path.insert(0, os.getcwd())
    import utils  # the suite's, from its folder (the current one)

    def download_file(url: str, output_file_path: str | None = None) -> str:
        model = stand_in(url, DOWNLOADS)
        if model is None:
            pytest.skip(f"needs the network: downloads {url}", allow_module_level=True)
        return config["paths"][model]

    def start(server, *args, **kwargs):
        skip_without_stand_in(server)
        return original_start(server, *args, **kwargs)

    original_start = utils.ServerProcess.start
    utils.ServerProcess.start = start
    utils.download_file = download_file
    utils.ServerPreset.load_all = staticmethod(lambda: None)  # every model is a local stand-in


def skip_without_stand_in(server) -> None:
    """Skip the test now if its server's model has no local stand-in, or it needs a projector."""
    import pytest

    if server.mmproj_url:
        pytest.skip(f"needs the network: vision projector {server.mmproj_url}")
    reference = server.model_url or (f"{server.model_hf_repo}/{server.model_hf_file or ''}"
                                     if server.model_hf_repo else None)
    if reference and stand_in(reference, STAND_INS) is None:
        pytest.skip(f"needs the network: no local stand-in for {reference}")


def offline_wget() -> types.ModuleType:
    """A `wget` module (utils imports the package) whose download refuses: there is no network."""
    module = types.ModuleType("wget")

    def download(url: str, out: str | None = None, bar=None) -> str:
        raise OSError(f"peer_tests: no network here, not downloading {url}")

    module.download = download
    return module


# -- running the suite -------------------------------------------------------------------------

def extract_suite(dest: Path) -> Path:
    """A fresh copy of the suite (and what it reads) from the sdist under `dest`; its tests' folder."""
    if not SDIST.is_file():
        sys.exit(f"peer_tests: {SDIST} is missing: scripts/test.sh downloads it")
    shutil.rmtree(dest, ignore_errors=True)
    with tarfile.open(SDIST) as tar:
        members = [m for m in tar if m.name.startswith(SUITE_IN_SDIST)
                   and m.name[len(SUITE_IN_SDIST):].startswith(SUITE_PARTS)]
        for member in members:
            member.name = member.name[len(SUITE_IN_SDIST):]
        tar.extractall(dest, members=members, filter="data")
    return dest / TESTS_DIR


def suite_python(requested: str | None, tests: Path) -> str:
    """The Python that runs the suite: --python, else .venv-peer, made (or refreshed) from the
    suite's requirements.txt and pytest-timeout when they changed."""
    if requested:
        return requested
    python = PEER_VENV / "bin" / "python"
    requirements = (tests / "requirements.txt").read_text() + "pytest-timeout\n"
    stamp = PEER_VENV / "requirements.sha256"
    digest = hashlib.sha256(requirements.encode()).hexdigest()
    if python.exists() and stamp.is_file() and stamp.read_text() == digest:
        return str(python)
    print(f"peer_tests: installing the suite's requirements into {PEER_VENV} (PyPI) ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "-r", str(tests / "requirements.txt"),
                    "pytest-timeout"], check=True)
    stamp.write_text(digest)
    return str(python)


def has_module(python: str, module: str) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_by_file(tests: list[str], suite: Path) -> dict[str, list[str]]:
    """{"unit/test_x.py": [node ids, or the file itself]} in the order given; every unit/ file if none."""
    if not tests:
        return {f"unit/{p.name}": [f"unit/{p.name}"] for p in sorted((suite / "unit").glob("test_*.py"))}
    files: dict[str, list[str]] = {}
    for test in tests:
        path, sep, name = test.partition("::")
        stem = Path(path).stem
        file = f"unit/{stem}.py"
        if not (suite / file).is_file():
            raise ValueError(f"no such test file in the suite: {path} (looked for {file})")
        files.setdefault(file, []).append(f"{file}{sep}{name}")
    return {file: [file] if file in ids else ids for file, ids in files.items()}


def server_command(server: str, speculate: str) -> tuple[str, list[str]]:
    """(a label, the command the wrapper execs before the suite's flags) for a --server."""
    if server == "speculate":
        return "speculate", [speculate, "serve"]
    path = Path(server)
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ValueError(f"--server {server}: neither `speculate` nor an executable file")
    return path.name, [str(path.resolve())]


def stand_in_paths(speculate: str) -> dict[str, str]:
    """Where each stand-in's GGUF file is (`speculate models path`)."""
    models = {row[1] for row in STAND_INS + DOWNLOADS} | {NO_MODEL_STAND_IN}
    return {model: str(model_file(model, speculate)) for model in models}


def run_server(label: str, command: list[str], paths: dict[str, str], files: dict[str, list[str]], suite: Path,
               python: str, out: Path, options: argparse.Namespace) -> dict:
    """Every file of `files` against one server; its summary."""
    runs = out / label
    runs.mkdir(parents=True, exist_ok=True)
    config_path = runs / "config.json"
    commands_log = runs / "commands.log"
    commands_log.unlink(missing_ok=True)
    no_model = paths[NO_MODEL_STAND_IN] if label == "speculate" else None
    config_path.write_text(json.dumps({"server": command, "paths": paths, "commands_log": str(commands_log),
                                       "no_model": no_model}, indent=1))
    wrapper = runs / "bin" / "llama-server"
    wrapper.parent.mkdir(exist_ok=True)
    write_wrapper(wrapper, config_path)
    timeout = ["--timeout", str(options.timeout)] if has_module(python, "pytest_timeout") else []
    if not timeout:
        print(f"peer_tests: {python} has no pytest-timeout: no per-test timeout", file=sys.stderr)
    results = {}
    for file, ids in files.items():
        xml = runs / (Path(file).stem + ".xml")
        xml.unlink(missing_ok=True)
        shutil.rmtree(suite / "tmp", ignore_errors=True)
        (suite / "tmp").mkdir()  # download_file's and the slot tests' folder, empty for each file
        env = {**os.environ, CONFIG_ENV: str(config_path), "LLAMA_SERVER_BIN_PATH": str(wrapper),
               "PORT": str(free_port()), **({"SLOW_TESTS": "1"} if options.slow else {})}
        cmd = [python, str(Path(__file__).resolve()), "pytest", "-p", "peer_tests", "-p", "no:cacheprovider",
               "-q", "-rfEs", f"--junitxml={xml}", "-o", "junit_logging=all", *timeout,
               *([] if options.slow else ["-m", "not slow"]), *(["-k", options.k] if options.k else []), *ids]
        print(f"== {label}: {' '.join(ids)}", flush=True)
        proc = subprocess.run(cmd, cwd=suite, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, errors="replace")
        (runs / (Path(file).stem + ".log")).write_text(proc.stdout)
        results[file] = read_junit(xml) if xml.is_file() else {"crashed": proc.returncode, "tests": {}}
        print(f"   {file_line(file, results[file])}", flush=True)
    summary = {"server": label, "command": command, "files": results}
    (runs / "summary.json").write_text(json.dumps(summary, indent=1))
    (runs / "summary.md").write_text(summary_table(summary))
    return summary


# -- results -----------------------------------------------------------------------------------

OUTCOMES = ("passed", "failed", "error", "skipped")


def read_junit(xml: Path) -> dict:
    """{"tests": {name: {"outcome", "reason", "server_said"}}} from one file's junit XML."""
    tests = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        classname = case.get("classname", "")
        name = case.get("name", "")
        inner = classname.split(".", 2)[2] + "::" if classname.count(".") >= 2 else ""  # a test class
        outcome, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                reason = first_line(node.get("message") or node.text or "")
                break
        entry = {"outcome": outcome, "reason": reason}
        if outcome in ("failed", "error"):
            captured = "\n".join(n.text or "" for n in case if n.tag in ("system-out", "system-err"))
            entry["server_said"] = last_error_line(captured)
        tests[inner + name] = entry
    return {"tests": tests}


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")[:300]


def last_error_line(captured: str) -> str:
    """The last line of the captured output that says "error" (a server's refusal, mostly)."""
    lines = [line.strip() for line in captured.splitlines()
             if re.search(r"\berror\b", line, re.IGNORECASE)
             and not line.lstrip().startswith(('"', "{"))]  # not the suite printing a JSON answer
    return lines[-1][:300] if lines else ""


def counts(result: dict) -> dict[str, int]:
    found = {outcome: 0 for outcome in OUTCOMES}
    for test in result["tests"].values():
        found[test["outcome"]] += 1
    return found


def count_cells(result: dict) -> list[str]:
    """A file's passed, failed, error and skipped counts, or what happened when it has none."""
    if "crashed" in result:
        return [f"pytest exited {result['crashed']} with no results"]
    return [str(n) for n in counts(result).values()]


def file_line(file: str, result: dict) -> str:
    if "crashed" in result:
        return f"{file}: {count_cells(result)[0]}"
    return f"{file}: " + ", ".join(f"{n} {outcome}" for outcome, n in counts(result).items())


def summary_table(summary: dict, every_failure: bool = True) -> str:
    """Counts per file, the failures grouped by why, then (every_failure) each failed test."""
    lines = [f"# {summary['server']}: `{shlex.join(summary['command'])}`", "",
             "| file | passed | failed | error | skipped |", "|---|---:|---:|---:|---:|"]
    for file, result in summary["files"].items():
        lines.append(f"| {file} | " + " | ".join(count_cells(result)) + " |")
    failures = [(file, name, t) for file, result in summary["files"].items()
                for name, t in result["tests"].items() if t["outcome"] in ("failed", "error")]
    if not failures:
        return "\n".join(lines) + "\n"
    groups: dict[tuple[str, str], list[str]] = {}
    for file, name, t in failures:
        groups.setdefault((t["reason"], t.get("server_said", "")), []).append(f"{Path(file).stem}::{name}")
    lines += ["", "| failures | reason | the server said |", "|---:|---|---|"]
    lines += [f"| {len(tests)} | {cell(reason)} | {cell(said)} |"
              for (reason, said), tests in sorted(groups.items(), key=lambda g: -len(g[1]))]
    if every_failure:
        lines += ["", "| failed test | reason | the server said |", "|---|---|---|"]
        lines += [f"| {Path(file).stem}::{name} | {cell(t['reason'])} | {cell(t.get('server_said', ''))} |"
                  for file, name, t in failures]
    return "\n".join(lines) + "\n"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def comparison_table(a: dict, b: dict) -> str:
    """Per file, both servers' counts; then every test whose outcome differs."""
    la, lb = a["server"], b["server"]
    lines = [f"| file | {la} passed/failed/error/skipped | {lb} passed/failed/error/skipped |",
             "|---|---|---|"]
    files = list(dict.fromkeys([*a["files"], *b["files"]]))
    empty = {"tests": {}}
    for file in files:
        lines.append(f"| {file} | " + " | ".join("/".join(count_cells(s["files"].get(file, empty))) for s in (a, b))
                     + " |")
    lines += ["", f"| test | {la} | {lb} | {lb}'s reason |", "|---|---|---|---|"]
    for file in files:
        ta, tb = (s["files"].get(file, empty)["tests"] for s in (a, b))
        for name in dict.fromkeys([*ta, *tb]):
            oa, ob = (t.get(name, {}).get("outcome", "-") for t in (ta, tb))
            if oa != ob:
                why = tb.get(name, {})
                lines.append(f"| {Path(file).stem}::{name} | {oa} | {ob} | "
                             f"{cell(why.get('server_said') or why.get('reason', ''))} |")
    return "\n".join(lines) + "\n"


def load_summary(path: str) -> dict:
    file = Path(path) / "summary.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        sys.exit(f"peer_tests: {file}: no summary (run `peer_tests.py run` first)")
    return json.loads(file.read_text())


def any_failed(summaries: list[dict]) -> bool:
    return any("crashed" in r or counts(r)["failed"] or counts(r)["error"]
               for s in summaries for r in s["files"].values())


# -- command line ------------------------------------------------------------------------------

def main(argv: list[str]) -> int:
    if argv[:1] == ["wrap"]:  # the suite starting a server
        config = json.loads(Path(argv[1]).read_text())
        command = wrapped_command(config, argv[2:])
        with open(config["commands_log"], "a") as log:  # what each test started, for reading its failure
            log.write(shlex.join(command) + "\n")
        os.execv(command[0], command)
    if argv[:1] == ["pytest"]:  # a run of one file, in the suite's Python
        import pytest
        return pytest.main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run tests against one or two servers")
    run.add_argument("tests", nargs="*", help="unit/test_x.py, test_x or a node id (default: every unit/ file)")
    run.add_argument("--server", action="append", required=True,
                     help="`speculate` or a llama-server binary; twice to compare")
    run.add_argument("--out", default=str(ROOT / ".cache" / "peer-tests"),
                     help="results and the suite's copy (default .cache/peer-tests)")
    run.add_argument("--python", help="the suite's Python (default .venv-peer, made on first use)")
    run.add_argument("--speculate", help="the speculate executable (default: on PATH, else beside this Python)")
    run.add_argument("--timeout", type=int, default=DEFAULT_TIMEOUT, help="seconds per test (pytest-timeout)")
    run.add_argument("--slow", action="store_true",
                     help="run the slow tests too (marked slow, or asking SLOW_TESTS=1); many need the network")
    run.add_argument("-k", help="pytest's -k expression")
    summary = commands.add_parser("summary", help="print a run's summary")
    summary.add_argument("dir", help="DIR/LABEL of a run")
    compare = commands.add_parser("compare", help="compare two runs")
    compare.add_argument("a", help="DIR/LABEL of one run")
    compare.add_argument("b", help="DIR/LABEL of the other")
    compare.add_argument("-o", "--output", help="also write the table here")
    compare.add_argument("--json", help="also write both runs' outcomes, with the machine and commit (docs/results)")
    args = parser.parse_args(argv)

    if args.command == "summary":
        print(summary_table(load_summary(args.dir)), end="")
        return 0
    if args.command == "compare":
        table = comparison_table(load_summary(args.a), load_summary(args.b))
        print(table, end="")
        if args.output:
            Path(args.output).write_text(table)
        if args.json:
            from results import meta  # noqa: E402 (scripts/results.py: the date, machine and commit)
            runs = [load_summary(args.a), load_summary(args.b)]
            Path(args.json).write_text(json.dumps({"meta": meta(), "runs": runs}, indent=1))
        return 0
    if len(args.server) > 2:
        parser.error("--server: one, or two to compare")
    speculate = harness.speculate(args.speculate)
    out = Path(args.out).resolve()
    try:
        servers = [server_command(s, speculate) for s in args.server]
        if len({label for label, _ in servers}) < len(servers):
            raise ValueError("--server: the two servers need different names")
        suite = extract_suite(out / "suite")
        files = group_by_file(args.tests, suite)
    except ValueError as e:
        parser.error(str(e))
    python = suite_python(args.python, suite)
    paths = stand_in_paths(speculate)
    summaries = [run_server(label, command, paths, files, suite, python, out, args) for label, command in servers]
    for s in summaries:
        print(f"\n{summary_table(s, every_failure=False)}", end="")
    if len(summaries) == 2:
        table = comparison_table(*summaries)
        (out / "comparison.md").write_text(table)
        print(f"\n{table}", end="")
    return 1 if any_failed(summaries) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
