"""What --prompt-cache saves: two questions about one source file, in separate processes.

    python -m scripts.bench prompt-cache [SOURCE_FILE] [-o results.json] [-- extra speculate flags]

Four `speculate --json` runs, one after the other in this session:
  1. question A without a cache: the baseline prompt-processing time;
  2. question A with --prompt-cache (a new file): processes the whole prompt, saves it;
  3. question B with the same --prompt-cache: restores the file, keeps the shared file
     and processes only the question;
  4. question B without a cache: the text run 3 must reproduce, token for token.
It prints each run's prompt-processing time (restoring the cache counted in) and the
ratios, and its decoding speed (runs 3 and 4 decode the same tokens after the same context, one
restored and one processed), and exits 1 if run 3's text differs from run 4's. Defaults: the Qwen target
alone (`-m qwen2.5-coder-1.5b-instruct --spec-type none`), greedy, 64 tokens, and
GGML_CPU_TILED_MM=0 so that the CPU build is batch-invariant (docs/exactness-and-builds.md).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from scripts.bench import harness

DEFAULT_SOURCE = harness.ROOT / "speculative" / "decoding" / "stats.py"
QUESTIONS = ("Explain what the Stats class counts, in three sentences.",
             "Which property would you use to compare speculation against plain decoding, and why?")
FLAGS = ("-m", "qwen2.5-coder-1.5b-instruct", "--spec-type", "none", "--temp", "0", "-n", "64", "--chat")


def run(speculate: str, prompt: str, extra: list[str], *cache: str) -> dict:
    return harness.run_json([speculate, *FLAGS, *extra, "-p", "-", "--json", *cache], input=prompt,
                            env={"GGML_CPU_TILED_MM": "0", **os.environ})


def prompt_seconds(result: dict) -> float:
    return result["t_encode_s"] + result["t_restore_s"]


def print_runs(runs: dict[str, dict], source: Path, size: int) -> bool:
    """Each run's prompt processing and decoding, and the ratios; whether run 3's text is run 4's."""
    print(f"shared context: {source} ({runs['1. A, no cache']['n_prompt']} prompt tokens with question A); "
          f"cache file {size / 2**20:.1f} MiB")
    for label, r in runs.items():
        print(f"{label:26s} {r['n_prompt']:5d} prompt tokens, {r['n_restored']:5d} restored: "
              f"prompt processing {prompt_seconds(r):7.3f} s (restore {r['t_restore_s']:.3f} s, "
              f"save {r['t_save_s']:.3f} s), decoding {r['decode_tps']:.2f} t/s")
    base, _, warm, plain = (prompt_seconds(r) for r in runs.values())
    print(f"B with the cache vs B without: {harness.ratio(plain, warm):.1f}x less prompt-processing time; "
          f"vs A without: {harness.ratio(base, warm):.1f}x")
    same = runs["3. B, restores the cache"]["tokens"] == runs["4. B, no cache"]["tokens"]
    print("generated text with the cache: " + ("identical to the run without it" if same else "DIFFERENT"))
    return same


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = harness.parser(__name__, __doc__)
    parser.add_argument("source", nargs="?", type=Path, default=DEFAULT_SOURCE, metavar="SOURCE_FILE",
                        help="the shared context (default speculative/decoding/stats.py)")
    harness.add_output(parser, "every run's figures")
    return harness.parse(parser, argv, known=True)


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    speculate = harness.speculate()
    code = args.source.read_text()
    a, b = (f"{code}\n\n{question}" for question in QUESTIONS)
    with tempfile.TemporaryDirectory() as tmp:
        cache = ("--prompt-cache", str(Path(tmp) / "prompt.cache"))
        runs = {"1. A, no cache": run(speculate, a, extra),
                "2. A, saves the cache": run(speculate, a, extra, *cache),
                "3. B, restores the cache": run(speculate, b, extra, *cache),
                "4. B, no cache": run(speculate, b, extra)}
        size = (Path(tmp) / "prompt.cache").stat().st_size
    same = print_runs(runs, args.source, size)
    if args.output:
        harness.write(args.output, {"meta": harness.meta(source=str(args.source), flags=[*FLAGS, *extra]),
                                    "cache_bytes": size, "runs": runs})
    return 0 if same else 1
