"""Repeated work: one kind of request, 20 times, with and without the pool of earlier output.

    python -m scripts.bench pool [-m MODEL] [-n 128] [--requests 20] [-t THREADS] [-o DIR]

A shell script that turns each of 20 log excerpts into the same JSON fields is the shape of
work where earlier answers predict the next one (the JSON skeleton, the field names, the
formats) better than the request's own prompt does. This runs that work four ways, greedy,
with speculate's default `--spec-type auto`:

  batch           `speculate batch` over the 20 requests (one process: the pool is on)
  batch, no pool  the same with --spec-pool-tokens 0
  20 runs         20 separate `speculate` invocations sharing --spec-pool FILE
  20 runs, no pool  20 invocations with --spec-pool-tokens 0

and reports, summed over the requests: generated tokens per target pass, decode speed
(generated tokens / decode seconds), and whether every text equals its no-pool counterpart
(it must, on a batch-invariant build: scripts/test.sh's). -o DIR (default
bench-pool-DATE-TIME here) keeps the batch outputs, the pool file and report.json, the results
(docs/results/pool.json is one).

The log excerpts are generated here from a fixed seed (no outside data): a few services,
levels, request ids, latencies and error messages, in the format of a common web service log.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from scripts.bench import harness

SERVICES = ["auth", "billing", "search", "checkout", "inventory", "notifications"]
ERRORS = ["connection reset by peer", "timeout waiting for upstream", "invalid token signature",
          "database deadlock detected", "rate limit exceeded", "payload too large"]
WARNINGS = ["slow query", "retrying request", "cache miss storm", "deprecated endpoint called"]
INSTRUCTION = ("Read this log excerpt and answer with one JSON object and nothing else, with exactly these "
               "fields: \"service\" (string), \"first_timestamp\" and \"last_timestamp\" (strings as in the log), "
               "\"error_count\" and \"warning_count\" (integers), \"slowest_request_id\" (string), "
               "\"slowest_latency_ms\" (integer), \"error_messages\" (list of strings).\n\n")


def excerpt(rng: random.Random) -> str:
    """8 to 12 lines of one service's log."""
    service = rng.choice(SERVICES)
    t = rng.randrange(0, 20 * 3600)
    lines = []
    for _ in range(rng.randrange(8, 13)):
        t += rng.randrange(1, 40)
        stamp = f"2026-11-{rng.randrange(1, 29):02d}T{t // 3600:02d}:{t // 60 % 60:02d}:{t % 60:02d}Z"
        request = f"req-{rng.randrange(16 ** 6):06x}"
        latency = int(rng.lognormvariate(4.5, 0.8))
        roll = rng.random()
        if roll < 0.2:
            lines.append(f"{stamp} ERROR {service} {request} {latency}ms {rng.choice(ERRORS)}")
        elif roll < 0.4:
            lines.append(f"{stamp} WARN  {service} {request} {latency}ms {rng.choice(WARNINGS)}")
        else:
            lines.append(f"{stamp} INFO  {service} {request} {latency}ms {rng.choice(['GET', 'POST'])} "
                         f"/{service}/{rng.choice(['v1', 'v2'])}/{rng.choice(['items', 'users', 'orders'])} 200")
    return "\n".join(lines)


def requests(count: int, seed: int = 2026) -> list[str]:
    rng = random.Random(seed)
    return [INSTRUCTION + excerpt(rng) for _ in range(count)]


def run_batch(speculate: str, prompts: list[str], common: list[str], extra: list[str], workdir: Path) -> list[dict]:
    path = workdir / "requests.jsonl"
    path.write_text("".join(json.dumps({"id": i, "messages": [{"role": "user", "content": p}]}) + "\n"
                            for i, p in enumerate(prompts)))
    out = workdir / f"batch{'-'.join(extra) or ''}.jsonl"
    out.unlink(missing_ok=True)
    cmd = [speculate, "batch", str(path), "-o", str(out), *common, *extra]
    code = subprocess.run(cmd).returncode
    if code:
        harness.failed(cmd, code, "(its output is above)")
    records = sorted(harness.jsonl(out), key=lambda r: r["id"])
    return [{"text": r["text"], **r["stats"]} for r in records]


def run_each(speculate: str, prompts: list[str], common: list[str], extra: list[str]) -> list[dict]:
    return [harness.run_json([speculate, "--chat", "-p", prompt, "--no-escape", "--json", *common, *extra])
            for prompt in prompts]


def totals(results: list[dict]) -> dict:
    tokens = sum(r["n_predict"] for r in results)
    return {"tokens": tokens, "passes": sum(r["n_steps"] for r in results),
            "tokens_per_pass": tokens / max(1, sum(r["n_steps"] for r in results)),
            "decode_tps": tokens / sum(r["t_decode_s"] for r in results),
            "drafted": sum(r["n_drafted"] for r in results), "accepted": sum(r["n_accept"] for r in results),
            "pool_steps": sum(p["steps"] for r in results for p in r["plans"] if p["drafter"] == "ngram-pool")}


def print_table(report: dict) -> None:
    """Each way's totals, its decode speed against the same way without the pool (the next row, or itself)."""
    names = list(report["ways"])
    print("| way | tokens | target passes | tokens per pass | pool steps | decode t/s | vs no pool |")
    print("|---|---|---|---|---|---|---|")
    for i, name in enumerate(names):
        t = report["ways"][name]
        base = report["ways"][names[i | 1]]["decode_tps"]
        print(f"| {name} | {t['tokens']} | {t['passes']} | {t['tokens_per_pass']:.2f} | {t['pool_steps']} | "
              f"{t['decode_tps']:.2f} | {harness.ratio(t['decode_tps'], base):.2f}x |")
    print(f"identical texts with and without the pool: {report['identical']}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__name__, __doc__)
    p.add_argument("-m", "--model", default="qwen2.5-coder-1.5b-instruct", help="target (path or registry name)")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="greedy tokens per request (default 128)")
    p.add_argument("--requests", type=int, default=20, help="log excerpts, one request each (default 20)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: speculate's)")
    p.add_argument("-o", "--out", type=Path, default=Path(time.strftime("bench-pool-%Y%m%d-%H%M%S")),
                   help="a directory for the runs' files and report.json (default: bench-pool-DATE-TIME)")
    return harness.parse(p, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    speculate = harness.speculate()
    # the batch-invariant CPU matmuls of scripts/test.sh's build, so texts with and without the
    # pool can be compared token for token (docs/exactness-and-builds.md)
    os.environ.setdefault("GGML_CPU_TILED_MM", "0")
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = requests(args.requests)
    common = ["-m", args.model, "-n", str(args.n_predict), "--temp", "0",
              *(["-t", str(args.threads)] if args.threads else [])]
    pool_file = args.out / "runs.pool"
    pool_file.unlink(missing_ok=True)
    ways = {
        "batch": lambda: run_batch(speculate, prompts, common, [], args.out),
        "batch, no pool": lambda: run_batch(speculate, prompts, common, ["--spec-pool-tokens", "0"], args.out),
        f"{len(prompts)} runs, --spec-pool": lambda: run_each(speculate, prompts, common,
                                                              ["--spec-pool", str(pool_file)]),
        f"{len(prompts)} runs, no pool": lambda: run_each(speculate, prompts, common, ["--spec-pool-tokens", "0"]),
    }
    results = {}
    for name, run in ways.items():
        started = time.time()
        print(f"{name} ...", file=sys.stderr, flush=True)
        results[name] = run()
        print(f"{name}: {time.time() - started:.0f} s", file=sys.stderr, flush=True)
    names = list(ways)
    report = {"meta": harness.meta(), "model": args.model, "n_predict": args.n_predict, "requests": len(prompts),
              "ways": {n: totals(r) for n, r in results.items()},
              "identical": {names[0]: [a["text"] for a in results[names[0]]] == [b["text"] for b in results[names[1]]],
                            names[2]: [a["text"] for a in results[names[2]]] == [b["text"] for b in results[names[3]]]}}
    harness.write(args.out / "report.json", report)
    print_table(report)
    print(f"results: {args.out / 'report.json'}")
    return 0
