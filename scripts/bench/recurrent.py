"""What rolling back a recurrent state costs, measured on tiny models made at a realistic width.

    python -m scripts.bench recurrent [--n-embd 1024] [--n-layer 12] [--threads 2] [--draft 8]

For each architecture (LFM2 and Qwen3.5, whose rollback llama.cpp does with n_rs_seq
snapshots; Mamba, whose state speculate copies into a checkpoint), on a random-weight model
written by tests/tiny_model.py: a target pass over 1 token and over a verify batch of
--draft + 1, with and without the snapshots; the recurrent state's size; the memory llama.cpp
allocates for it; and the checkpoint's copy and restore. Weights are random, so only the
costs mean anything (no acceptance rates). Medians of --repeat runs, printed as a table and
written as JSON with -o.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from scripts.bench import harness
from speculative.decoding.cache import Cache
from speculative.decoding.scheduler import run
from speculative.engine.calibrate import checkpoint_costs
from tests.tiny_model import write_model

if TYPE_CHECKING:
    from speculative.llamacpp.model import LlamaModel

CONTEXT = 256  # tokens in the cache before each measured pass


def load(path: Path, threads: int, n_rs_seq: int) -> tuple[LlamaModel, float]:
    """The model, and the MiB llama.cpp reports for its recurrent state buffers (its log)."""
    with harness.llama_log() as log:
        model = harness.load(path, n_ctx=1024, n_threads=threads, n_rs_seq=n_rs_seq)
    mib = sum(float(m) for m in re.findall(r"RS buffer size =\s*([\d.]+) MiB", log[0]))
    return model, mib


def pass_seconds(cache: Cache, batch: int, repeat: int) -> float:
    """Median time of one decode of `batch` tokens after CONTEXT tokens, rolled back each time."""
    vocab = cache.model.n_vocab
    cache.forget()
    run(cache.extend([(7 * i) % vocab for i in range(CONTEXT)]))
    cache.checkpoint()
    times = []
    for r in range(repeat):
        tokens = [(11 * (i + r)) % vocab for i in range(batch)]
        t0 = time.perf_counter()
        run(cache.extend(tokens, "all"))
        times.append(time.perf_counter() - t0)
        cache.rollback(CONTEXT)
    cache.forget()
    return harness.median(times)


def measure(arch: str, path: Path, args: argparse.Namespace) -> dict:
    row: dict = {"arch": arch}
    for n_rs_seq in (0, args.draft):
        model, mib = load(path, args.threads, n_rs_seq)
        with model:
            cache = Cache(model)
            key = "snapshots" if n_rs_seq else "plain"
            row[f"{key}_limit"] = model.rollback_limit
            row[f"{key}_state_mib"] = mib
            row[f"{key}_v1_ms"] = 1e3 * pass_seconds(cache, 1, args.repeat)
            row[f"{key}_verify_ms"] = 1e3 * pass_seconds(cache, args.draft + 1, args.repeat)
            if not n_rs_seq:
                run(cache.extend([1] * CONTEXT))
                row["checkpoint_kib"] = len(model.save_state(partial=True)) / 1024
                cache.forget()
                save, restore = checkpoint_costs(cache)
                row["checkpoint_save_ms"], row["checkpoint_restore_ms"] = 1e3 * save, 1e3 * restore
    return row


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__name__, __doc__)
    parser.add_argument("--n-embd", type=int, default=1024)
    parser.add_argument("--n-layer", type=int, default=12)
    harness.add_threads(parser, default=2)
    parser.add_argument("--draft", type=int, default=8, help="the verify batch holds this many drafted tokens")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--arch", action="append", help="default: lfm2, qwen35, mamba")
    harness.add_output(parser, "every architecture's costs")
    args = harness.parse(parser, argv)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for arch in args.arch or ["lfm2", "qwen35", "mamba"]:
            path = write_model(arch, Path(folder) / f"{arch}.gguf", n_embd=args.n_embd, n_layer=args.n_layer)
            rows.append(measure(arch, path, args))
            path.unlink()
            r = rows[-1]
            print(f"{arch:8} state {r['plain_state_mib']:6.2f} MiB -> {r['snapshots_state_mib']:6.2f} MiB with "
                  f"{args.draft} snapshots (limit {r['snapshots_limit']}); 1 token {r['plain_v1_ms']:.1f} ms; "
                  f"verify of {args.draft + 1}: {r['plain_verify_ms']:.1f} ms plain, {r['snapshots_verify_ms']:.1f} ms "
                  f"with snapshots; checkpoint {r['checkpoint_kib']:.0f} KiB, copy {r['checkpoint_save_ms']:.2f} ms, "
                  f"restore {r['checkpoint_restore_ms']:.2f} ms", flush=True)
    if args.output:
        from speculative.llamacpp.devices import system_info

        harness.write(args.output, {"meta": harness.meta(llama_cpp=system_info()),
                                    "args": vars(args) | {"output": str(args.output)}, "rows": rows})
    return 0
