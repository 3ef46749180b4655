#!/usr/bin/env python3
"""Where two greedy answers to the same request part, and how close the target's choice was there.

    python scripts/divergence.py MODEL.gguf [-t THREADS] [-c CTX] < pairs.json > margins.json

Reads a JSON list of {"prompt" or "messages", "reference", "other"}: one request (a
prompt, or chat messages through the target's template, as `batch` and `serve` tokenize them)
and two answers to it. Each answer is tokenized again, and the target alone scores the prompt and
the answers' common tokens: at the first token where they part, it writes {"position",
"top2_margin" (its best logit less its second best there), "gap" (|logit of the reference's
token - logit of the other's|)}, a list in the order given. A small margin is a near-tie, which the last bits of a batch of
other requests may turn (docs/parallel.md); a large one is a bug. Answers tokenized again may
split where the generated tokens did not, so a position is where the texts' tokens part.

bench_parallel.py runs it (with the speculate build's Python) on the answers unlike -np 1's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from speculative.decoding.scheduler import run
from speculative.decoding.settings import ModelSpec
from speculative.engine.engine import Engine


def part(engine: Engine, pair: dict) -> dict:
    prompt = (engine.chat_tokens(pair["messages"]) if pair.get("messages") is not None
              else engine.prompt_tokens(pair["prompt"]))
    reference, other = (engine.target.tokenize(pair[k], add_special=False, parse_special=False)
                        for k in ("reference", "other"))
    position = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), min(len(reference), len(other)))
    (row,) = run(engine.caches["target"].sync(prompt + reference[:position], "last"))
    second, first = np.sort(row[np.argpartition(row, -2)[-2:]])
    tokens = [t[position] for t in (reference, other) if position < len(t)]
    return {"position": position, "top2_margin": float(first - second),
            "gap": float(abs(row[tokens[0]] - row[tokens[1]])) if len(tokens) == 2 else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="the target GGUF")
    parser.add_argument("-t", "--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("-c", "--ctx", type=int, default=4096)
    args = parser.parse_args()
    pairs = json.load(sys.stdin)
    with Engine(ModelSpec(args.model, "target", n_ctx=args.ctx, n_threads=args.threads)) as engine:
        json.dump([part(engine, pair) for pair in pairs], sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
