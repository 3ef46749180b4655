"""What each drafter of the target's hidden states costs, on tiny random-weight models of
tests/tiny_drafters.py and tiny_model.py at a given size.

    python -m scripts.bench drafters [--size 64x4] [--size 1024x16] [--threads 1] [--repeat 3] [-o FILE]

For each --size N_EMBDxN_LAYER (the target's width and depth; the drafters keep their own
shape: EAGLE-3 one layer at width 64 under 1024, else the target's width, DFlash one layer at
the target's width, MTP heads one NextN block each) and each drafter (draft-eagle3,
draft-dflash, draft-dspark, draft-mtp with one and with two chained NextN layers, and a Gemma-4
assistant with its gemma4 target at its own fixed two layers), a child process loads the target
alone, then the drafter with it (speculative.engine.engine.Engine), and reports:
- memory: the resident memory (/proc/self/status) of the target loaded with the drafter less
  that of the target alone, each in a process of its own (the drafter's weights, context and
  compute buffers; for draft-mtp, the NextN layers and the head's context);
- the target's pass: one decode of one token after 32 of context (calibrate.measure, as auto's
  calibration measures it), best of its rounds and of --repeat;
- the drafter's cost per drafted token, best of --repeat, for a draft of K tokens (4, or the
  block's size less one): EAGLE-3 and single-layer MTP one decode of one entry each; chained
  MTP a decode of 1, 2, ... entries (head i decodes the draft region again); DFlash and DSpark
  one block decode of K + 1 (DSpark from its anchor: K) tokens, divided by K; plus, for the
  drafters that follow the target (all but the Gemma-4 assistant), catching up on one accepted
  token (an entry decode; EAGLE-3's encoder pass included);
- the ratio of the two: what one drafted token costs in target passes.
The weights are random: only costs mean anything for a real model. Prints a table; -o writes
the results as JSON ({"meta", "args", "rows": [...]}).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench import harness

DRAFTERS = ("draft-eagle3", "draft-dflash", "draft-dspark", "draft-mtp", "draft-mtp x2", "gemma4-assistant")
K = 4  # drafted tokens per step measured

CHILD = r'''
import json, sys, time
from pathlib import Path
import numpy as np
sys.path.insert(0, sys.argv[1])
from speculative.decoding.cache import Cache
from speculative.decoding.scheduler import run
from speculative.decoding.settings import ModelSpec
from speculative.engine import calibrate
from speculative.engine.engine import Engine

kind, target, drafter = sys.argv[2], Path(sys.argv[3]), sys.argv[4]
threads, repeat, k = int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
alone_only = sys.argv[8] == "alone"

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

def best(f):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter(); f(); times.append(time.perf_counter() - t0)
    return min(times)

kw = {"feature_drafter": Path(drafter)} if kind in ("draft-eagle3", "draft-dflash", "draft-dspark") else \
     {"mtp_sidecar": Path(drafter)} if kind == "gemma4-assistant" else {"mtp": True}
if alone_only:  # what the target costs without the drafter: its pass, and its memory
    with Engine(ModelSpec(target, "target", n_ctx=512, n_threads=threads)) as alone:
        pass_s = min(min(calibrate.measure(alone.caches["target"], [1], lambda text: None).rounds[1])
                     for _ in range(repeat))
        print(json.dumps({"pass_s": pass_s, "rss_mib": rss()}))
    sys.exit(0)
with Engine(ModelSpec(target, "target", n_ctx=512, n_threads=threads, **kw)) as engine:
    loaded = rss()
    cache, head = engine.caches["target"], engine.head_cache.head
    context = [(1000 + i) % head.n_vocab for i in range(33)]
    run(cache.sync(context[:-1]))
    run(engine.head_cache.sync(context))
    row = np.zeros((1, head.n_embd), dtype=np.float32)
    if kind in ("draft-dflash", "draft-dspark"):
        k = min(k, head.max_draft)
        per_token = best(lambda: head.block(context[-1], 32, k)) / k
    elif kind == "draft-mtp x2":
        k = min(k, head.n_heads)
        rows = np.zeros((k, head.n_embd), dtype=np.float32)
        def chain():  # head i decodes the draft region again, from the last exact entry
            for i in range(k):
                assert head.decode(context[-1:] * (i + 1), 32, rows[: i + 1], head=i) is not None
        per_token = best(chain) / k
    else:
        def step():  # the last entry again, in place of itself (the cache holds 0..31 before it)
            head.trim(32)
            assert head.decode(context[-1:], 32, row) is not None
        per_token = best(step)
    catch_up = None
    if kind != "gemma4-assistant":
        def one():
            engine.head_cache.rollback(32)
            run(engine.head_cache.sync(context))
        catch_up = best(one)
print(json.dumps({"per_token_s": per_token, "catch_up_s": catch_up, "k": k, "rss_mib": loaded}))
'''


def write_pair(kind: str, folder: Path, n_embd: int, n_layer: int) -> tuple[Path, Path | None]:
    from tests.tiny_drafters import write_drafter
    from tests.tiny_model import write_model

    if kind == "draft-mtp":
        return write_model("hy_v3", folder / "hy1.gguf", n_embd=n_embd, n_layer=n_layer, mtp=1), None
    if kind == "draft-mtp x2":
        return write_model("hy_v3", folder / "hy2.gguf", n_embd=n_embd, n_layer=n_layer, mtp=2), None
    if kind == "gemma4-assistant":
        drafter, target = write_drafter("gemma4-assistant", folder / "assistant.gguf", target_n_embd=n_embd)
        return target, drafter
    arch = {"draft-eagle3": "eagle3", "draft-dflash": "dflash", "draft-dspark": "dspark"}[kind]
    drafter, target = write_drafter(arch, folder / f"{arch}.gguf", target_n_embd=n_embd, target_n_layer=n_layer,
                                    **({"n_embd": min(n_embd, 1024)} if arch == "eagle3" else {}))
    return target, drafter


def measure(kind: str, size: str, threads: int, repeat: int) -> dict:
    n_embd, n_layer = map(int, size.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        target, drafter = write_pair(kind, Path(tmp), n_embd, n_layer)
        runs = {}
        for mode in ("alone", "with"):  # each in a fresh process: the memory one adds over the other
            cmd = [sys.executable, "-c", CHILD, str(harness.ROOT), kind, str(target), str(drafter), str(threads),
                   str(repeat), str(K), mode]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                harness.failed([sys.executable, "-c", "CHILD", *cmd[3:]], out.returncode, out.stderr)
            runs[mode] = json.loads(out.stdout.splitlines()[-1])
    row = {**runs["with"], "pass_s": runs["alone"]["pass_s"],
           "rss_growth_mib": runs["with"]["rss_mib"] - runs["alone"]["rss_mib"]}
    return {"drafter": kind, "size": size if kind != "gemma4-assistant" else f"{n_embd}x2", **row,
            "per_token_vs_pass": harness.ratio(row["per_token_s"], row["pass_s"])}


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__name__, __doc__)
    p.add_argument("--size", action="append", help="N_EMBDxN_LAYER of the target (default: 64x4 and 1024x16)")
    harness.add_threads(p, default=1)
    p.add_argument("--repeat", type=int, default=3)
    harness.add_output(p, "every drafter's costs")
    args = harness.parse(p, argv)
    sizes = args.size or ["64x4", "1024x16"]
    rows = []
    t0 = time.time()
    for size in sizes:
        for kind in DRAFTERS:
            row = measure(kind, size, args.threads, args.repeat)
            rows.append(row)
            catch_up = "-" if row["catch_up_s"] is None else f"{1000 * row['catch_up_s']:.3f} ms"
            print(f"{row['size']:>8} {kind:<17} pass {1000 * row['pass_s']:8.3f} ms  drafted token "
                  f"{1000 * row['per_token_s']:8.3f} ms ({row['per_token_vs_pass']:.2f}x, K={row['k']})  catch-up "
                  f"{catch_up}  memory +{row['rss_growth_mib']:.0f} MiB", flush=True)
    if args.output:
        harness.write(args.output, {"meta": harness.meta(), "args": vars(args) | {"output": str(args.output)},
                                    "seconds": time.time() - t0, "rows": rows})
    return 0
