"""What speculation saves when the target runs on an RPC server behind a slow link.

    python scripts/bench_rpc.py [PROMPTS.jsonl] [--delays 0,2,5,20] [-n 64] [--category CAT ...]
                                [--limit N] [-C TYPES ...] [-o rpc-bench.json]

Starts `speculate rpc-server` on loopback, and for each delay D a relay (scripts/delay_relay.py)
that holds each direction D ms; then `speculate bench` over the edit and complete prompts with
the default target's layers on the server (`--rpc` through the relay) and the draft model kept
local, measuring target-only decoding and (by default) auto over the n-gram drafter alone and
over the n-gram drafter and the draft model (-C: other --spec-type values). Server, relay, client and draft share this machine, so the
table shows what latency does, not a second machine's compute. Prints a table of target-only
tokens per second and each configuration's speedup (bench's medians), per delay, and writes
them with each delay's calibrated verify costs (measured over the link) to -o.
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

from results import meta

ROOT = Path(__file__).resolve().parents[1]
SPECULATE = str(Path(sys.executable).with_name("speculate"))
CONFIGS = ("auto,ngram-simple", "auto,ngram-simple,draft")
CATEGORIES = ("edit", "complete")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def bench(prompts: Path, endpoint: str, args, out: Path) -> dict:
    cmd = [SPECULATE, "bench", str(prompts), "-n", str(args.n), "--rpc", endpoint, "-o", str(out),
           "-t", str(args.threads), "-td", str(args.threads), *(["--limit", str(args.limit)] if args.limit else [])]
    for category in args.category or CATEGORIES:
        cmd += ["--category", category]
    for config in args.config or CONFIGS:
        cmd += ["-C", config]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompts", nargs="?", type=Path, default=ROOT / "scripts/prompts.jsonl")
    parser.add_argument("--delays", default="0,2,5,20", help="milliseconds added to each direction")
    parser.add_argument("-n", type=int, default=64)
    parser.add_argument("-t", "--threads", type=int, default=1, help="client threads (the server gets 1)")
    parser.add_argument("--category", action="append", help=f"prompt categories (default: {', '.join(CATEGORIES)})")
    parser.add_argument("--limit", type=int, default=0, help="only the first N prompts of those (0: all)")
    parser.add_argument("-C", "--config", action="append", help=f"--spec-type values (default: {', '.join(CONFIGS)})")
    parser.add_argument("-o", "--output", type=Path, default=Path("rpc-bench.json"))
    args = parser.parse_args()
    server_port = free_port()
    server = subprocess.Popen([SPECULATE, "rpc-server", "-p", str(server_port), "-t", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = []
    try:
        wait_for(server_port)
        with tempfile.TemporaryDirectory() as folder:
            for delay in (float(d) for d in args.delays.split(",")):
                relay_port = free_port()
                relay = subprocess.Popen([sys.executable, str(ROOT / "scripts/delay_relay.py"), str(relay_port),
                                          f"127.0.0.1:{server_port}", "--delay-ms", str(delay)])
                try:
                    wait_for(relay_port)
                    report = bench(args.prompts, f"127.0.0.1:{relay_port}", args, Path(folder) / f"{delay}.json")
                finally:
                    stop(relay)
                rows = {r["config"]: r for r in report["summary"] if r["category"] == "all"}
                results.append({"delay_ms": delay, "rows": rows, "costs": report["meta"]["costs"],
                                "prompts": sorted({r["prompt"] for r in report["runs"]})})
                print(f"D = {delay:g} ms: " + "; ".join(
                    f"{name} {row['median_tps']:.2f} t/s ({row['median_speedup']:.2f}x)"
                    for name, row in rows.items()), flush=True)
    finally:
        stop(server)
    args.output.write_text(json.dumps({"meta": meta(), "n": args.n, "results": results}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("GGML_CPU_TILED_MM", "0")
    main()
