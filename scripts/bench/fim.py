"""Fill-in-the-middle as an editor asks for it: `auto` against target-only through /infill.

    python -m scripts.bench fim [-m MODEL] [--cases N] [--seed S] [-n N] [--prefix-lines N]
                                [--suffix-lines N] [-o results.json] [-- extra serve flags]

Real code that nobody here wrote: functions of the Python standard library this scenario runs on
(its modules are the Python Software Foundation's, under the PSF License Agreement; the
version is printed, since the code differs between versions). For each case, a span of 1-6
whole lines is cut out of a function's body, and the request is what llama.vim sends with the
cursor at the start of that span: `input_prefix` the lines before (up to 256, llama.vim's
n_prefix), `prompt` the span's indentation, `input_suffix` the lines after (up to 64,
n_suffix), `n_predict` 128, greedy, no time limit. Two servers answer every request, one with
`--spec-type auto` and one with `--spec-type none`, one after the other (which first
alternates), never at once. Printed: per case, tokens, each server's decode speed, auto's
speedup, tokens per target pass and acceptance, and whether the two answers are the same
token for token; then medians. Exit 1 if any answer differs. Without -m the servers load
the registry's default target (README). `-o docs/results/fim.json.gz` writes the committed file.
"""

from __future__ import annotations

import argparse
import ast
import random
import sys
import sysconfig
import tempfile
from pathlib import Path

from scripts.bench import harness
from scripts.bench.servers import Server

MODULES = ("textwrap.py", "difflib.py", "heapq.py", "json/decoder.py", "json/encoder.py", "argparse.py",
           "shlex.py", "fnmatch.py", "calendar.py", "string.py", "csv.py", "configparser.py", "tokenize.py",
           "ipaddress.py", "fractions.py", "statistics.py", "pprint.py", "glob.py", "posixpath.py", "base64.py")
SPECS = ("none", "auto")


def cases(n: int, seed: int, prefix_lines: int, suffix_lines: int) -> list[dict]:
    """n requests, each a function of one of MODULES with a span of its body cut out."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    rng = random.Random(seed)
    functions = []
    for module in MODULES:
        lines = (stdlib / module).read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            body = getattr(node, "body", [])
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - body[0].lineno >= 8:
                functions.append((module, node.name, body[0].lineno - 1, node.end_lineno, lines))
    chosen = []
    for module, name, first, end, lines in rng.sample(functions, n):
        start = rng.randrange(first, end - 2)
        while not lines[start].strip():  # the cursor on a line with code
            start += 1
        stop = min(start + rng.randint(1, 6), end)
        indent = lines[start][: len(lines[start]) - len(lines[start].lstrip())]
        chosen.append({
            "id": f"{module}:{name}:{start + 1}", "removed": "\n".join(lines[start:stop]),
            "body": {"input_prefix": "".join(line + "\n" for line in lines[max(0, start - prefix_lines):start]),
                     "prompt": indent,
                     "input_suffix": "".join(line + "\n" for line in lines[stop:stop + suffix_lines])},
        })
    return chosen


def infill(server: Server, body: dict, n_predict: int) -> dict:
    status, answer = server.post("/infill", {**body, "n_predict": n_predict, "temperature": 0,
                                             "cache_prompt": True, "stream": False})
    if status != 200:
        sys.exit(f"/infill failed ({status}): {answer}")
    return answer


def ask_both(requests: list[dict], model: list[str], extra: list[str], n_predict: int) -> list[dict]:
    """Every request to both servers, one after the other; which first alternates from case to case."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        servers = {spec: Server([*model, "--spec-type", spec, "-c", "8192", *extra], Path(tmp) / f"{spec}.log")
                   for spec in SPECS}
        try:
            for i, case in enumerate(requests):
                order = SPECS if i % 2 == 0 else SPECS[::-1]
                answers = {spec: infill(servers[spec], case["body"], n_predict) for spec in order}
                results.append({"id": case["id"], "removed": case["removed"], **answers})
        finally:
            for server in servers.values():
                server.close()
    return results


def print_table(results: list[dict]) -> list[bool]:
    """A row per case, then the medians; whether each case's two answers are the same."""
    print(f"{'case':44s} {'tokens':>6} {'alone t/s':>9} {'auto t/s':>8} {'speedup':>7} {'tok/pass':>8} "
          f"{'accepted':>8} {'same':>5}")
    speedups, per_pass, same = [], [], []
    for r in results:
        alone, auto = r["none"]["timings"], r["auto"]["timings"]
        speedups.append(harness.ratio(auto["predicted_per_second"], alone["predicted_per_second"]))
        per_pass.append(auto["tokens_per_step"])
        same.append(r["none"]["tokens"] == r["auto"]["tokens"])
        accepted = f"{auto['draft_n_accepted']}/{auto['draft_n']}"
        print(f"{r['id'][:44]:44s} {auto['predicted_n']:6d} {alone['predicted_per_second']:9.1f} "
              f"{auto['predicted_per_second']:8.1f} {speedups[-1]:6.2f}x {per_pass[-1]:8.2f} {accepted:>8} "
              f"{'yes' if same[-1] else 'NO':>5}")
    print(f"median speedup {harness.median(speedups):.2f}x (worst {min(speedups):.2f}x), median tokens per "
          f"pass {harness.median(per_pass):.2f}, {sum(same)}/{len(same)} answers identical")
    return same


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = harness.parser(__name__, __doc__)
    parser.add_argument("-m", "--model", help="target model (default: the registry's default target)")
    parser.add_argument("--cases", type=int, default=20, help="requests (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="which functions and spans (default 0)")
    parser.add_argument("-n", "--n-predict", type=int, default=128, help="tokens per answer (default 128)")
    parser.add_argument("--prefix-lines", type=int, default=256, help="lines before the cursor (default 256)")
    parser.add_argument("--suffix-lines", type=int, default=64, help="lines after it (default 64)")
    harness.add_output(parser, "every answer and its timings")
    return harness.parse(parser, argv, known=True)


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    requests = cases(args.cases, args.seed, args.prefix_lines, args.suffix_lines)
    model = ["-m", args.model] if args.model else []
    results = ask_both(requests, model, extra, args.n_predict)
    print(f"/infill on Python {sys.version.split()[0]}'s standard library, {len(results)} cases (seed {args.seed}), "
          f"{args.n_predict} tokens at most, greedy; serve {' '.join(model + extra)}")
    same = print_table(results)
    if args.output:
        harness.write(args.output, {"meta": harness.meta(python_stdlib=sys.version.split()[0],
                                                         n_predict=args.n_predict, serve_flags=model + extra),
                                    "results": results})
    return 0 if all(same) else 1
