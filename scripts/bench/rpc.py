"""What speculation saves when the target runs on an RPC server behind a slow link.

    python -m scripts.bench rpc [PROMPTS.jsonl] [--delays 0,2,5,20] [-n 64] [--category CAT ...]
                                [--limit N] [-C TYPES ...] [-o rpc-bench.json]

Starts `speculate rpc-server` on loopback, and for each delay D a relay (scripts/delay_relay.py)
that holds each direction D ms; then `speculate bench` over the edit and complete prompts with
the default target's layers on the server (`--rpc` through the relay) and the draft model kept
local, measuring target-only decoding and (by default) auto over the n-gram drafter alone and
over the n-gram drafter and the draft model (-C: other --spec-type values). Server, relay,
client and draft share this machine, so the table shows what latency does, not a second
machine's compute. Prints a table of target-only tokens per second and each configuration's
speedup (bench's medians), per delay, and writes them with each delay's calibrated verify costs
(measured over the link) to -o.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench import harness
from scripts.bench.servers import free_port

CONFIGS = ("auto,ngram-simple", "auto,ngram-simple,draft")
CATEGORIES = ("edit", "complete")


def wait_for(port: int, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"nothing listens on 127.0.0.1:{port}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


def bench(prompts: Path, endpoint: str, args: argparse.Namespace, out: Path) -> dict:
    """`speculate bench` through `endpoint`: its report (the -o file; its tables on standard output are dropped)."""
    cmd = [args.speculate, "bench", str(prompts), "-n", str(args.n), "--rpc", endpoint, "-o", str(out),
           "-t", str(args.threads), "-td", str(args.threads), *(["--limit", str(args.limit)] if args.limit else [])]
    for category in args.category or CATEGORIES:
        cmd += ["--category", category]
    for config in args.config or CONFIGS:
        cmd += ["-C", config]
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, env=args.env)
    if proc.returncode:
        harness.failed(cmd, proc.returncode, "(its standard error is above)")
    return json.loads(out.read_text())


def measure(delay: float, server_port: int, args: argparse.Namespace, folder: Path) -> dict:
    """`speculate bench` through a relay that holds each direction `delay` ms: its summary over all categories."""
    relay_port = free_port()
    relay = subprocess.Popen([sys.executable, str(harness.ROOT / "scripts" / "delay_relay.py"), str(relay_port),
                              f"127.0.0.1:{server_port}", "--delay-ms", str(delay)], env=args.env)
    try:
        wait_for(relay_port)
        report = bench(args.prompts, f"127.0.0.1:{relay_port}", args, folder / f"{delay}.json")
    finally:
        stop(relay)
    rows = {r["config"]: r for r in report["summary"] if r["category"] == "all"}
    print(f"D = {delay:g} ms: " + "; ".join(
        f"{name} {row['median_tps']:.2f} t/s ({row['median_speedup']:.2f}x)" for name, row in rows.items()), flush=True)
    return {"delay_ms": delay, "rows": rows, "costs": report["meta"]["costs"],
            "prompts": sorted({r["prompt"] for r in report["runs"]})}


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__name__, __doc__)
    parser.add_argument("prompts", nargs="?", type=Path, default=harness.PROMPTS)
    parser.add_argument("--delays", default="0,2,5,20", help="milliseconds added to each direction")
    parser.add_argument("-n", type=int, default=64)
    parser.add_argument("-t", "--threads", type=int, default=1, help="client threads (the server gets 1)")
    parser.add_argument("--category", action="append", help=f"prompt categories (default: {', '.join(CATEGORIES)})")
    parser.add_argument("--limit", type=int, default=0, help="only the first N prompts of those (0: all)")
    parser.add_argument("-C", "--config", action="append", help=f"--spec-type values (default: {', '.join(CONFIGS)})")
    parser.add_argument("-o", "--output", type=Path, default=Path("rpc-bench.json"),
                        help="write the rows and costs per delay here (JSON with meta; gzipped when the name ends "
                             "in .gz; default: %(default)s)")
    args = harness.parse(parser, argv)
    args.speculate = harness.speculate()
    args.env = {"GGML_CPU_TILED_MM": "0", **os.environ}  # batch-invariant CPU kernels, unless set otherwise
    server_port = free_port()
    server = subprocess.Popen([args.speculate, "rpc-server", "-p", str(server_port), "-t", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=args.env)
    results = []
    try:
        wait_for(server_port)
        with tempfile.TemporaryDirectory() as folder:
            for delay in (float(d) for d in args.delays.split(",")):
                results.append(measure(delay, server_port, args, Path(folder)))
    finally:
        stop(server)
    harness.write(args.output, {"meta": harness.meta(), "n": args.n, "results": results})
    return 0
