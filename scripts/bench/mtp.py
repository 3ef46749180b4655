"""What the target's NextN (MTP) layers cost and buy, measured on the tiny Qwen3.5 of tiny_model.py.

    python -m scripts.bench mtp [--size 64x4] [--size 1024x12] [--threads 1] [--repeat 5]
                                [--rounds 3] [-n 64] [--prompt TEXT] [-o FILE]

The figures of docs/drafters.md's "Drafting with the target's MTP layers" (the paragraph on what the
NextN layers cost when auto never uses them). For each --size N_EMBDxN_LAYER (default: the
default tiny model, 64x4, and 1024x12), `python -m tests.tiny_model qwen35 OUT.gguf --mtp` writes a
random-weight model with one NextN layer into a temporary folder, and the scenario measures:

- the file: its bytes, and the bytes of its NextN block's tensors (every `blk.{i}.*` tensor of
  the last nextn_predict_layers blocks, as the gguf reader lists them);
- loading it without and with the NextN layers (`ModelSpec(mtp=False/True)`, n_ctx
  --ctx, --threads, --snapshots n_rs_seq as auto asks for on this recurrent model: the
  constructor's time, context and warm-up decode included), each load in a fresh child
  process, the two cases alternating over --repeat: the seconds, the resident memory
  (/proc/self/status before and after the load), and the buffers llama.cpp's log reports
  (SPECULATE_LLAMA_LOG=1: the model's mapped weights, the target context's KV, RS, output and
  compute buffers). The file is read once before (it sits in the page cache: llama.cpp maps
  it, so these are page-cache loads, not reads from disk). With the layers, the same child
  then makes the MTP head (`tap.mtp_head()`: llama.cpp's MTP context on the same weights and its
  first decode), and reports its seconds, the memory it added and its own buffers from the
  log; then it decodes --context-tokens tokens through the target and reads back the NextN
  rows it kept for the head (`nextn_state`): their bytes per token of context;
- a head step against a target pass (speculative/engine/calibrate.py's `measure` and `measure_mtp`,
  as auto calibrates them: a decode of b tokens after 32 of context, the median of 3, b = 1..16),
  medians over --repeat: the target's one-token pass, the head's one-entry step, their ratio,
  and the head's batch of 16 per entry (catching up on the tokens the target accepted);
- the CLI, `speculate --json -m FILE -p PROMPT -n N --temp 0 --ignore-eos -t THREADS` with
  `--spec-type none`, `draft-mtp` and `auto`, in --rounds rounds (the order rotates from one
  round to the next), after one untimed `auto` run that calibrates (SPECULATE_HOME is a
  temporary folder, so every size calibrates afresh): each run's decode speed and its ratio
  to the `none` run of the same round, the acceptance, auto's plans, the order of its steps
  (each run goes through `python -c` with Stats.add wrapped to write every step's drafter,
  draft length and accepted tokens to a file, then speculative.cli.main.main(): the CLI itself, nothing
  else changed), and whether its tokens are the `none` run's.

The head's weights are random (it favours the trunk's successor token, as tiny_model.py
says): only the costs mean anything for a real model; the acceptance is this model's.
Prints a summary per size; -o writes everything as JSON:

    {"meta": the harness's meta (date, command, machine, commit) and llama_cpp (system_info),
     "args": the scenario's arguments,
     "models": [one object per --size:
       "size" ("1024x12"), "n_embd", "n_layer" (trunk blocks), "nextn_layers" (NextN blocks),
       "file_bytes", "nextn_bytes" (the NextN blocks' tensor bytes), "nextn_share" (of file_bytes),
       "load": {"plain": CASE, "nextn": CASE}, each CASE with
           "runs": [per child: "load_s", "rss_before_mib", "rss_loaded_mib", "rss_anon_mib",
                    "rss_file_mib" (after loading), "nextn_layers" (as loaded), "buffers_mib"
                    ({"model", "KV", "RS", "output", "compute"}: MiB llama.cpp's log reports for
                    the weights and the target's context), and, for nextn, "head_s",
                    "rss_head_mib" (after the head), "head_buffers_mib" ({"KV", "output",
                    "compute"} of the head's context), "row_bytes_per_token"],
           and the medians over the runs: "load_s", "rss_loaded_mib",
           "rss_growth_mib" (rss_loaded - rss_before), "buffers_mib"; for nextn also "head_s",
           "head_rss_growth_mib" (rss_head - rss_loaded), "head_buffers_mib",
           "row_bytes_per_token";
       "load_s_difference" (nextn - plain, medians), "rss_difference_mib" (the same, of
       rss_growth_mib), "head_buffers_total_mib" (the head context's buffers summed),
       "costs": {"batch": 16, "target_ms" / "head_ms": v(1..16) in ms, medians per size;
           "target_pass_ms" (target_ms[0]), "head_step_ms" (head_ms[0]), "head_vs_target"
           (their ratio), "head_catch_up_ms_per_entry" (head_ms[15] / 16),
           "repeats": [{"target_ms", "head_ms"} per repeat]},
       "cli": {"prompt", "n_predict", "n_ctx" (4096, the CLI's -c default),
           "calibration": the untimed auto run (a RUN, no ratio),
           "runs": [RUN per run: "round", "spec" ("none", "draft-mtp", "auto"), "decode_tps",
                    "ratio_to_none" (decode_tps over that round's none run), "accept_rate",
                    "n_drafted", "n_accept", "n_predict", "n_steps", "t_load_s", "plans"
                    (the JSON's [{"drafter", "k", "steps"}]), "notes", "steps" ([drafter or
                    null, k, accepted] per step, in order), "mtp_steps" (steps that drafted
                    with draft-mtp), "first_mtp_step", "last_mtp_step" (1-based, null if none),
                    "drafted_after_last_mtp" (steps after it that drafted anything; every
                    drafting step if none),
                    "same_as_none" (its tokens are the first none run's)],
           "summary": {spec: {"decode_tps" (median), "ratio_min", "ratio_median",
                    "ratio_max", "accept_rate" (median), "mtp_steps" (list, one per run),
                    "identical" (every run's tokens the same as none's)}}}]}
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gguf

from scripts.bench import harness
from speculative.decoding.cache import Cache, HeadCache
from speculative.engine.calibrate import measure, measure_mtp
from tests.tiny_model import write_model

PROMPT = "once upon a time there were a cat and a dog. once upon a time there were"  # tests/test_mtp.py's
CATCH_UP = 16  # the head's batch: the entries it decodes to catch up with the target
SPECS = ("none", "draft-mtp", "auto")
MARK = "@@bench_mtp: "  # what the load child writes on stderr between llama.cpp's log lines
BUFFER = re.compile(r"\b(model|output|KV|RS|compute) buffer size =\s*([\d.]+) MiB")
MIB = 2**20

# The CLI, with every step it runs written to the file $BENCH_MTP_STEPS as it is counted.
PROBE = """
import json, os
from speculative.decoding.events import Step
from speculative.decoding.stats import Stats
trail = open(os.environ["BENCH_MTP_STEPS"], "w")
add = Stats.add
def recorded(self, event):
    if isinstance(event, Step):
        trail.write(json.dumps([event.drafter, event.n_drafted, event.n_accepted]) + "\\n")
        trail.flush()
    return add(self, event)
Stats.add = recorded
from speculative.cli.main import main
main()
"""


# -- the file --------------------------------------------------------------------------


def parse_size(text: str) -> tuple[int, int]:
    """'1024x12' -> (n_embd, n_layer)."""
    try:
        n_embd, n_layer = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N_EMBDxN_LAYER (such as 1024x12), got {text!r}") from None
    return n_embd, n_layer


def nextn_bytes(path: Path) -> tuple[int, int, int]:
    """(bytes of the NextN blocks' tensors, how many NextN blocks, the trunk's blocks)."""
    reader = gguf.GGUFReader(str(path))
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    blocks = int(reader.fields[f"{arch}.block_count"].parts[-1][0])
    nextn = int(reader.fields[f"{arch}.nextn_predict_layers"].parts[-1][0])
    first = blocks - nextn
    owned = {f"blk.{i}." for i in range(first, blocks)}
    size = sum(int(t.n_bytes) for t in reader.tensors if any(t.name.startswith(p) for p in owned))
    return size, nextn, first


def read_through(path: Path) -> None:
    """Read the whole file, so that every load below finds it in the page cache."""
    with path.open("rb") as f:
        while f.read(1 << 24):
            pass


# -- loading, in a child process per load ----------------------------------------------


def rss() -> dict[str, float]:
    """This process's resident memory in MiB: VmRSS, RssAnon, RssFile."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) / 1024
    return fields


def mark(what: str) -> None:
    os.write(2, f"{MARK}{what}\n".encode())


def load_child(path: Path, case: str, args: argparse.Namespace) -> None:
    """One load (the parent reads llama.cpp's log from this process's stderr): JSON on stdout."""
    from speculative.llamacpp.devices import system_info

    system_info()  # llama.cpp's backend set up before, not counted in the load (the binding imported in main)
    before = rss()
    mark("load")
    t0 = time.perf_counter()
    model = harness.load(path, n_ctx=args.ctx, n_threads=args.threads, n_rs_seq=args.snapshots, mtp=case == "nextn")
    out = {"load_s": time.perf_counter() - t0}
    loaded = rss()
    out |= {"rss_before_mib": before["VmRSS"], "rss_loaded_mib": loaded["VmRSS"],
            "rss_anon_mib": loaded["RssAnon"], "rss_file_mib": loaded["RssFile"], "nextn_layers": model.nextn_layers}
    if case == "nextn":
        mark("head")
        t0 = time.perf_counter()
        model.tap.mtp_head()
        out["head_s"] = time.perf_counter() - t0
        out["rss_head_mib"] = rss()["VmRSS"]
        mark("rows")
        n = args.context_tokens
        model.decode([(7 * i) % model.n_vocab for i in range(n)], 0, "last")
        out["row_bytes_per_token"] = len(model.nextn_state(n)) / n
    mark("end")
    model.close()
    print(json.dumps(out), flush=True)


def buffers(log: str) -> dict[str, float]:
    """MiB per kind of buffer that llama.cpp's log lines report (summed over devices)."""
    found: dict[str, float] = {}
    for kind, mib in BUFFER.findall(log):
        found[kind] = found.get(kind, 0.0) + float(mib)
    return found


def sections(stderr: str) -> dict[str, str]:
    """The child's stderr cut at its marks: mark -> the log lines after it."""
    parts = stderr.split(MARK)
    return {part.partition("\n")[0]: part.partition("\n")[2] for part in parts[1:]}


def load_once(path: Path, case: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "SPECULATE_LLAMA_LOG": "1"}
    cmd = [sys.executable, "-m", "scripts.bench", "mtp", "--load-child", case, str(path), "--ctx", str(args.ctx),
           "--threads", str(args.threads), "--snapshots", str(args.snapshots),
           "--context-tokens", str(args.context_tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=harness.ROOT)
    if proc.returncode != 0:
        harness.failed(cmd, proc.returncode, proc.stderr)
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    logs = sections(proc.stderr)
    run["buffers_mib"] = buffers(logs.get("load", ""))
    if case == "nextn":
        run["head_buffers_mib"] = buffers(logs.get("head", ""))
    return run


def medians(runs: list[dict], keys: list[str]) -> dict:
    return {key: harness.median(r[key] for r in runs) for key in keys}


def median_buffers(runs: list[dict], field: str) -> dict[str, float]:
    kinds = sorted({k for r in runs for k in r[field]})
    return {k: harness.median(r[field].get(k, 0.0) for r in runs) for k in kinds}


def measure_loads(path: Path, args: argparse.Namespace) -> dict:
    runs: dict[str, list[dict]] = {"plain": [], "nextn": []}
    for _, case in harness.interleaved(("plain", "nextn"), args.repeat, rotate=True):
        runs[case].append(load_once(path, case, args))
    load = {}
    for case, case_runs in runs.items():
        for run in case_runs:
            run["rss_growth_mib"] = run["rss_loaded_mib"] - run["rss_before_mib"]
            if case == "nextn":
                run["head_rss_growth_mib"] = run["rss_head_mib"] - run["rss_loaded_mib"]
        keys = ["load_s", "rss_loaded_mib", "rss_growth_mib"]
        load[case] = {"runs": case_runs, **medians(case_runs, keys),
                      "buffers_mib": median_buffers(case_runs, "buffers_mib")}
        if case == "nextn":
            load[case] |= medians(case_runs, ["head_s", "head_rss_growth_mib", "row_bytes_per_token"])
            load[case]["head_buffers_mib"] = median_buffers(case_runs, "head_buffers_mib")
    return load


# -- a head step against a target pass -------------------------------------------------


def quiet(_: str) -> None:
    """calibrate's progress lines, not printed here."""


def measure_costs(path: Path, args: argparse.Namespace) -> dict:
    with harness.load(path, n_ctx=args.ctx, n_threads=args.threads, n_rs_seq=args.snapshots, mtp=True) as model:
        cache, mtp = Cache(model), HeadCache(model.tap.mtp_head())
        repeats: list[dict] = [{} for _ in range(args.repeat)]
        sizes = list(range(1, CATCH_UP + 1))
        for r, which in harness.interleaved(("target", "head"), args.repeat, rotate=True):
            timed = measure(cache, sizes, quiet) if which == "target" else measure_mtp(mtp, sizes, quiet)
            repeats[r][f"{which}_ms"] = [1e3 * harness.median(timed.rounds[b]) for b in sizes]
    target = [harness.median(r["target_ms"][b] for r in repeats) for b in range(CATCH_UP)]
    head = [harness.median(r["head_ms"][b] for r in repeats) for b in range(CATCH_UP)]
    return {"batch": CATCH_UP, "target_ms": target, "head_ms": head, "target_pass_ms": target[0],
            "head_step_ms": head[0], "head_vs_target": harness.ratio(head[0], target[0]),
            "head_catch_up_ms_per_entry": head[-1] / CATCH_UP, "repeats": repeats}


# -- the CLI ---------------------------------------------------------------------------


def cli_once(path: Path, spec: str, args: argparse.Namespace, home: Path) -> dict:
    steps_file = home / "steps.jsonl"
    env = {**os.environ, "SPECULATE_HOME": str(home), "BENCH_MTP_STEPS": str(steps_file)}
    cmd = [sys.executable, "-c", PROBE, "-m", str(path), "-p", args.prompt, "-n", str(args.n_predict),
           "--temp", "0", "--ignore-eos", "-t", str(args.threads), "--spec-type", spec, "--json"]
    out = harness.run_json(cmd, env=env, cwd=harness.ROOT)
    steps = harness.jsonl(steps_file)
    run = {key: out[key] for key in ("decode_tps", "accept_rate", "n_drafted", "n_accept", "n_predict", "n_steps",
                                     "t_load_s", "plans", "notes")}
    return run | {"spec": spec, "steps": steps, **mtp_trail(steps), "tokens": out["tokens"]}


def mtp_trail(steps: list[list]) -> dict:
    """How many steps drafted with the MTP head, the first and the last of them (1-based), and
    how many steps after the last drafted anything."""
    mtp = [i for i, (drafter, k, _) in enumerate(steps, 1) if drafter == "draft-mtp" and k]
    last = mtp[-1] if mtp else None
    after = sum(1 for _, k, _ in steps[last or 0:] if k)
    return {"mtp_steps": len(mtp), "first_mtp_step": mtp[0] if mtp else None, "last_mtp_step": last,
            "drafted_after_last_mtp": after}


def measure_cli(path: Path, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as home:
        calibration = cli_once(path, "auto", args, Path(home))
        rounds: list[dict] = [{} for _ in range(args.rounds)]
        for r, spec in harness.interleaved(SPECS, args.rounds, rotate=True):
            rounds[r][spec] = cli_once(path, spec, args, Path(home)) | {"round": r + 1}
    runs = []
    for this_round in rounds:
        for spec in SPECS:
            this_round[spec]["ratio_to_none"] = harness.ratio(this_round[spec]["decode_tps"],
                                                              this_round["none"]["decode_tps"])
            runs.append(this_round[spec])
    reference = next(r["tokens"] for r in runs if r["spec"] == "none")
    for run in [calibration, *runs]:
        run["same_as_none"] = run.pop("tokens") == reference
    summary = {}
    for spec in SPECS:
        of = [r for r in runs if r["spec"] == spec]
        ratios = [r["ratio_to_none"] for r in of]
        summary[spec] = {"decode_tps": harness.median(r["decode_tps"] for r in of), "ratio_min": min(ratios),
                         "ratio_median": harness.median(ratios), "ratio_max": max(ratios),
                         "accept_rate": harness.median(r["accept_rate"] for r in of),
                         "mtp_steps": [r["mtp_steps"] for r in of], "identical": all(r["same_as_none"] for r in of)}
    return {"prompt": args.prompt, "n_predict": args.n_predict, "n_ctx": 4096, "calibration": calibration,
            "runs": runs, "summary": summary}


# -- the whole --------------------------------------------------------------------------


def measure_size(folder: Path, n_embd: int, n_layer: int, args: argparse.Namespace) -> dict:
    size = f"{n_embd}x{n_layer}"
    path = write_model("qwen35", folder / f"qwen35-mtp-{size}.gguf", mtp=True, n_embd=n_embd, n_layer=n_layer)
    try:
        read_through(path)
        file_bytes = path.stat().st_size
        nextn, n_nextn, trunk = nextn_bytes(path)
        row = {"size": size, "n_embd": n_embd, "n_layer": trunk, "nextn_layers": n_nextn, "file_bytes": file_bytes,
               "nextn_bytes": nextn, "nextn_share": nextn / file_bytes}
        print(f"{size}: wrote {path.name}, {file_bytes / MIB:.0f} MiB, NextN {nextn / MIB:.1f} MiB "
              f"({100 * row['nextn_share']:.1f}%)", flush=True)
        load = row["load"] = measure_loads(path, args)
        row["load_s_difference"] = load["nextn"]["load_s"] - load["plain"]["load_s"]
        row["rss_difference_mib"] = load["nextn"]["rss_growth_mib"] - load["plain"]["rss_growth_mib"]
        row["head_buffers_total_mib"] = sum(load["nextn"]["head_buffers_mib"].values())
        print_load(row)
        row["costs"] = measure_costs(path, args)
        print_costs(row["costs"])
        row["cli"] = measure_cli(path, args)
        print_cli(row["cli"])
    finally:
        path.unlink()
    return row


def print_load(row: dict) -> None:
    plain, nextn = row["load"]["plain"], row["load"]["nextn"]
    print(f"  load (page cache): {plain['load_s']:.3f} s without the NextN layers, {nextn['load_s']:.3f} s with; "
          f"resident memory +{plain['rss_growth_mib']:.1f} / +{nextn['rss_growth_mib']:.1f} MiB "
          f"(difference {row['rss_difference_mib']:.1f} MiB); model buffer "
          f"{plain['buffers_mib'].get('model', 0):.1f} / {nextn['buffers_mib'].get('model', 0):.1f} MiB", flush=True)
    head = ", ".join(f"{k} {v:.2f}" for k, v in nextn["head_buffers_mib"].items())
    print(f"  head context: {nextn['head_s']:.3f} s, resident memory +{nextn['head_rss_growth_mib']:.1f} MiB, "
          f"buffers {row['head_buffers_total_mib']:.2f} MiB ({head}); hidden rows "
          f"{nextn['row_bytes_per_token']:.0f} bytes per token", flush=True)


def print_costs(costs: dict) -> None:
    print(f"  head step {costs['head_step_ms']:.3f} ms, target pass {costs['target_pass_ms']:.3f} ms "
          f"({costs['head_vs_target']:.2f}x); catching up {costs['head_catch_up_ms_per_entry']:.3f} ms an entry "
          f"in a batch of {costs['batch']}", flush=True)


def print_cli(cli: dict) -> None:
    for spec, s in cli["summary"].items():
        print(f"  {spec:9s} {s['decode_tps']:8.1f} t/s, {s['ratio_min']:.2f}-{s['ratio_max']:.2f}x none "
              f"(median {s['ratio_median']:.2f}x), accepted {100 * s['accept_rate']:.0f}%, MTP steps "
              f"{s['mtp_steps']}, {'identical to none' if s['identical'] else 'OUTPUT DIFFERS from none'}",
              flush=True)
    auto = [r for r in cli["runs"] if r["spec"] == "auto"]
    for r in auto:
        print(f"    auto round {r['round']}: draft-mtp for {r['mtp_steps']} of {r['n_steps']} steps, from step "
              f"{r['first_mtp_step']} to {r['last_mtp_step']}, then {r['drafted_after_last_mtp']} steps drafted; "
              f"notes: {r['notes']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    from speculative.engine.engine import MAX_SNAPSHOTS  # the binding: here, so that listing the scenarios skips it

    parser = harness.parser(__name__, __doc__)
    parser.add_argument("--size", type=parse_size, action="append", metavar="N_EMBDxN_LAYER",
                        help="a model's width and trunk layers (repeatable; default: 64x4 and 1024x12)")
    harness.add_threads(parser, default=1)
    parser.add_argument("--ctx", type=int, default=4096, help="context cells of the library's loads (default "
                        "4096, the CLI's -c)")
    parser.add_argument("--snapshots", type=int, default=MAX_SNAPSHOTS, help="n_rs_seq of the library's loads "
                        f"(default {MAX_SNAPSHOTS}, what auto asks for)")
    parser.add_argument("--context-tokens", type=int, default=256, help="tokens decoded to read the hidden rows' "
                        "size (default 256)")
    parser.add_argument("--repeat", type=int, default=5, help="loads per case and cost measurements (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="CLI rounds of none, draft-mtp, auto (default 3)")
    parser.add_argument("-n", "--n-predict", type=int, default=64)
    parser.add_argument("--prompt", default=PROMPT)
    harness.add_output(parser, "everything")
    parser.add_argument("--load-child", nargs=2, metavar=("CASE", "PATH"), help=argparse.SUPPRESS)
    args = harness.parse(parser, argv)
    if args.load_child:
        case, path = args.load_child
        load_child(Path(path), case, args)
        return 0
    sizes = args.size or [(64, 4), (1024, 12)]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for n_embd, n_layer in sizes:
            rows.append(measure_size(Path(folder), n_embd, n_layer, args))
    if args.output:
        from speculative.llamacpp.devices import system_info

        saved = {k: v for k, v in vars(args).items() if k != "load_child"}
        saved |= {"size": [f"{e}x{l}" for e, l in sizes], "output": str(args.output)}
        harness.write(args.output, {"meta": harness.meta(llama_cpp=system_info()), "args": saved, "models": rows})
    return 0
