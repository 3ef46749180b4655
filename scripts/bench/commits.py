"""speculate's own code at several commits, on one llama-cpp-python build: what a change did to `batch`'s throughput.

    python -m scripts.bench commits REV [REV ...] [-m MODEL] [-md DRAFT] [--np 1,4] [--spec-type none,auto]
                                    [-n 64] [--repeats 3] [-t THREADS] [-c 4096] [--requests FILE]
                                    [--no-ceiling] [-o results.json]

Each REV (a git revision; `.` for the working tree as it is) is checked out into a temporary
worktree, and its code runs from there (the folder it runs in and PYTHONPATH; each run checks
that `speculative` came from its commit's tree) over the llama-cpp-python of this Python (the same
build for every commit, so that only speculate's code differs). The worktrees are removed at the
end, also when the run is interrupted or terminated. For every -np N of --np and
spec type of --spec-type, `speculate batch REQUESTS -np N --spec-type T --temp 0 -n N_PREDICT
--ignore-eos` runs once per commit and repeat, interleaved (each repeat: every configuration,
every commit), so drift hits all alike; `auto` gets the draft model (-md). The requests default to
eight one-line prompts of 10 to 15 tokens, so that with --ignore-eos decoding is the run.

Measured per run: the summary's tokens per second (generated tokens over the seconds from the
first request on), and the time spent outside `llama_decode` per generated token (the run's
seconds less the C call's own time, which a wrapper around `llama_cpp.llama_decode` sums; the
load's warm-up decode left out): speculate's own cost. Before the timed runs, once and untimed,
each commit runs `auto` at each N, so that auto's cost calibration (cached per machine) is not
timed. Unless --no-ceiling, the `ceiling` scenario runs last, in the same session, for the Ns
given: what batching can gain on this machine at all.

Printed and written (-o): per configuration and commit, the median throughput (min-max), its
ratio to the first commit's, and the median time outside llama_decode per token; per spec type
and commit, -np N's gain over -np 1, and that gain over the ceiling at N.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.bench import harness
from scripts.bench.harness import ROOT

# one-line prompts of 10 to 15 tokens, code and prose
PROMPTS = ("Write a short story about a robot who learns to paint:",
           "Explain in simple words how a rainbow is formed in the sky:",
           'def quicksort(arr):\n    """Sort a list of numbers."""',
           "Once upon a time, in a small village by the sea, there",
           "List the planets of the solar system in order from the sun:",
           "Describe the taste of a fresh summer strawberry to a friend:",
           "import numpy as np\n\n# compute the mean of each column of a matrix",
           "The most important lesson I learned at school was that")

# speculate's command line with llama_decode's own seconds summed and written at exit
TIMED = """
import atexit, json, os, sys, time
import llama_cpp
decode, total = llama_cpp.llama_decode, {"s": 0.0, "n": 0}
def timed(ctx, batch):
    started = time.perf_counter()
    code = decode(ctx, batch)
    llama_cpp.llama_synchronize(ctx)
    total["n"] += 1
    if total["n"] > 1:  # the first is the load's warm-up
        total["s"] += time.perf_counter() - started
    return code
llama_cpp.llama_decode = timed
import speculative
total["code"] = os.path.dirname(speculative.__file__)
atexit.register(lambda: open(os.environ["DECODE_SECONDS"], "w").write(json.dumps(total)))
from speculative.cli.main import main
sys.argv[0] = "speculate"
sys.exit(main())
"""


@contextlib.contextmanager
def checked_out(revs: list[str], work: Path):
    """Each revision's code: a temporary worktree of it (`.`: the repository itself), removed after."""
    trees, made = {}, []
    terminated = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as Ctrl-C: the worktrees removed
    try:
        for rev in revs:
            if rev == ".":
                trees[rev] = ROOT
                continue
            path = work / f"tree-{len(made)}"
            proc = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev],
                                  capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"{rev}: {proc.stderr.strip().splitlines()[-1]}")
            made.append(path)
            trees[rev] = path
        yield trees
    finally:
        for path in made:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], capture_output=True)
        signal.signal(signal.SIGTERM, terminated)


def describe(rev: str) -> str:
    """A revision as a short hash (`.`: HEAD's with '+' where the working tree differs, else with
    "(tree)", so that `. HEAD` are two columns)."""
    if rev == ".":
        here = harness.commit() or "."
        return here if here.endswith("+") else f"{here} (tree)"
    proc = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], capture_output=True, text=True)
    return proc.stdout.strip() or rev


def run(bench: argparse.Namespace, tree: Path, n: int, spec: str, work: Path, n_predict: int) -> dict:
    """One `speculate batch` of the requests with `tree`'s code, in a fresh process."""
    tag = f"{tree.name}-{n}-{spec}"
    out, summary, decode = (work / f"{tag}.{ext}" for ext in ("out.jsonl", "summary.json", "decode.json"))
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-c", TIMED, "batch", bench.requests_file, "-o", out, "--summary", summary,
           "-m", bench.target, *(["-md", bench.draft] if spec == "auto" else []), "--temp", "0",
           "-n", str(n_predict), "--ignore-eos", "-np", str(n), "--spec-type", spec, "-t", str(bench.threads),
           "-c", str(bench.ctx)]
    # run in the tree: `python -c` puts its folder first on sys.path, before PYTHONPATH
    harness.run_logged(cmd, work / f"{tag}.log", env={**bench.env, "PYTHONPATH": str(tree),
                                                      "DECODE_SECONDS": str(decode)}, cwd=tree)
    report, decoded = json.loads(summary.read_text()), json.loads(decode.read_text())
    if Path(decoded["code"]).resolve() != (tree / "speculative").resolve():
        sys.exit(f"{tree}: the run's speculative came from {decoded['code']}")
    if not report["all_succeeded"]:
        sys.exit(f"{' '.join(map(str, cmd))}: some requests failed, see {out}")
    return {"code": decoded["code"], "tps": report["tokens_per_second"], "seconds": report["seconds"],
            "n_predict": report["n_predict"],
            "llama_decode_s": decoded["s"], "llama_decodes": decoded["n"],
            "outside_llama_decode_ms": (report["seconds"] - decoded["s"]) / report["n_predict"] * 1000}


def summarise(runs: list[dict], labels: list[str], ceiling: dict | None) -> dict:
    """Rows per configuration and commit, and gains per spec type and commit."""
    rows = []
    for config in dict.fromkeys(r["config"] for r in runs):
        first = None
        for label in labels:
            mine = [r for r in runs if r["config"] == config and r["commit"] == label]
            tps = harness.median(r["tps"] for r in mine)
            first = tps if first is None else first
            rows.append({"config": config, "n": mine[0]["n"], "spec": mine[0]["spec"], "commit": label,
                         "tps": tps, "min": min(r["tps"] for r in mine), "max": max(r["tps"] for r in mine),
                         "ratio": harness.ratio(tps, first),
                         "outside_llama_decode_ms": harness.median(r["outside_llama_decode_ms"] for r in mine)})
    gains = []
    for row in rows:
        single = next((r for r in rows if r["n"] == 1 and r["spec"] == row["spec"] and r["commit"] == row["commit"]),
                      None)
        if row["n"] > 1 and single:
            at = harness.median(ceiling["n"][str(row["n"])]) if ceiling else None
            gain = harness.ratio(row["tps"], single["tps"])
            gains.append({"spec": row["spec"], "n": row["n"], "commit": row["commit"], "gain": gain,
                          "ceiling": at, "of_ceiling": harness.ratio(gain, at)})
    return {"rows": rows, "gains": gains}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__name__, __doc__)
    p.add_argument("revs", nargs="+", metavar="REV", help="git revisions to compare (`.`: the working tree)")
    p.add_argument("-m", "--model", default="qwen2.5-coder-1.5b-instruct", help="target (path or registry name)")
    p.add_argument("-md", "--model-draft", dest="draft", default="qwen2.5-coder-0.5b-instruct",
                   help="draft model for auto (path or registry name)")
    p.add_argument("--np", default="1,4", help="requests at once, comma-separated (default 1,4)")
    p.add_argument("--spec-type", dest="specs", default="none,auto", help="spec types, comma-separated")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="tokens per request, --ignore-eos (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="runs of every configuration and commit (default 3)")
    harness.add_threads(p)
    p.add_argument("-c", "--ctx-size", dest="ctx", type=int, default=4096)
    p.add_argument("--requests", type=Path, help="a `speculate batch` requests file (default: eight short prompts)")
    p.add_argument("--no-ceiling", dest="ceiling", action="store_false", help="leave the ceiling out")
    harness.add_output(p, "every run's figures and the tables' rows")
    bench = harness.parse(p, argv)
    try:
        bench.nps = [int(n) for n in bench.np.split(",")]
    except ValueError:
        p.error(f"--np {bench.np}: comma-separated numbers")
    bench.specs = bench.specs.split(",")
    if bench.repeats < 1 or bench.n_predict < 1 or min(bench.nps) < 1:
        p.error("--np, -n and --repeats take positive numbers")
    return bench


def main(argv: list[str] | None = None) -> int:
    bench = parse_args(argv)
    labels = [describe(rev) for rev in bench.revs]
    if len(set(labels)) < len(labels):
        sys.exit(f"{' '.join(bench.revs)}: some of these name the same commit ({', '.join(labels)})")
    bench.env = dict(os.environ)
    bench.target = str(harness.model_file(bench.model).resolve())  # the runs are in the trees' folders
    bench.draft = str(harness.model_file(bench.draft).resolve()) if "auto" in bench.specs else bench.draft
    configs = [(n, spec) for spec in bench.specs for n in bench.nps]
    runs, ceiling = [], None
    with tempfile.TemporaryDirectory(prefix="bench-commits-") as tmp, checked_out(bench.revs, Path(tmp)) as trees:
        work = Path(tmp)
        requests = harness.jsonl(bench.requests) if bench.requests else [
            {"id": i, "prompt": p} for i, p in enumerate(PROMPTS)]
        bench.requests_file = work / "requests.jsonl"
        bench.requests_file.write_text("".join(json.dumps(r) + "\n" for r in requests))
        for rev in bench.revs if "auto" in bench.specs else []:
            for n in bench.nps:  # untimed: auto's costs measured for this N, if not cached yet
                run(bench, trees[rev], n, "auto", work, 8)
        for repeat, (n, spec) in harness.interleaved(configs, bench.repeats):
            for rev, label in zip(bench.revs, labels):
                result = run(bench, trees[rev], n, spec, work, bench.n_predict)
                runs.append({"config": f"batch -np {n} {spec}", "n": n, "spec": spec, "commit": label,
                             "repeat": repeat, **result})
                print(f"repeat {repeat + 1}  {label:10s} batch -np {n} {spec:5s} {result['tps']:7.2f} t/s  "
                      f"outside llama_decode {result['outside_llama_decode_ms']:.3f} ms/token", file=sys.stderr,
                      flush=True)
        if bench.ceiling:
            ceiling = harness.run_json([sys.executable, "-m", "scripts.bench", "ceiling", bench.target,
                                        "-t", str(bench.threads), "--ns", ",".join(map(str, sorted(set(bench.nps)))),
                                        "--steps", "16", "--rounds", "3"], env=bench.env, cwd=ROOT)
    table = summarise(runs, labels, ceiling)
    from scripts import tables
    print("\n".join(tables.commits({"rows": table["rows"], "gains": table["gains"], "meta": {"commits": labels}})))
    if bench.output:
        harness.write(bench.output, {
            "meta": harness.meta(commits=labels, revs=bench.revs, model=bench.model, draft=bench.draft,
                                 threads=bench.threads, ctx=bench.ctx, n_predict=bench.n_predict,
                                 repeats=bench.repeats, requests=requests,
                                 llama_cpp_python=sys.executable),
            "ceiling": ceiling, **table, "runs": runs})
    return 0
