"""`speculate doctor` on the stock build and on the test build, side by side.

    python -m scripts.bench doctor [--stock .venv] [--test .venv-test] [-m MODEL] [-o results.json]

The stock build (README's first set-up command) with llama.cpp's own defaults on the CPU
(flash attention on, the tiled matmul on), then with everything that can be switched off at
run time off (GGML_CPU_TILED_MM=0, -fa off, -nr), and scripts/test.sh's build as its tests run
it (GGML_CPU_TILED_MM=0, -fa auto): where each scores a position differently alone and inside
a batch, after 16 and after 300 cached tokens (docs/exactness-and-builds.md).
"""

from __future__ import annotations

import os
from pathlib import Path

from scripts.bench import harness


def doctor(venv: Path, env: dict[str, str], flags: list[str]) -> dict:
    return harness.run_json([harness.speculate(venv=venv), "doctor", "--json", *flags], env={**os.environ, **env})


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__name__, __doc__)
    parser.add_argument("--stock", type=Path, default=Path(".venv"))
    parser.add_argument("--test", type=Path, default=Path(".venv-test"))
    parser.add_argument("-m", "--model", default="qwen2.5-coder-1.5b-instruct")
    harness.add_output(parser, "each build's report")
    args = harness.parse(parser, argv)
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
        harness.write(args.output, {"meta": harness.meta(model=args.model), "reports": reports})
    return 0
