"""`speculate bench`: configurations against target-only decoding, on this machine."""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

import typer
from rich.console import Console
from rich.table import Table

from speculative.decoding.settings import ModelSpec, SamplerSettings, SpecSettings
from speculative.engine import bench
from speculative.errors import UsageError

from . import options

stderr = Console(stderr=True, highlight=False)


@options.with_options(options.MODELS, options.POOL.only("spec_pool_tokens"), options.GRAMMAR_GROUP)
def bench_command(
    models: options.ModelOptions,
    pool: options.PoolOptions,
    grammar: str,
    prompts: Path = typer.Argument(..., help="JSONL prompts: objects with `prompt` or chat `messages` "
                                             "(optional `id`, `category`, `grammar`, `json_schema`)."),
    config: Optional[List[str]] = typer.Option(
        None, "-C", "--config", metavar="TYPES",
        help="A --spec-type value to measure; repeat for several [default: draft (with a draft model; draft-mtp "
             "with an MTP head file), ngram-simple, auto]. Target-only runs are always measured."),
    sweep: Optional[List[str]] = typer.Option(
        None, "--sweep", metavar="KEY=V1,V2",
        help=f"Grid over a setting ({', '.join(bench.SWEEP_KEYS)}); repeat for a product. "
             "draft-max applies to fixed types, not auto."),
    n_predict: int = typer.Option(128, "-n", "--n-predict", "--predict", help="Tokens to generate per run."),
    temp: float = typer.Option(0.0, "--temp", "--temperature", help="Temperature (0: greedy, outputs checked for identity)."),
    seed: int = typer.Option(0, "-s", "--seed", help="One seed for every run, so sampled outputs compare."),
    repeat: int = typer.Option(1, "--repeat", help="Runs of every configuration per prompt."),
    category: Optional[List[str]] = typer.Option(None, "--category", help="Only prompts of this category."),
    limit: int = typer.Option(0, "--limit", help="Only the first N prompts (0: all)."),
    output: Optional[Path] = typer.Option(
        None, "-o", "--output", "--output-file", help="JSON results (default: speculate-bench-DATE-TIME.json here; "
                                     "an existing file is never overwritten)."),
    per_prompt: bool = typer.Option(False, "--per-prompt", help="Also print one row per prompt."),
) -> None:
    """Measure speedup over target-only decoding per prompt and category, on this machine."""
    drafter = models.head_given or "draft"  # what -md drafts with
    configs_wanted = config or [*([drafter] if models.draft_available else []), "ngram-simple", "auto"]
    grid = bench.parse_sweeps(sweep or [])
    if n_predict < 1 or repeat < 1 or limit < 0:
        raise UsageError("-n and --repeat must be >= 1, --limit >= 0")
    configs = bench.make_configs(configs_wanted, grid, SpecSettings(n_predict=n_predict))
    uses_draft = any([models.uses_draft(c.spec) for c in configs])
    prompts_ = _chosen_prompts(prompts, category, limit)
    output = output or Path(time.strftime("speculate-bench-%Y%m%d-%H%M%S.json"))
    if output.exists():
        raise UsageError(f"{output} exists; bench never overwrites results (choose another -o)")
    sampling = SamplerSettings(temp=temp, seed=seed, grammar=grammar)
    sampling.validate()

    mtp, features = {c.spec.mtp for c in configs}, {c.spec.features for c in configs} - {None}
    target, draft = models.specs(uses_draft, max(c.spec.branches for c in configs),
                                  max(c.spec.longest_draft for c in configs),
                                  "named" if "named" in mtp else "auto" if "auto" in mtp else None,
                                  next(iter(sorted(features - {"auto"})), "auto" if features else None))
    progress = _announce(len(prompts_), len(configs), repeat, n_predict)

    from speculative.engine.engine import Engine  # loads llama.cpp: imported when a model runs (start-up time)

    with Engine(target, draft, notify=stderr.print, **pool.engine_args()) as engine:
        started = time.time()
        runs = bench.run_bench(engine, prompts_, configs, sampling, repeat, progress)
        settings = {"n_predict": n_predict, "temp": temp, "seed": seed, "repeat": repeat,
                    "configs": [c.label for c in configs], "prompts": str(prompts)}
        meta = _meta(engine, target, draft, started, settings, prompts_)
    rows = bench.summarize(runs)
    output.write_text(json.dumps(bench.report(runs, rows, meta), indent=1))
    _print_results(rows, runs, meta, per_prompt, output)


def _announce(n_prompts: int, n_configs: int, repeat: int, n_predict: int) -> Callable[[bench.Run], None]:
    """Say how many runs bench makes; returns what reports each run as it ends."""
    rest = n_configs - 1
    total = n_prompts * repeat * (n_configs + (rest + bench.BASELINE_EVERY - 1) // bench.BASELINE_EVERY)
    stderr.print(f"bench: {n_prompts} prompts x {n_configs} configurations x {repeat}, target-only "
                 f"runs between every {bench.BASELINE_EVERY}: {total} runs of {n_predict} tokens")
    done = []

    def progress(run: bench.Run) -> None:
        done.append(run)
        stderr.print(f"[{len(done)}/{total}] {run.prompt:28s} {run.config:34s} {run.decode_tps:6.2f} t/s  "
                     f"accepted {run.n_accept}/{run.n_drafted}")

    return progress


def _chosen_prompts(prompts: Path, category: Optional[List[str]], limit: int) -> list:
    """The prompts of the file that --category and --limit leave (at least one)."""
    chosen = [p for p in bench.load_prompts(prompts) if not category or p.category in category]
    chosen = chosen[:limit] if limit else chosen
    if not chosen:
        raise UsageError("no prompt left after --category/--limit")
    return chosen


def _meta(engine, target: ModelSpec, draft: ModelSpec | None, started: float, settings: dict, prompts: list) -> dict:
    """What the results file records besides the runs: the machine, the models, the settings."""
    from speculative.llamacpp.devices import system_info

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": round(time.time() - started, 1),
        "machine": {"platform": platform.platform(), "processor": platform.machine(),
                    "llama_cpp": system_info(), "batch_variant_kernels": engine.target.kernels},
        "target": {"name": target.name, "path": str(target.path), "threads": engine.target.n_threads,
                   "loras": target.lora_info(),
                   "mtp_head": str(target.mtp_sidecar) if target.mtp_sidecar else None},
        "draft": {"name": draft.name, "path": str(draft.path), "loras": draft.lora_info()} if draft else None,
        "settings": settings,
        # what a replay of the runs (scripts/replay_auto.py) needs besides their outputs
        "costs": {role: engine.costs(role, bench.DRAFT_MAX_AUTO + 1 if role == "target" else 1)
                  for role in ("target", *(["draft"] if draft else []))},
        "prompt_tokens": {p.id: bench.prompt_tokens(engine, p) for p in prompts},
    }


def _print_results(rows: list[dict], runs: list[bench.Run], meta: dict, per_prompt: bool, output: Path) -> None:
    """The tables and notes on standard output, once every run has ended."""
    console = Console(width=None if sys.stdout.isatty() else 150)
    console.print(_table(rows, "by category (speedup: median over prompts of each prompt's median over its repeats, "
                               "vs target only in the same run; worst: the worst prompt's)"))
    if per_prompt:
        console.print(_per_prompt_table(runs))
    console.print(_chart(rows))
    mismatches = [r for r in runs if r.mismatch]
    for r in mismatches:
        m = r.mismatch
        console.print(f"mismatch: {r.prompt} / {r.config}: position {m['position']}, target top-2 margin "
                      f"{m['margin']:.3f} ({'near-tie' if m['margin'] < 0.5 else 'LARGE: a bug'})")
    console.print(f"{len(mismatches)} output mismatches against target-only; "
                  f"llama.cpp batch-variant kernels: {', '.join(meta['machine']['batch_variant_kernels']) or 'none'}")
    console.print("n-gram bound: what a planner knowing the output in advance would get from n-gram "
                  "drafting with this machine's measured verify costs (median over prompts)")
    console.print(f"results: {output}")


def _table(rows: list[dict], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col, just in (("category", "left"), ("config", "left"), ("speedup", "right"), ("worst", "right"),
                      ("modelled", "right"), ("worst", "right"),
                      ("t/s", "right"), ("accept", "right"), ("acc len", "right"), ("draft", "right"),
                      ("verify", "right"), ("python", "right"), ("mism.", "right"), ("n-gram bound", "right")):
        table.add_column(col, justify=just)
    for row in sorted(rows, key=lambda r: (r["category"] == "all", r["category"])):
        table.add_row(row["category"], row["config"], f"{row['median_speedup']:.2f}x",
                      f"{row['min_speedup']:.2f}x", f"{row['median_modelled_speedup']:.2f}x",
                      f"{row['min_modelled_speedup']:.2f}x", f"{row['median_tps']:.1f}",
                      f"{100 * row['accept_rate']:.0f}%", f"{row['mean_accepted_length']:.2f}",
                      f"{100 * row['draft_share']:.0f}%", f"{100 * row['verify_share']:.0f}%",
                      f"{100 * row['python_share']:.1f}%", str(row["mismatches"]),
                      f"{row['median_ngram_bound']:.2f}x" if "median_ngram_bound" in row else "")
    return table


def _per_prompt_table(runs: list[bench.Run]) -> Table:
    table = Table(title="by prompt", title_justify="left")
    for col in ("prompt", "category", "config", "speedup", "t/s", "accept"):
        table.add_column(col)
    for r in runs:
        table.add_row(r.prompt, r.category, r.config, f"{r.speedup:.2f}x", f"{r.decode_tps:.1f}",
                      f"{100 * r.accept_rate:.0f}%")
    return table


def _chart(rows: list[dict], width: int = 40) -> Table:
    """Median speedup per configuration over all prompts, as bars (| marks 1.0x)."""
    overall = [r for r in rows if r["category"] == "all"]
    top = max([r["median_speedup"] for r in overall] + [1.0])
    table = Table(title="speedup per configuration, all prompts (| = target only)", title_justify="left",
                  show_header=False, box=None)
    for row in overall:
        filled = int(round(width * row["median_speedup"] / top))
        one = int(round(width / top))
        bar = "".join("|" if i == one - 1 else ("█" if i < filled else " ") for i in range(width))
        table.add_row(row["config"], f"[green]{bar}[/green]" if row["median_speedup"] >= 1 else f"[red]{bar}[/red]",
                      f"{row['median_speedup']:.2f}x")
    return table

