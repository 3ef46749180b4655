"""Many requests at once: `batch --parallel N`, `serve -np N` and the pinned llama-server, compared.

    python -m scripts.bench parallel [--speculate PATH] [-m MODEL] [-md DRAFT] [-t THREADS] [--requests 16]
                                     [-n 64] [--repeats 3] [--only CONFIG_SUBSTRING ...] [-o results.json]

--requests distinct requests (default 16) from scripts/prompts.jsonl (evenly spaced over its
prompts, so every category is in; cycled with new ids if more are asked than it holds), each for
-n greedy tokens (temperature 0, stopping at end of generation), run by:

  batch -np N {none,auto}         `speculate batch REQUESTS -o OUT -np N --spec-type T`, N = 1, 2, 4, 8
  serve -np N {none,auto}         `speculate serve -np N --spec-type T`, N clients at once, N = 1, 4
  llama-server -np N {none,spec-default}
                                  llama-server of the llama.cpp that llama-cpp-python 0.3.36 vendors,
                                  with -kvu (one KV pool of -c cells, as speculate's default) and
                                  without speculation or with --spec-default (llama.cpp's ngram-mod,
                                  no draft model), N clients at once, N = 1, 4

auto gets the draft model (-md); none and llama-server load the target alone. Every run is a
fresh process (caches cleared between configurations), -c 4096 and -t THREADS for every tool;
each repeat runs every configuration once, in the same order, so drift hits all alike. A client
takes the next request when its answer is in (POST /v1/completions for a prompt,
/v1/chat/completions for messages, max_tokens -n, temperature 0).

First, once: the ceiling (the `ceiling` scenario, with the speculate build's Python): what one
llama_decode of a token of each of N sequences gains over N single decodes on this machine, for
every N run, the most batching can gain on the steps (a prompt gains next to nothing).

Measured per run: throughput, generated tokens over the seconds from the first request to the
last answer (batch: its --summary's `seconds`, from its first request on: model load left out;
servers: from the first send, after /health answered); each request's latency (batch: its
t_restore + t_encode + t_save + t_decode, from its slot taking it to its last token, queueing
left out; servers: its round trip, with no queue either as clients = slots); the process's peak
RSS (batch: wait4's ru_maxrss; servers: VmHWM, read after the last answer); KV MiB, the "KV
buffer size" lines of llama.cpp's load log summed (SPECULATE_LLAMA_LOG=1 for speculate, -lv 4
for llama-server; target, draft and every slot's contexts); and each answer, compared with the
same request's answer from the -np 1 run of the same tool, spec type and repeat (greedy, but on
a batch-variant build such as the stock one a near-tie may go the other way in a batch of
several sequences); for each that differs, where the two part and the target's top-2 logit
margin there, scored alone (scripts/divergence.py, after the runs: a near-tie, or a bug).

The table: per configuration the median throughput over the repeats (min-max), its ratio to the
median of `batch -np 1 none` in this same run, the medians of the runs' p50 and p95 latencies,
peak RSS and KV MiB, the most answers of one repeat that differ from -np 1, and the largest
margin where any of them parts. -o writes it
all (meta, every run's figures, latencies and texts) as JSON.

llama-server is built once from the sdist scripts/test.sh keeps (servers.py says how). It keeps
its own defaults otherwise: flash attention `auto` (on, on
a CPU), where speculate leaves it off. GGML_CPU_TILED_MM is passed on as set (unset: the stock
kernels); 0 makes the CPU kernels batch-invariant on every tool alike. auto's cost calibration
(speculative/engine/calibrate.py, cached per machine) runs untimed before the first run, for the
largest N; a run that calibrated anyway says so.

Time: with the defaults (the Qwen 1.5B/0.5B pair, 16 requests, 64 tokens, 3 repeats, 16
configurations) about an hour on the 2-core development machine, plus the build the first time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench import harness
from scripts.bench.harness import ROOT
from scripts.bench.servers import CMAKE_FLAGS, Server, llama_server_binary

CTX = 4096
KV_LINE = re.compile(r"KV buffer size =\s*([\d.]+) MiB")
BASELINE = "batch -np 1 none"


@dataclasses.dataclass(frozen=True)
class Config:
    tool: str   # batch, serve or llama-server
    n: int      # requests at once (-np)
    spec: str   # none, auto or spec-default

    @property
    def name(self) -> str:
        return f"{self.tool} -np {self.n} {self.spec}"


CONFIGS = ([Config("batch", n, spec) for spec in ("none", "auto") for n in (1, 2, 4, 8)]
           + [Config("serve", n, spec) for spec in ("none", "auto") for n in (1, 4)]
           + [Config("llama-server", n, spec) for spec in ("none", "spec-default") for n in (1, 4)])


def make_requests(count: int, n_predict: int) -> list[dict]:
    """`count` requests from scripts/prompts.jsonl, evenly spaced over it, cycled with new ids when
    more are asked than it holds; `category` (which `speculate batch` refuses) dropped."""
    rows = harness.jsonl(harness.PROMPTS)
    if count <= len(rows):
        picked = [(rows[i * len(rows) // count], "") for i in range(count)]
    else:  # every prompt, then again as request "ID-2", and so on
        picked = [(rows[i % len(rows)], f"-{i // len(rows) + 1}" if i >= len(rows) else "") for i in range(count)]
    requests = []
    for row, suffix in picked:
        body = {"messages": row["messages"]} if row.get("messages") else {"prompt": row["prompt"]}
        requests.append({"id": row["id"] + suffix, **body, "n_predict": n_predict, "temperature": 0})
    return requests


def kv_mib(log: Path) -> float | None:
    """The KV buffers llama.cpp's load log reports, summed (None: no such line)."""
    sizes = [float(m) for m in KV_LINE.findall(log.read_text(errors="replace"))]
    return sum(sizes) if sizes else None


def speculate_flags(cfg: Config, bench: argparse.Namespace) -> list[str]:
    draft = ["-md", bench.draft] if cfg.spec == "auto" else []
    return ["-m", bench.model, *draft, "-c", str(CTX), "-t", str(bench.threads), "--spec-type", cfg.spec,
            "-np", str(cfg.n)]


def run_batch(cfg: Config, bench: argparse.Namespace, requests: list[dict], work: Path) -> dict:
    """`speculate batch` over the requests, in a fresh process."""
    req, out, summary, log = (work / f"{cfg.n}-{cfg.spec}.{ext}" for ext in ("req.jsonl", "out.jsonl",
                                                                            "summary.json", "log"))
    req.write_text("".join(json.dumps(r) + "\n" for r in requests))
    out.unlink(missing_ok=True)
    cmd = [bench.speculate, "batch", str(req), "-o", str(out), "--summary", str(summary), "--temp", "0",
           *speculate_flags(cfg, bench)]
    started = time.monotonic()
    rss = harness.run_logged(cmd, log, env={**bench.env, "SPECULATE_LLAMA_LOG": "1"})
    if not json.loads(summary.read_text())["all_succeeded"]:
        sys.exit(f"{' '.join(cmd)}: some requests failed, see {out}")
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    stats = {i: r["stats"] for i, r in records.items()}
    return {"seconds": json.loads(summary.read_text())["seconds"], "process_s": time.monotonic() - started,
            "tokens": {i: s["n_predict"] for i, s in stats.items()},
            "latency_s": {i: s["t_restore_s"] + s["t_encode_s"] + s["t_save_s"] + s["t_decode_s"]
                          for i, s in stats.items()},
            "texts": {i: r["text"] for i, r in records.items()}, "rss_mib": rss,
            "kv_mib": kv_mib(log), "calibrated": "calibrating" in log.read_text(errors="replace")}


def ask(server: Server, request: dict) -> tuple[str, int, float]:
    """One request's answer, completion tokens and round trip."""
    body = {"max_tokens": request["n_predict"], "temperature": request["temperature"]}
    chat = "messages" in request
    started = time.monotonic()
    status, answer = server.post("/v1/chat/completions" if chat else "/v1/completions",
                                 {**body, **({"messages": request["messages"]} if chat
                                             else {"prompt": request["prompt"]})})
    seconds = time.monotonic() - started
    if status != 200:
        raise RuntimeError(f"request {request['id']} failed ({status}): {answer}")
    choice = answer["choices"][0]
    return choice["message"]["content"] if chat else choice["text"], answer["usage"]["completion_tokens"], seconds


def server_command(cfg: Config, bench: argparse.Namespace) -> tuple[list[str], list[str], dict]:
    """The command, flags and environment of a server run."""
    if cfg.tool == "serve":
        return ([bench.speculate, "serve"], speculate_flags(cfg, bench),
                {**bench.env, "SPECULATE_LLAMA_LOG": "1"})
    # -lv 4: llama.cpp's load log, KV buffer size included (3, the default, leaves it out)
    flags = ["-m", bench.target_file, "-c", str(CTX), "-t", str(bench.threads), "-np", str(cfg.n), "-kvu",
             "-lv", "4", *(["--spec-default"] if cfg.spec == "spec-default" else [])]
    return [str(bench.llama_server)], flags, bench.env


def run_served(cfg: Config, bench: argparse.Namespace, requests: list[dict], work: Path) -> dict:
    """A fresh server, the requests from cfg.n clients at once (each takes the next when answered)."""
    command, flags, env = server_command(cfg, bench)
    started = time.monotonic()
    log = work / f"{cfg.tool}-{cfg.n}-{cfg.spec}.log"
    server = Server(flags, log, command=command, env=env)
    try:
        first = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(max_workers=cfg.n) as clients:
            answers = dict(zip((r["id"] for r in requests), clients.map(lambda r: ask(server, r), requests)))
        seconds = time.monotonic() - first
        rss = harness.peak_rss_mib(server.proc.pid)
    except RuntimeError as e:
        sys.exit(f"{cfg.name}: {e}")
    finally:
        server.close()
    return {"seconds": seconds, "process_s": time.monotonic() - started,
            "tokens": {i: a[1] for i, a in answers.items()}, "latency_s": {i: a[2] for i, a in answers.items()},
            "texts": {i: a[0] for i, a in answers.items()}, "rss_mib": rss, "kv_mib": kv_mib(log),
            "calibrated": "calibrating" in log.read_text(errors="replace")}


def measure_ceiling(bench: argparse.Namespace, ns: list[int]) -> dict:
    """The `ceiling` scenario with the speculate build's Python: what one batch of a token of
    each of N sequences gains over N single decodes on this machine, per N (the most -np N can
    gain on the steps; prompts gain next to nothing)."""
    ceiling = harness.run_json([harness.python_of(bench.speculate), "-m", "scripts.bench", "ceiling",
                                bench.target_file, "-t", str(bench.threads), "--ns", ",".join(map(str, ns))],
                               env=bench.env, cwd=ROOT)
    print("ceiling, one batch of N tokens against N decodes: " + ", ".join(
        f"N={n} {harness.median(g):.2f}x" for n, g in ceiling["n"].items()), file=sys.stderr, flush=True)
    return ceiling


def calibrate(bench: argparse.Namespace, n: int, requests: list[dict], work: Path) -> None:
    """auto's cost curves, untimed, for batches of up to n requests at once (n x 17 tokens): a batch
    -np n of n short requests, which measures them now if this machine has not cached them yet."""
    (work / "calibrate").mkdir()
    cycled = [{**requests[i % len(requests)], "id": f"calibrate-{i}", "n_predict": 8} for i in range(n)]
    run = run_batch(Config("batch", n, "auto"), bench, cycled, work / "calibrate")
    if run["calibrated"]:
        print(f"calibrated auto for up to {n} requests at once (cached for later runs)", file=sys.stderr,
              flush=True)


def measure(cfg: Config, bench: argparse.Namespace, requests: list[dict], work: Path, repeat: int) -> dict:
    run = (run_batch if cfg.tool == "batch" else run_served)(cfg, bench, requests, work)
    tokens, latencies = sum(run["tokens"].values()), list(run["latency_s"].values())
    run.update(config=cfg.name, tool=cfg.tool, n=cfg.n, spec=cfg.spec, repeat=repeat, total_tokens=tokens,
               throughput=tokens / run["seconds"], p50_s=harness.percentile(latencies, 50),
               p95_s=harness.percentile(latencies, 95))
    print(f"repeat {repeat + 1}  {cfg.name:32s} {run['throughput']:7.2f} t/s  {tokens:5d} tokens in "
          f"{run['seconds']:6.1f} s  p50 {run['p50_s']:5.1f} s  p95 {run['p95_s']:5.1f} s  "
          f"RSS {run['rss_mib'] or 0:6.0f} MiB  KV {run['kv_mib'] or 0:5.0f} MiB"
          + ("  (calibrated auto in this run)" if run["calibrated"] else ""), file=sys.stderr, flush=True)
    return run


def count_differing(runs: list[dict]) -> None:
    """Each run's `differ`: answers unlike the same request's in the -np 1 run of its tool, spec and repeat."""
    single = {(r["tool"], r["spec"], r["repeat"]): r["texts"] for r in runs if r["n"] == 1}
    for r in runs:
        reference = single.get((r["tool"], r["spec"], r["repeat"]))
        r["differ"] = None if reference is None else sorted(i for i, t in r["texts"].items() if reference.get(i) != t)


def attach_margins(runs: list[dict], bench: argparse.Namespace, requests: list[dict]) -> None:
    """Each run's `margins`: for every answer unlike -np 1's, where the two part and the target's
    top-2 logit margin there (scripts/divergence.py, with the speculate build's Python)."""
    single = {(r["tool"], r["spec"], r["repeat"]): r["texts"] for r in runs if r["n"] == 1}
    body = {r["id"]: {k: r[k] for k in ("prompt", "messages") if k in r} for r in requests}
    pairs: dict[tuple, int] = {}  # (request, reference, other) -> its index in the script's input
    for r in runs:
        for i in r["differ"] or []:
            pairs.setdefault((i, single[(r["tool"], r["spec"], r["repeat"])][i], r["texts"][i]), len(pairs))
    if not pairs:
        return
    cmd = [harness.python_of(bench.speculate), ROOT / "scripts" / "divergence.py", bench.target_file,
           "-t", str(bench.threads), "-c", str(CTX)]
    given = [{**body[i], "reference": ref, "other": other} for i, ref, other in pairs]  # in index order
    found = harness.run_json(cmd, input=json.dumps(given), env=bench.env)
    for r in runs:
        r["margins"] = {i: found[pairs[(i, single[(r["tool"], r["spec"], r["repeat"])][i], r["texts"][i])]]
                        for i in r["differ"] or []}


def summarise(runs: list[dict], configs: list[Config], ceiling: dict) -> list[dict]:
    """One row per configuration: medians over its repeats, and the ceiling at its N."""
    base = [r["throughput"] for r in runs if r["config"] == BASELINE]
    baseline = harness.median(base) if base else None
    rows = []
    for cfg in configs:
        mine = [r for r in runs if r["config"] == cfg.name]
        speeds = [r["throughput"] for r in mine]
        differ = [len(r["differ"]) for r in mine if r["differ"] is not None]
        rows.append({"config": cfg.name, "n": cfg.n, "throughput": harness.median(speeds),
                     "min": min(speeds), "max": max(speeds), "ratio": harness.ratio(harness.median(speeds), baseline),
                     "p50_s": harness.median(r["p50_s"] for r in mine),
                     "p95_s": harness.median(r["p95_s"] for r in mine),
                     "rss_mib": max((r["rss_mib"] for r in mine if r["rss_mib"]), default=None),
                     "kv_mib": max((r["kv_mib"] for r in mine if r["kv_mib"]), default=None),
                     "differ": max(differ) if differ else None,
                     "largest_margin": max((m["top2_margin"] for r in mine for m in r.get("margins", {}).values()),
                                           default=None),
                     "ceiling": harness.median(ceiling["n"][str(cfg.n)])})
    return rows


def print_table(rows: list[dict], requests: int, n_predict: int, repeats: int) -> None:
    def opt(value, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    print(f"{requests} requests, {n_predict} greedy tokens each, {repeats} repeat(s); throughput: median "
          f"(min-max) generated tokens/s over the run; latency: medians of the runs' p50 and p95")
    print(f"| config | N | tokens/s | vs {BASELINE} | ceiling at N | p50 s | p95 s | peak RSS MiB | KV MiB "
          f"| differ from -np 1 (of {requests}) | largest top-2 margin where they part |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['config']} | {row['n']} | {row['throughput']:.2f} ({row['min']:.2f}-{row['max']:.2f}) | "
              f"{opt(row['ratio'], '.2f')}{'x' if row['ratio'] else ''} | {row['ceiling']:.2f}x | "
              f"{row['p50_s']:.2f} | {row['p95_s']:.2f} | "
              f"{opt(row['rss_mib'], '.0f')} | {opt(row['kv_mib'], '.1f')} | {opt(row['differ'], 'd')} | "
              f"{opt(row['largest_margin'], '.3f')} |")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = harness.parser(__name__, __doc__)
    harness.add_speculate(parser, default=str(ROOT / ".venv" / "bin" / "speculate"))
    parser.add_argument("-m", "--model", default="qwen2.5-coder-1.5b-instruct", help="target (path or registry name)")
    parser.add_argument("-md", "--model-draft", dest="draft", default="qwen2.5-coder-0.5b-instruct",
                        help="draft model for auto (path or registry name)")
    harness.add_threads(parser)
    parser.add_argument("--requests", type=int, default=16, help="distinct requests per run (default 16)")
    parser.add_argument("-n", "--n-predict", type=int, default=64, help="greedy tokens per request (default 64)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every configuration (default 3)")
    parser.add_argument("--only", nargs="+", action="extend", default=[], metavar="CONFIG_SUBSTRING",
                        help="run only the configurations whose name holds one of these, as 'batch', "
                             "'serve -np' (not llama-server), 'llama-server', '-np 4', 'auto', 'batch -np 1 none'")
    harness.add_output(parser, "every run's figures and answers")
    return harness.parse(parser, argv)


def main(argv: list[str] | None = None) -> int:
    bench = parse_args(argv)
    configs = [c for c in CONFIGS if not bench.only or any(s in c.name for s in bench.only)]
    if not configs:
        sys.exit(f"--only {' '.join(bench.only)}: no such configuration; there are: "
                 + ", ".join(c.name for c in CONFIGS))
    bench.speculate = harness.speculate(bench.speculate)
    bench.env = dict(os.environ)
    bench.target_file = str(harness.model_file(bench.model, bench.speculate))
    if any(c.tool == "llama-server" for c in configs):
        bench.llama_server = llama_server_binary()
    ceiling = measure_ceiling(bench, sorted({c.n for c in configs}))
    requests = make_requests(bench.requests, bench.n_predict)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-parallel-") as tmp:
        if any(c.spec == "auto" for c in configs):
            calibrate(bench, max(c.n for c in configs if c.spec == "auto"), requests, Path(tmp))
        for repeat, cfg in harness.interleaved(configs, bench.repeats):
            runs.append(measure(cfg, bench, requests, Path(tmp), repeat))
    count_differing(runs)
    attach_margins(runs, bench, requests)
    rows = summarise(runs, configs, ceiling)
    print_table(rows, len(requests), bench.n_predict, bench.repeats)
    if bench.output:
        harness.write(bench.output, {
            "meta": harness.meta(speculate=bench.speculate, model=bench.model, draft=bench.draft,
                                 threads=bench.threads, ctx=CTX, requests=[r["id"] for r in requests],
                                 n_predict=bench.n_predict, repeats=bench.repeats,
                                 llama_server=str(getattr(bench, "llama_server", "")) or None,
                                 cmake_flags=CMAKE_FLAGS, GGML_CPU_TILED_MM=os.environ.get("GGML_CPU_TILED_MM")),
            "ceiling": ceiling, "rows": rows, "runs": runs})
    return 0
