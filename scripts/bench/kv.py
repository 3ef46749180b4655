"""What the KV cache types cost and save: the default pair with f16, q8_0 and q4_0 KV caches.

    python -m scripts.bench kv -o docs/results/kv.json.gz

    python -m scripts.bench kv [--speculate PATH] [-m MODEL] [-md DRAFT] [--types f16,q8_0,q4_0] [-c 4096]
                               [-n 128] [-t THREADS] [--limit N] [-o OUT.json]

For each cache type T (K and V alike, -ctk T -ctv T; the draft keeps llama.cpp's f16, -ctkd and
-ctvd unset), in turn:

  memory   one `speculate -m MODEL -md DRAFT -ctk T -ctv T -c CTX -n 1 --json` run, with llama.cpp's
           log on (SPECULATE_LLAMA_LOG=1): the KV bytes speculate reports for each model
           (computed from the metadata and the types) beside llama.cpp's own
           "llama_kv_cache: size = ..." lines, and whether flash attention was on (a quantized V
           cache turns it on: -fa auto).
  speed    `speculate bench PROMPTS -C auto -ctk T -ctv T -c CTX -n N` over
           scripts/prompts.jsonl (--limit N: its first N): target-only decode speed (median over
           the prompts) and auto's speedup over target-only in the same run (bench's median of
           per-prompt ratios, and the worst prompt's), and the answers unlike target-only's
           with the target's top-2 logit margin where they part (a near-tie where the build
           scores a batch unlike single positions, as flash attention does on a CPU: `speculate
           doctor` says which). auto calibrates anew for each type (the calibration is keyed by
           the cache types).

Prints a Markdown table (`python scripts/tables.py kv` renders the same from -o's file) and writes
{"meta", "rows", "bench": {T: bench's JSON}} with -o (gzipped when it ends in .gz), again as each
type ends. Run it on an idle machine; with the defaults (20 prompts, three types) about 25
minutes on the 2-core development machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.bench import harness
from scripts.tables import kv as kv_table


def memory(bench: argparse.Namespace, kind: str) -> dict:
    """The models' KV bytes as speculate reports them and as llama.cpp logged them."""
    cmd = [bench.speculate, "-m", bench.model, "-md", bench.draft, "--spec-type", "draft", "-ctk", kind, "-ctv", kind,
           "-c", str(bench.ctx), "-t", str(bench.threads), "-p", "hi", "-n", "1", "--temp", "0", "--json"]
    # llama.cpp's log comes on standard error, beside the JSON: both are read
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "SPECULATE_LLAMA_LOG": "1"})
    if proc.returncode:
        harness.failed(cmd, proc.returncode, proc.stderr)
    out = json.loads(proc.stdout)
    logged = [float(x) * 2**20 for x in re.findall(r"llama_kv_cache: size = +([\d.]+) MiB", proc.stderr)]
    return {"target_kv_bytes": out["target"]["kv_bytes"], "draft_kv_bytes": out["draft"]["kv_bytes"],
            "logged_kv_bytes": logged, "flash_attn": out["target"]["flash_attn"],
            "cells": re.findall(r"llama_kv_cache: size = +[\d.]+ MiB \( *(\d+) cells", proc.stderr)}


def speed(bench: argparse.Namespace, kind: str, work: Path) -> dict:
    """`speculate bench` at this cache type: the results file it writes (its table on standard output is not kept)."""
    out = work / f"bench-{kind}.json"
    cmd = [bench.speculate, "bench", str(harness.PROMPTS), "-m", bench.model, "-md", bench.draft,
           "-C", "auto", "-ctk", kind, "-ctv", kind, "-c", str(bench.ctx), "-n", str(bench.n_predict),
           "-t", str(bench.threads), "-o", str(out)] + (["--limit", str(bench.limit)] if bench.limit else [])
    print(" ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode:
        harness.failed(cmd, proc.returncode, proc.stderr)
    return json.loads(out.read_text())


def answers(result: dict) -> dict[str, list[int]]:
    """Each prompt's target-only answer (a prompt the target answered with nothing is not timed,
    so not there)."""
    return {r["prompt"]: r["tokens"] for r in result["runs"] if r["config"] == "target only"}


def summary(kind: str, mem: dict, result: dict, so_far: dict) -> dict:
    """A type's row; its target-only answers against the first type's (the f16 cache's)."""
    rows = {r["config"]: r for r in result["summary"] if r["category"] == "all"}
    first, own = answers(next(iter(so_far.values()))), answers(result)
    return {"type": kind, **mem, "none_tps": rows["target only"]["median_tps"], "auto_tps": rows["auto"]["median_tps"],
            "auto_speedup": rows["auto"]["median_speedup"], "auto_min_speedup": rows["auto"]["min_speedup"],
            "mismatches": rows["auto"]["mismatches"],
            "margins": [r["mismatch"]["margin"] for r in result["runs"] if r["config"] == "auto" and r["mismatch"]],
            "prompts": len(result["meta"]["prompt_tokens"]),
            "timed": len(own), "unlike_first": sum(own.get(p) != tokens for p, tokens in first.items())}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__name__, __doc__)
    harness.add_speculate(p)
    p.add_argument("-m", "--model", default="qwen2.5-coder-1.5b-instruct", help="target (path or registry name)")
    p.add_argument("-md", "--model-draft", dest="draft", default="qwen2.5-coder-0.5b-instruct",
                   help="draft model (path or registry name)")
    p.add_argument("--types", default="f16,q8_0,q4_0", help="cache types, comma-separated (default f16,q8_0,q4_0)")
    p.add_argument("-c", "--ctx-size", dest="ctx", type=int, default=4096, help="context, every run (default 4096)")
    p.add_argument("-n", "--n-predict", dest="n_predict", type=int, default=128,
                   help="tokens per bench run (default 128)")
    harness.add_threads(p)
    p.add_argument("--limit", type=int, default=0, help="only the first N prompts (0: all)")
    harness.add_output(p, "the rows and every type's bench results")
    args = harness.parse(p, argv)
    args.speculate = harness.speculate(args.speculate)
    return args


def main(argv: list[str] | None = None) -> int:
    bench = parse_args(argv)
    data = {"meta": harness.meta(model=bench.model, draft=bench.draft, ctx=bench.ctx, n_predict=bench.n_predict,
                                 threads=bench.threads, limit=bench.limit),
            "rows": [], "bench": {}}
    with tempfile.TemporaryDirectory(prefix="bench-kv-") as tmp:
        for kind in bench.types.split(","):
            mem = memory(bench, kind)
            data["bench"][kind] = result = speed(bench, kind, Path(tmp))
            data["rows"].append(summary(kind, mem, result, data["bench"]))
            if bench.output:  # each type's results kept as it ends
                harness.write(bench.output, data)
    print("\n".join(kv_table(data)))
    return 0
