"""`speculate bench`: configurations against target-only decoding, on this machine."""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

import typer
from rich.text import Text

from speculative.decoding.settings import ModelSpec, SamplerSettings, SpecSettings
from speculative.drafters import registry
from speculative.engine import bench
from speculative.errors import UsageError

from . import options, terminal
from .progress import StatusLine
from .render import PipeConsole


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

    heads = [registry.heads(c.spec) for c in configs]
    mtp, features = {mtp for mtp, _ in heads}, {features for _, features in heads} - {None}
    target, draft = models.specs(uses_draft, max(c.spec.branches for c in configs),
                                  max(c.spec.longest_draft for c in configs),
                                  "named" if "named" in mtp else "auto" if "auto" in mtp else None,
                                  next(iter(sorted(features - {"auto"})), "auto" if features else None))
    from speculative.engine.engine import Engine  # loads llama.cpp: imported when a model runs (start-up time)

    with StatusLine() as status:
        ended = _announce(status, prompts_, configs, repeat, n_predict)
        with Engine(target, draft, notify=status.say, progress=status.update, **pool.engine_args()) as engine:
            started = time.time()
            runs = bench.run_bench(engine, prompts_, configs, sampling, repeat, ended, status.update)
            settings = {"n_predict": n_predict, "temp": temp, "seed": seed, "repeat": repeat,
                        "configs": [c.label for c in configs], "prompts": str(prompts)}
            status.update("bench: the costs and prompt lengths the results file records")
            meta = _meta(engine, target, draft, started, settings, prompts_)
    rows = bench.summarize(runs)
    output.write_text(json.dumps(bench.report(runs, rows, meta), indent=1))
    _print_results(rows, runs, meta, per_prompt, output)


def _announce(status: StatusLine, prompts: list, configs: list, repeat: int,
              n_predict: int) -> Callable[[bench.Run], None]:
    """Say how many runs bench makes; returns what reports each run as it ends, a line of
    aligned fields that a narrow terminal breaks only between fields."""
    total = bench.count_runs(len(prompts), len(configs), repeat)
    status.say(f"bench: {len(prompts)} prompts x {len(configs)} configurations x {repeat}, target-only "
               f"runs between every {bench.BASELINE_EVERY}: {total} runs of {n_predict} tokens")
    done = []
    widths = (len(f"[{total}/{total}]"), max(len(p.id) for p in prompts), max(len(c.label) for c in configs))
    columns = terminal.width(status.stream)

    def ended(run: bench.Run) -> None:
        done.append(run)
        padded = (f"[{len(done)}/{total}]", run.prompt, run.config)
        status.say("\n".join(terminal.fields(
            [*(text.ljust(w) for text, w in zip(padded, widths)), f"{run.decode_tps:6.2f} t/s",
             f"accepted {run.n_accept}/{run.n_drafted}"], columns)))

    return ended


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
    """The tables and notes on standard output, once every run has ended: as many of each table's
    columns as the terminal has room for (every figure is in the results file)."""
    columns = terminal.width(sys.stdout)
    console = PipeConsole(width=columns or terminal.UNLIMITED, highlight=False)
    every = _summary_columns(rows)
    shown = terminal.first_fitting(terminal.dropping(every, _least_wanted(every)), columns)
    console.print(terminal.table(shown, columns, title=SUMMARY_TITLE, title_justify="left"))
    if per_prompt:
        console.print(_per_prompt_table(runs, columns))
    console.print(_chart(rows, columns))
    mismatches = [r for r in runs if r.mismatch]
    lines = [f"mismatch: {r.prompt} / {r.config}: position {r.mismatch['position']}, target top-2 margin "
             f"{r.mismatch['margin']:.3f} ({'near-tie' if r.mismatch['margin'] < 0.5 else 'LARGE: a bug'})"
             for r in mismatches]
    lines.append(f"{len(mismatches)} output mismatches against target-only; llama.cpp batch-variant kernels: "
                 f"{', '.join(meta['machine']['batch_variant_kernels']) or 'none'}")
    lines.append("n-gram bound: what a planner knowing the output in advance would get from n-gram "
                 "drafting with this machine's measured verify costs (median over prompts)")
    if len(shown) < len(every):
        lines.append(f"left out at this width: {', '.join(terminal.left_out(shown, every))} (every figure "
                     "is in the results file)")
    lines.append(f"results: {output}")
    for line in lines:
        console.print("\n".join(terminal.wrap(line, columns)), markup=False, soft_wrap=True)


SUMMARY_TITLE = ("by category (speedup: median over prompts of each prompt's median over its repeats, vs target "
                 "only in the same run; worst: the worst prompt's)")


def _summary_columns(rows: list[dict]) -> list[terminal.Column]:
    """The summary table's columns, categories in order, "all" last."""
    rows = sorted(rows, key=lambda r: (r["category"] == "all", r["category"]))

    def figures(header: str, form: Callable[[dict], str]) -> terminal.Column:
        return terminal.Column(header, [form(r) for r in rows], "right", whole=True)

    return [
        terminal.Column("category", [r["category"] for r in rows]),
        terminal.Column("config", [r["config"] for r in rows]),
        figures("speedup", lambda r: f"{r['median_speedup']:.2f}x"),
        figures("worst", lambda r: f"{r['min_speedup']:.2f}x"),
        figures("modelled", lambda r: f"{r['median_modelled_speedup']:.2f}x"),
        figures("worst", lambda r: f"{r['min_modelled_speedup']:.2f}x"),
        figures("t/s", lambda r: f"{r['median_tps']:.1f}"),
        figures("accept", lambda r: f"{100 * r['accept_rate']:.0f}%"),
        figures("acc len", lambda r: f"{r['mean_accepted_length']:.2f}"),
        figures("draft", lambda r: f"{100 * r['draft_share']:.0f}%"),
        figures("verify", lambda r: f"{100 * r['verify_share']:.0f}%"),
        figures("python", lambda r: f"{100 * r['python_share']:.1f}%"),
        figures("mism.", lambda r: str(r["mismatches"])),
        figures("n-gram bound", lambda r: f"{r['median_ngram_bound']:.2f}x" if "median_ngram_bound" in r else ""),
    ]


def _least_wanted(columns: list[terminal.Column]) -> list[terminal.Column]:
    """The summary's columns a narrow terminal leaves out, first to last: the time shares, the
    n-gram bound, the accepted length, the modelled speedups (its worst first), the tokens per
    second; category, configuration, speedup, its worst, acceptance and mismatches stay."""
    category, config, speedup, worst, modelled, modelled_worst, tps, accept, acc_len, draft, verify, python, \
        mismatches, bound = columns
    return [python, verify, draft, bound, acc_len, modelled_worst, modelled, tps]


def _per_prompt_table(runs: list[bench.Run], columns: int | None):
    every = [terminal.Column("prompt", [r.prompt for r in runs]),
             terminal.Column("category", [r.category for r in runs]),
             terminal.Column("config", [r.config for r in runs]),
             terminal.Column("speedup", [f"{r.speedup:.2f}x" for r in runs], "right", whole=True),
             terminal.Column("t/s", [f"{r.decode_tps:.1f}" for r in runs], "right", whole=True),
             terminal.Column("accept", [f"{100 * r.accept_rate:.0f}%" for r in runs], "right", whole=True)]
    category, tps = every[1], every[4]
    shown = terminal.first_fitting(terminal.dropping(every, [category, tps]), columns)
    return terminal.table(shown, columns, title="by prompt", title_justify="left")


def _chart(rows: list[dict], columns: int | None, widest: int = 40, narrowest: int = 10):
    """Median speedup per configuration over all prompts, as bars (| marks 1.0x), each bar as
    wide as the terminal leaves room for, from `narrowest` to `widest`."""
    overall = [r for r in rows if r["category"] == "all"]
    top = max([r["median_speedup"] for r in overall] + [1.0])
    labels = terminal.Column("config", [r["config"] for r in overall])
    values = terminal.Column("", [f"{r['median_speedup']:.2f}x" for r in overall], "right", whole=True)
    options = {"title": "speedup per configuration, all prompts (| = target only)", "title_justify": "left",
               "show_header": False, "box": None}
    room = widest if columns is None else columns - terminal.frame(3, options) - labels.natural - values.natural
    width = max(narrowest, min(widest, room))
    bars = []
    for row in overall:
        filled = int(round(width * row["median_speedup"] / top))
        one = int(round(width / top))
        bar = "".join("|" if i == one - 1 else ("█" if i < filled else " ") for i in range(width))
        bars.append(Text(bar, style="green" if row["median_speedup"] >= 1 else "red"))
    return terminal.table([labels, terminal.Column("", bars, whole=True), values], columns, **options)
