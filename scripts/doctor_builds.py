#!/usr/bin/env python3
"""`speculate doctor` on the stock build and on the test build, side by side.

    python scripts/doctor_builds.py [--stock .venv] [--test .venv-test] [-m MODEL] [-o results.json]

The stock build (README's first set-up command) with llama.cpp's own defaults on the CPU
(flash attention on, the tiled matmul on), then with everything that can be switched off at
run time off (GGML_CPU_TILED_MM=0, -fa off, -nr), and scripts/test.sh's build as its tests run
it (GGML_CPU_TILED_MM=0, -fa auto): where each scores a position differently alone and inside
a batch, after 16 and after 300 cached tokens (docs/exactness-and-builds.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from results import meta


def doctor(venv: Path, env: dict[str, str], flags: list[str]) -> dict:
    proc = subprocess.run([str(venv / "bin" / "speculate"), "doctor", "--json", *flags], capture_output=True,
                          text=True, env={**os.environ, **env})
    if proc.returncode != 0:
        sys.exit(f"{venv}: speculate doctor failed: {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stock", type=Path, default=Path(".venv"))
    parser.add_argument("--test", type=Path, default=Path(".venv-test"))
    parser.add_argument("-m", "--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("-o", "--output", type=Path)
    args = parser.parse_args()
    cases = [("stock", args.stock, {"GGML_CPU_TILED_MM": "1"}, ["-fa", "on"]),
             ("stock, run-time switches off", args.stock, {"GGML_CPU_TILED_MM": "0"}, ["-fa", "off", "-nr"]),
             ("test", args.test, {"GGML_CPU_TILED_MM": "0"}, ["-fa", "auto"])]
    reports = []
    for label, venv, env, flags in cases:
        report = doctor(venv, env, ["-m", args.model, *flags])
        reports.append({"label": label, "venv": str(venv), "env": env, "flags": flags, "report": report})
        differ = [c for c in report["checks"] if c["max_abs_diff"]]
        print(f"{label} ({venv}, {' '.join(f'{k}={v}' for k, v in env.items())} {' '.join(flags)}): "
              f"{'batch-invariant' if report['batch_invariant'] else f'{len(differ)} batches differ'}", flush=True)
    if args.output:
        args.output.write_text(json.dumps({"meta": meta(model=args.model), "reports": reports}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
