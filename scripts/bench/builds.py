"""Decode speed of two llama-cpp-python builds, target-only and speculative, interleaved.

    python -m scripts.bench builds VENV_A VENV_B [--rounds 3] [--env-b KEY=VALUE ...] [--flag-b FLAG ...]
                                   [-o results.json] [-- extra speculate flags]

Each venv must have speculate installed over its own llama-cpp-python build (for
example the stock build in .venv and the batch-invariant one in .venv-test). Every
round runs, for each build, the default pair's target alone and then with its draft,
so machine drift hits all four alike. Prints each run and the medians, with ratios
against the first build's target-only speed measured in this same run. --env-b sets
environment variables for the second build's runs only (GGML_CPU_TILED_MM=0 makes the
test build of scripts/test.sh batch-invariant, as its tests run it), and --flag-b speculate
flags (-nr: weights not repacked); with them VENV_B may be VENV_A, the same build otherwise set.
"""

from __future__ import annotations

import os
from pathlib import Path

from scripts.bench import harness

PROMPT = "def quicksort(arr):"
MODES = {"target only": ["--spec-type", "none"], "draft model": ["--spec-type", "draft"]}


def run(speculate: str, mode_flags: list[str], extra: list[str], env: dict[str, str]) -> dict:
    cmd = [speculate, "-p", PROMPT, "-n", "64", "--temp", "0", "--json", *mode_flags, *extra]
    return harness.run_json(cmd, env={**os.environ, **env})


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__name__, __doc__)
    parser.add_argument("venvs", nargs=2, type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--env-b", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable for VENV_B's runs")
    parser.add_argument("--flag-b", action="append", default=[], metavar="FLAG",
                        help="a speculate flag for VENV_B's runs (-nr; several: repeat it)")
    harness.add_output(parser, "every run's speed and the medians")
    args, extra = harness.parse(parser, argv, known=True)  # the flags after -- go to speculate

    env_b = dict(kv.partition("=")[::2] for kv in args.env_b)
    label_b = " ".join([str(args.venvs[1]), *(f"{k}={v}" for k, v in env_b.items()), *args.flag_b])
    sides = [(str(args.venvs[0]), harness.speculate(venv=args.venvs[0]), {}, []),
             (label_b, harness.speculate(venv=args.venvs[1]), env_b, args.flag_b)]
    configs = [(side, mode) for side in sides for mode in MODES]
    speeds: dict[tuple[str, str], list[float]] = {}
    for r, ((label, speculate, env, own), mode) in harness.interleaved(configs, args.rounds):
        result = run(speculate, MODES[mode], [*extra, *own], env)
        speeds.setdefault((label, mode), []).append(result["decode_tps"])
        print(f"round {r + 1}  {label}  {mode:12s}  {result['decode_tps']:6.2f} t/s  "
              f"accepted {result['n_accept']}/{result['n_drafted']}", flush=True)

    base = harness.median(speeds[(sides[0][0], "target only")])
    print(f"\nmedian decode speed over {args.rounds} rounds, ratio to {sides[0][0]} target only:")
    for (label, mode), values in speeds.items():
        median = harness.median(values)
        print(f"  {label}  {mode:12s}  {median:6.2f} t/s  {harness.ratio(median, base):5.2f}x")
    if args.output:
        harness.write(args.output, {
            "meta": harness.meta(prompt=PROMPT, modes=MODES, extra=extra,
                                 env={label: env for label, _, env, _ in sides}, flags_b=args.flag_b),
            "runs": [{"venv": label, "mode": mode, "decode_tps": values} for (label, mode), values in speeds.items()]})
    return 0
