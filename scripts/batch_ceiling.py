#!/usr/bin/env python3
"""What decoding N sequences in one batch can gain on this machine: the ceiling of `-np N`.

    python scripts/batch_ceiling.py MODEL.gguf [-t THREADS] [--ns 1,2,4,8] [--steps 16] [--rounds 3]

Run it with the Python of the build to measure (scripts/bench_parallel.py runs it with the
speculate executable's). One context of -c 4096 with a unified cache, as speculate's `-np N`
makes; each of N sequences gets a prompt of its own (150 tokens), then `--steps` steps of one
token per sequence, two ways: one llama_decode carrying a token of each of the N sequences,
and N llama_decode calls of one token each. The two ways alternate, `--rounds` times; the gain
is the time of the N single decodes over the batch's, per round. Prints one JSON object:
{"n": {"N": [gain per round, ...]}, "single_ms": [a single decode's ms per round]}.
"""

from __future__ import annotations

import argparse
import json
import time

import llama_cpp as ll

PROMPT = 150


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--ns", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ns = [int(n) for n in args.ns.split(",")]
    ll.llama_backend_init()
    model = ll.llama_model_load_from_file(args.model.encode(), ll.llama_model_default_params())
    params = ll.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = 4096, 512, 512
    params.n_seq_max, params.kv_unified = max(ns), True
    params.n_threads = params.n_threads_batch = args.threads
    ctx = ll.llama_init_from_model(model, params)
    batch = ll.llama_batch_init(512, 0, 1)
    pos = [0] * max(ns)

    def decode(entries: list[tuple[int, int]]) -> None:  # (token, sequence), each at its next position
        batch.n_tokens = len(entries)
        for i, (token, seq) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = \
                token, pos[seq], 1, seq, True
            pos[seq] += 1
        if ll.llama_decode(ctx, batch):
            raise SystemExit("llama_decode failed")

    for seq in range(max(ns)):  # a prompt of its own each
        for start in range(0, PROMPT, 50):
            decode([(100 + (seq * 977 + i * 31) % 5000, seq) for i in range(start, start + 50)])
    gains: dict[int, list[float]] = {n: [] for n in ns}
    single_ms = []
    for _ in range(args.rounds):
        for n in ns:
            t0 = time.perf_counter()
            for step in range(args.steps):
                decode([(200 + step, seq) for seq in range(n)])
            together = time.perf_counter() - t0
            t0 = time.perf_counter()
            for step in range(args.steps):
                for seq in range(n):
                    decode([(300 + step, seq)])
            apart = time.perf_counter() - t0
            gains[n].append(apart / together)
            if n == 1:
                single_ms.append(apart / args.steps * 1000)
    print(json.dumps({"n": {str(n): g for n, g in gains.items()}, "single_ms": single_ms}))
    ll.llama_batch_free(batch)
    ll.llama_free(ctx)
    ll.llama_model_free(model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
