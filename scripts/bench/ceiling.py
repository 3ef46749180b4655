"""What decoding N sequences in one batch can gain on this machine: the ceiling of `-np N`.

    python -m scripts.bench ceiling MODEL.gguf [-t THREADS] [--ns 1,2,4,8] [--steps 16] [--rounds 3]
                                    [-o results.json]

Run it with the Python of the build to measure (the `parallel` scenario runs it with the
speculate executable's): the model loads through speculate's binding, as speculate loads it.
One context of -c 4096 with a unified cache, as speculate's `-np N` makes; each of N sequences
gets a prompt of its own (150 tokens), then `--steps` steps of one token per sequence, two
ways: one llama_decode carrying a token of each of the N sequences, and N llama_decode calls of
one token each. The two ways alternate, `--rounds` times; the gain
is the time of the N single decodes over the batch's, per round. Prints one JSON object:
{"n": {"N": [gain per round, ...]}, "single_ms": [a single decode's ms per round]}; -o also
writes it, with meta.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from scripts.bench import harness

if TYPE_CHECKING:
    from speculative.llamacpp.model import LlamaModel

PROMPT = 150


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__name__, __doc__)
    parser.add_argument("model")
    harness.add_threads(parser, default=2)
    parser.add_argument("--ns", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    harness.add_output(parser, "the gains")
    args = harness.parse(parser, argv)
    ns = [int(n) for n in args.ns.split(",")]
    path = Path(args.model)
    with harness.load(path, name=path.name, n_ctx=4096, n_batch=512, n_ubatch=512, n_threads=args.threads,
                      n_slots=max(ns), kv_unified=True) as model:
        gains = measure(model, ns, args.steps, args.rounds)
    print(json.dumps(gains))
    if args.output:
        harness.write(args.output, {"meta": harness.meta(model=str(path), threads=args.threads, steps=args.steps,
                                                         rounds=args.rounds), **gains})
    return 0


def measure(model: LlamaModel, ns: list[int], steps: int, rounds: int) -> dict:
    pos = [0] * max(ns)

    def decode(entries: list[tuple[int, int]]) -> None:  # (token, sequence), each at its next position
        positions = []
        for _, seq in entries:
            positions.append(pos[seq])
            pos[seq] += 1
        model.decode_branches([token for token, _ in entries], positions, [(seq,) for _, seq in entries])

    for seq in range(max(ns)):  # a prompt of its own each
        for start in range(0, PROMPT, 50):
            decode([(100 + (seq * 977 + i * 31) % 5000, seq) for i in range(start, start + 50)])
    gains: dict[int, list[float]] = {n: [] for n in ns}
    single_ms = []
    for _ in range(rounds):
        for n in ns:
            t0 = time.perf_counter()
            for step in range(steps):
                decode([(200 + step, seq) for seq in range(n)])
            together = time.perf_counter() - t0
            t0 = time.perf_counter()
            for step in range(steps):
                for seq in range(n):
                    decode([(300 + step, seq)])
            apart = time.perf_counter() - t0
            gains[n].append(apart / together)
            if n == 1:
                single_ms.append(apart / steps * 1000)
    return {"n": {str(n): g for n, g in gains.items()}, "single_ms": single_ms}
