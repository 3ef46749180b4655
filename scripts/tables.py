#!/usr/bin/env python3
"""The measured tables of README.md and docs/*.md, rebuilt from the raw results committed
under docs/results/.

    python scripts/tables.py             # every table
    python scripts/tables.py fim pool    # some of them
    python scripts/tables.py --list      # each table's name, file and the command that measures it

Each table of measurements in README.md or a docs/*.md page follows a marker line
`<!-- table NAME -->` (each NAME marked once across all of them); the table under it must
hold the numbers this script prints for NAME (tests/test_tables.py checks it), so a
published figure always comes with the file it was computed from and the command that
produced that file. To publish a new measurement: run the command, commit its
output under docs/results/, and paste what this script prints.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"


@dataclass(frozen=True)
class Table:
    name: str
    files: tuple[str, ...]  # under docs/results/
    command: str            # what produced the files (the first one's meta says exactly)
    render: Callable[..., list[str]]  # one loaded file per name in `files` -> the table's lines


def load(name: str):
    """A results file: JSON (gzipped when it ends in .gz), or plain text."""
    data = (RESULTS / name).read_bytes()
    if name.endswith(".gz"):
        data = gzip.decompress(data)
    return json.loads(data) if name.removesuffix(".gz").endswith(".json") else data.decode()


def row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def header(*names: str) -> list[str]:
    return [row(*names), row(*["---"] * len(names))]


def opt(value, fmt: str, suffix: str = "") -> str:
    """A number that may be missing ("-")."""
    return "-" if value is None else format(value, fmt) + suffix


def fraction(count: int | None, of: int) -> str:
    """count/of, or "-" where nothing was counted."""
    return "-" if count is None else f"{count}/{of}"


def median(values):
    return statistics.median(list(values))


# -- the tables ------------------------------------------------------------------------


def recurrent(data) -> list[str]:
    draft = data["args"]["draft"]
    lines = header("architecture", "rollback", "recurrent state", f"with {draft} snapshots", "one token",
                   f"verify of {draft + 1}, plain / with snapshots", "checkpoint copy / restore")
    for r in data["rows"]:
        lines.append(row(r["arch"], "snapshots" if r["snapshots_limit"] else "checkpoint",
                         f"{r['plain_state_mib']:.2f} MiB", f"{r['snapshots_state_mib']:.2f} MiB",
                         f"{r['plain_v1_ms']:.1f} ms", f"{r['plain_verify_ms']:.1f} / {r['snapshots_verify_ms']:.1f} ms",
                         f"{r['checkpoint_save_ms']:.2f} / {r['checkpoint_restore_ms']:.2f} ms"))
    return lines


def speedup_label(config: str) -> str:
    """bench's configuration label as the docs name it: "ngram-simple draft-max=3" -> "ngram-simple, k=3"."""
    kinds, *settings = config.split()
    return ", ".join([kinds, *(s.replace("draft-max=", "k=") for s in settings)])


def categories(data) -> list[str]:
    """The categories in the order of the prompts, then 'all'."""
    seen = dict.fromkeys(r["category"] for r in data["runs"])
    return [*seen, "all"]


def bench_rows(data) -> dict[tuple[str, str], dict]:
    return {(r["category"], r["config"]): r for r in data["summary"]}


def measured(data) -> list[str]:
    """auto against the best fixed configuration and the n-gram bound, per category."""
    rows = bench_rows(data)
    fixed = [c for c in data["meta"]["settings"]["configs"] if c != "target only" and not c.startswith("auto")]
    lines = header("category", "auto, measured", "auto, modelled", "best fixed, measured", "best fixed, modelled",
                   "n-gram bound")
    for category in categories(data):
        auto = rows[(category, "auto")]

        def best(key: str) -> str:
            config = max(fixed, key=lambda c: rows[(category, c)][key])
            return f"{rows[(category, config)][key]:.2f}x ({speedup_label(config)})"

        lines.append(row(category, f"{auto['median_speedup']:.2f}x ({auto['min_speedup']:.2f}x)",
                         f"{auto['median_modelled_speedup']:.2f}x ({auto['min_modelled_speedup']:.2f}x)",
                         best("median_speedup"), best("median_modelled_speedup"),
                         f"{rows[(category, 'target only')]['median_ngram_bound']:.2f}x"))
    return lines


def sampled(data) -> list[str]:
    """Sampled runs over all prompts: acceptance, accepted tokens per drafting step, speed."""
    rows = bench_rows(data)
    lines = header("config", "accepted", "accepted per step", "t/s", "speedup")
    for config in data["meta"]["settings"]["configs"]:
        r = rows[("all", config)]
        if config == "target only":
            lines.append(row(config, "", "", f"{r['median_tps']:.1f}", "1.00x"))
        else:
            lines.append(row(f"`{config.replace('accept=', '--spec-accept ').split(' ', 1)[1]}`",
                             f"{100 * r['accept_rate']:.0f}%", f"{r['mean_accepted_length']:.2f}",
                             f"{r['median_tps']:.1f}", f"{r['median_speedup']:.2f}x"))
    return lines


RPC_NAMES = {"auto,ngram-simple": "auto, n-gram", "auto,ngram-simple,draft": "auto, n-gram + draft model",
             "draft": "draft model, k = 3"}


def rpc(data) -> list[str]:
    """Per delay: target-only speed, and each configuration's speed and speedup (bench's medians)."""
    configs = [c for c in data["results"][0]["rows"] if c != "target only"]
    lines = header("D (each way)", "target only", *(RPC_NAMES.get(c, c) for c in configs))
    for result in data["results"]:
        rows = result["rows"]
        lines.append(row(f"{result['delay_ms']:g} ms", f"{rows['target only']['median_tps']:.1f} t/s",
                         *(f"{rows[c]['median_tps']:.1f} t/s ({rows[c]['median_speedup']:.2f}x)" for c in configs)))
    return lines


def pool(data) -> list[str]:
    ways = data["ways"]
    names = list(ways)
    tokens = ways[names[0]]["tokens"]
    lines = header("way", f"target passes for {tokens:,} tokens", "tokens per pass", "pool steps", "decode t/s",
                   "vs no pool")
    for i, name in enumerate(names):
        w, base = ways[name], ways[names[i | 1]]
        lines.append(row(name, f"{w['passes']:,}", f"{w['tokens_per_pass']:.2f}", w["pool_steps"],
                         f"{w['decode_tps']:.2f}", f"{w['decode_tps'] / base['decode_tps']:.2f}x"))
    return lines


def cache_ram(data) -> list[str]:
    budget = data["meta"]["cache_ram"]
    lines = [row("turn", "prompt tokens", "`cache_n`, `--cache-ram 0`", "`prompt_ms`",
                 f"`cache_n`, `--cache-ram {budget}`", "`prompt_ms`", "answer"),
             "|---|---:|---:|---:|---:|---:|---|"]
    for p, c in zip(data["plain"], data["cached"]):
        lines.append(row(f"{c['conversation']}{c['turn']}", c["prompt_tokens"], p["cache_n"], f"{p['prompt_ms']:,.0f}",
                         c["cache_n"], f"{c['prompt_ms']:,.0f}", "same" if p["text"] == c["text"] else "DIFFERENT"))
    return lines


def prompt_cache(data) -> list[str]:
    lines = header("run", "prompt tokens", "from the cache", "prompt processing", "decoding")
    for label, r in data["runs"].items():
        name = label.split(". ", 1)[1]
        if "saves" in name:
            name += f" ({data['cache_bytes'] / 2**20:.1f} MiB, written in {r['t_save_s']:.2f} s)"
        seconds = r["t_encode_s"] + r["t_restore_s"]
        restore = f" (restore {r['t_restore_s']:.2f} s)" if r["n_restored"] else ""
        lines.append(row(f"question {name}", f"{r['n_prompt']:,}", f"{r['n_restored']:,}", f"{seconds:.2f} s{restore}",
                         f"{r['decode_tps']:.2f} t/s"))
    return lines


def fim(data) -> list[str]:
    """auto against target-only through /infill: speed, tokens per pass, identity."""
    results, n = data["results"], data["meta"]["n_predict"]
    full = [r for r in results if r["auto"]["timings"]["predicted_n"] == n]

    def speedup(r) -> float:
        return r["auto"]["timings"]["predicted_per_second"] / r["none"]["timings"]["predicted_per_second"]

    alone = median(r["none"]["timings"]["predicted_per_second"] for r in full)
    auto = median(r["auto"]["timings"]["predicted_per_second"] for r in full)
    per_pass = [r["auto"]["timings"]["tokens_per_step"] for r in full]
    same = sum(r["none"]["tokens"] == r["auto"]["tokens"] for r in results)
    return [*header("", "`--spec-type none`", "`--spec-type auto`"),
            row(f"decode speed, median of the {len(full)} answers of {n} tokens", f"{alone:.1f} t/s", f"{auto:.1f} t/s"),
            row(f"speedup, median of those {len(full)} (worst, best)", "1.00x",
                f"{median(map(speedup, full)):.2f}x ({min(map(speedup, full)):.2f}x, {max(map(speedup, full)):.2f}x)"),
            row(f"speedup, median of all {len(results)} (worst)", "1.00x",
                f"{median(map(speedup, results)):.2f}x ({min(map(speedup, results)):.2f}x)"),
            row(f"tokens per target pass, median of the {len(full)} (best)", "1.00",
                f"{median(per_pass):.2f} ({max(per_pass):.2f})"),
            row("answers identical to `none`'s, token for token", "", f"{same} of {len(results)}")]


def builds(data) -> list[str]:
    """Decode speed of each build and mode, as ratios to the first build's target-only speed."""
    speeds = {(r["venv"], r["mode"]): median(r["decode_tps"]) for r in data["runs"]}
    venvs = list(dict.fromkeys(v for v, _ in speeds))
    base = speeds[(venvs[0], "target only")]
    names = {venvs[0]: f"stock (`{venvs[0]}`, {base:.2f} t/s target only)",
             **{venv: f"`{venv}`" for venv in venvs[1:]}}
    lines = header("build", "target only", "draft model")
    for venv in venvs:
        lines.append(row(names[venv], f"{speeds[(venv, 'target only')] / base:.2f}x",
                         f"{speeds[(venv, 'draft model')] / base:.2f}x"))
    return lines


def state_sizes(data) -> list[str]:
    lines = header("model", "saved state per token")
    for r in data["rows"]:
        lines.append(row(f"`{r['name']}`", f"{r['kib_per_token']:.1f} KiB"))
    return lines


def doctor(data) -> list[str]:
    """Per build and settings: from which batch size positions score differently, at each depth."""
    reports = data["reports"]
    depths = sorted({c["cached"] for r in reports for c in r["report"]["checks"]})
    lines = header("build and settings", *(f"after {d} cached tokens" for d in depths), "largest difference")
    for r in reports:
        checks = r["report"]["checks"]
        cells = []
        for depth in depths:
            differ = [c["batch"] for c in checks if c["cached"] == depth and c["max_abs_diff"]]
            cells.append(f"differs from batch {min(differ)} ({len(differ)} of "
                         f"{sum(c['cached'] == depth for c in checks)} sizes)" if differ else "bit-identical")
        largest = max(c["max_abs_diff"] for c in checks)
        settings = " ".join([*(f"{k}={v}" for k, v in r["env"].items()), *r["flags"]])
        lines.append(row(f"{r['label']} (`{r['venv']}`, `{settings}`)", *cells,
                         f"{largest:.2f} logits" if largest else "0"))
    return lines


def flash_attn(data) -> list[str]:
    lines = header("prompt", "decode t/s, -fa off", "-fa on", "on / off", "prompt t/s, -fa off", "-fa on", "on / off")
    for name in ("short", "long"):
        s = data["summary"][name]
        lines.append(row(f"{s['n_prompt']:,} tokens", f"{s['decode_tps_off']:.1f}", f"{s['decode_tps_on']:.1f}",
                         f"{s['decode_ratio']:.2f}x", f"{s['encode_tps_off']:.1f}", f"{s['encode_tps_on']:.1f}",
                         f"{s['encode_ratio']:.2f}x"))
    return lines


def mtp_costs(data) -> list[str]:
    """What the NextN layers cost when loaded, and a head step against a target pass."""
    lines = header("tiny Qwen3.5", "file (NextN share)", "load without / with NextN", "memory: NextN layers / head context",
                   "hidden rows per token", "target pass", "head step", "head / target", "catch-up per entry (16)")
    for m in data["models"]:
        load, c = m["load"], m["costs"]
        lines.append(row(f"n_embd {m['n_embd']}, {m['n_layer']} layers",
                         f"{m['file_bytes'] / 2**20:.0f} MiB ({100 * m['nextn_share']:.1f}%)",
                         f"{load['plain']['load_s']:.3f} / {load['nextn']['load_s']:.3f} s",
                         f"{m['rss_difference_mib']:.0f} / {load['nextn']['head_rss_growth_mib']:.0f} MiB",
                         f"{load['nextn']['row_bytes_per_token'] / 1024:g} KiB",
                         f"{c['target_pass_ms']:.3f} ms", f"{c['head_step_ms']:.3f} ms", f"{c['head_vs_target']:.2f}x",
                         f"{c['head_catch_up_ms_per_entry']:.3f} ms"))
    return lines


def mtp_runs(data) -> list[str]:
    """draft-mtp and auto on the tiny models, against target-only in the same round."""
    lines = header("tiny Qwen3.5", "--spec-type", "speed vs none (range)", "accepted", "steps drafted by the head",
                   "identical to none")
    for m in data["models"]:
        for spec in ("draft-mtp", "auto"):
            s = m["cli"]["summary"][spec]
            steps = s["mtp_steps"]
            lines.append(row(f"n_embd {m['n_embd']}, {m['n_layer']} layers", f"`{spec}`",
                             f"{s['ratio_median']:.2f}x ({s['ratio_min']:.2f}x-{s['ratio_max']:.2f}x)",
                             f"{100 * s['accept_rate']:.0f}%", f"{min(steps)}-{max(steps)}" if min(steps) != max(steps)
                             else str(steps[0]), "yes" if s["identical"] else "no"))
    return lines


def replay(data) -> list[str]:
    """scripts/replay_auto.py's per-category figures: how much of the n-gram bound auto gets, measured
    in the bench file and replayed, against the best fixed-length policy per kind of proposal in
    hindsight, and how often a proposal that starts right runs on."""
    lines = header("category", "n-gram bound", "auto, in the bench (modelled)", "auto, replayed",
                   "best class policy per prompt, in hindsight", "one class policy for the category",
                   "right first tokens running on to 4 / 8")

    def cell(value: float, bound: float) -> str:
        return f"{value:.2f}x ({100 * (value - 1) / (bound - 1):.0f}%)" if bound > 1 else f"{value:.2f}x"

    for c in data["categories"]:
        bound, auto = c["bound"], c["auto"]["auto"]
        cont = c["continuation"]
        lines.append(row(c["category"], f"{bound:.2f}x", cell(auto["in_file"], bound), cell(auto["replayed"], bound),
                         cell(c["policy_per_prompt"], bound), cell(c["policy"]["speedup"], bound),
                         f"{100 * cont['share_4']:.0f}% / {100 * cont['share_8']:.0f}%"))
    return lines


def parallel(data) -> list[str]:
    """The parallel scenario's table: per configuration, throughput (median, min-max), its ratio to
    batch -np 1 none, latency, memory, answers unlike -np 1's and the largest margin where they part."""
    lines = header("config", "N", "tokens/s, median (min-max)", "vs batch -np 1 none",
                   "ceiling: N tokens in one batch vs N decodes", "p50 s", "p95 s",
                   "peak RSS MiB", "KV MiB", f"answers unlike -np 1's (of {len(data['meta']['requests'])})",
                   "largest top-2 margin where they part")
    for r in data["rows"]:
        lines.append(row(f"`{r['config']}`", r["n"], f"{r['throughput']:.2f} ({r['min']:.2f}-{r['max']:.2f})",
                         f"{r['ratio']:.2f}x" if r["ratio"] else "-", opt(r.get("ceiling"), ".2f") + "x"
                         if r.get("ceiling") else "-", f"{r['p50_s']:.1f}", f"{r['p95_s']:.1f}",
                         opt(r["rss_mib"], ".0f"), opt(r["kv_mib"], ".0f"), opt(r["differ"], "d"),
                         opt(r.get("largest_margin"), ".2f")))
    return lines


def prefill_gap(data) -> list[str]:
    """The prefill-gap scenario's table: a running stream's largest gap while a long prompt goes in,
    per --prefill-budget, against 2 x its normal step + the budget."""
    lines = header("--prefill-budget", "stream's normal step", "the prompt's prefill", "stream's pieces meanwhile",
                   "stream's largest gap", "bound: 2 x step + budget")
    for r in data["runs"]:
        bound = f"{r['bound_ms']:.0f} ms ({'within' if r['within'] else 'over'})" if r["budget_ms"] else "none"
        lines.append(row(f"{r['budget_ms']:.0f} ms" if r["budget_ms"] else "0 (whole -b chunks)",
                         f"{r['normal_step_ms']:.0f} ms", f"{r['prefill_s']:.1f} s", r["a_pieces_during"],
                         f"{r['max_gap_ms']:.0f} ms", bound))
    return lines


def structured(data) -> list[str]:
    """The structured scenario's table: per request set, decoding and configuration, speed, speedup over
    constrained target-only, the answer's shares of forced tokens of kind (a) and (b), the grammar's
    own cost, valid JSON and identity with constrained target-only."""
    lines = header("set", "decoding", "config", "runs", "tokens", "mean t/s", "vs constrained target-only",
                   "kind (a)", "kind (b) accepted (drafted)", "grammar ms/token", "valid JSON",
                   "same text as constrained target-only")
    for r in data["summary"]:
        lines.append(row(r["set"], r["mode"], r["config"], r["runs"], f"{r['tokens']:.0f}", opt(r["mean_tps"], ".2f"),
                         opt(r["speedup"], ".2f", "x"), f"{100 * r['kind_a_share']:.1f}%",
                         f"{100 * r['kind_b_share']:.1f}% ({r['kind_b_accepted']:.0f}/{r['kind_b_drafted']:.0f})",
                         f"{r['grammar_ms_per_token']:.3f}", fraction(r["json_ok"], r["constrained"]),
                         fraction(r["same_as_reference"], r["compared"])))
    return lines


def structured_costs(data) -> list[str]:
    """The structured scenario's second table: what the constraint alone costs a token, per rule."""
    lines = header("set", "decoding", "ms/token unconstrained", "ms/token constrained", "constraint's cost",
                   "grammar ms/token", "grammar share of decode")
    for c in data["costs"]:
        lines.append(row(c["set"], c["rule"], f"{c['ms_per_token_unconstrained']:.2f}",
                         f"{c['ms_per_token_constrained']:.2f}", f"{100 * c['cost']:+.1f}%",
                         f"{c['grammar_ms_per_token']:.3f}", f"{100 * c['grammar_share']:.1f}%"))
    return lines


def structured_steps(data) -> list[str]:
    """The structured scenario's runs of target-only decoding, speculate's and llama-server's, counted
    alike: each tool's own t/s, and its one-token decodes per second. speculate's t/s is the
    answer's tokens over every step after the prompt batch (the first decodes the prompt's last
    token, the last yields the end token, not counted); llama-server's is its decodes after the
    first token (which its prompt batch yields) per second, predicted_n - 1 over predicted_ms.
    The ratio is the median of each request's decodes per second, llama-server's over speculate's."""
    mine = {(r["request"], r["config"]): r for r in data["runs"] if r["mode"] == "greedy"}
    lines = header("set", "decoding", "speculate t/s", "llama-server t/s", "ratio of t/s",
                   "speculate decodes/s", "llama-server decodes/s", "ratio of decodes/s (median of requests)")
    for set_name in dict.fromkeys(r["set"] for r in data["runs"]):
        for ours, theirs in (("constrained target-only", "llama-server constrained"),
                             ("unconstrained target-only", "llama-server unconstrained")):
            pairs = [(mine[(r["request"], ours)], r) for r in data["llama_server"]
                     if r["set"] == set_name and r["config"] == theirs and (r["request"], ours) in mine]
            if not pairs:
                continue
            tps = [statistics.mean(r["tps"] for r in side) for side in zip(*pairs)]
            steps = [sum(r["steps"] for r, _ in pairs) / sum(r["decode_s"] for r, _ in pairs),
                     sum(r["tokens"] - 1 for _, r in pairs) / sum(r["decode_s"] for _, r in pairs)]
            ratio = statistics.median((t["tokens"] - 1) / t["decode_s"] / (s["steps"] / s["decode_s"]) for s, t in pairs)
            lines.append(row(set_name, ours.split()[0], f"{tps[0]:.2f}", f"{tps[1]:.2f}", f"{tps[1] / tps[0]:.3f}x",
                             f"{steps[0]:.2f}", f"{steps[1]:.2f}", f"{ratio:.3f}x"))
    return lines


def kv(data) -> list[str]:
    """The kv scenario's table: per KV cache type, the models' KV bytes (and the target's against f16's),
    llama.cpp's own figure, flash attention, how many target-only answers changed against f16's,
    the prompts timed (an empty answer is not), target-only speed, auto's speedup and the answers
    where auto parts from target-only."""
    f16 = next((r["target_kv_bytes"] for r in data["rows"] if r["type"] == "f16"), None)
    lines = header("KV cache (-ctk, -ctv)", "target KV", "of f16's", "draft KV (f16)", "llama.cpp's log",
                   "flash attention", "target-only answers unlike f16's", "prompts timed", "target-only t/s",
                   "auto t/s", "auto's speedup (worst prompt)", "auto's answers unlike target-only (largest top-2 margin)")
    for r in data["rows"]:
        mib = r["target_kv_bytes"] / 2**20
        lines.append(row(r["type"], f"{mib:.1f} MiB", opt(r["target_kv_bytes"] / f16 if f16 else None, ".0%"),
                         f"{r['draft_kv_bytes'] / 2**20:.1f} MiB",
                         " + ".join(f"{b / 2**20:.1f}" for b in r["logged_kv_bytes"]) + " MiB",
                         "on" if r["flash_attn"] else "off", f"{r['unlike_first']} of {r['prompts']}",
                         f"{r['timed']} of {r['prompts']}", f"{r['none_tps']:.2f}", f"{r['auto_tps']:.2f}",
                         f"{r['auto_speedup']:.2f}x ({r['auto_min_speedup']:.2f}x)",
                         f"{r['mismatches']}" + (f" ({max(r['margins']):.2f})" if r["margins"] else "")))
    return lines


def peer_tests(data) -> list[str]:
    """llama.cpp's server tests per file: passed, failed and skipped on each server."""
    runs = data["runs"]
    lines = header("file", *(f"{r['server']} passed / failed / skipped" for r in runs))
    files = list(dict.fromkeys(f for r in runs for f in r["files"]))
    totals = [[0, 0, 0] for _ in runs]

    def count(run, file) -> list[int]:
        outcomes = [t["outcome"] for t in run["files"].get(file, {"tests": {}})["tests"].values()]
        return [outcomes.count("passed"), outcomes.count("failed") + outcomes.count("error"), outcomes.count("skipped")]

    for file in files:
        cells = [count(r, file) for r in runs]
        for total, c in zip(totals, cells):
            total[:] = [a + b for a, b in zip(total, c)]
        lines.append(row(f"`{file.split('/')[-1]}`", *(" / ".join(map(str, c)) for c in cells)))
    lines.append(row("all", *(" / ".join(map(str, t)) for t in totals)))
    return lines


def conversation(data, unit: str = "conversation") -> list[str]:
    """The conversation scenario's table: per turn of each conversation, the first configuration's tokens,
    each configuration's decode speed (tokens over decode seconds, summed over the repeats) and the
    ratios of speeds; then the edit turns and all turns together (aggregate speeds), and how many
    answers are their tool's without speculation, word for word. The agent scenario's table (`agent`)
    is the same, a row per turn of each session."""
    configs, labels = data["configs"], list(data["summary"][0]["ratios"])
    lines = header(unit, "turn", "kind", f"tokens ({configs[0]})", *(f"{c} t/s" for c in configs), *labels)
    for r in [*data["rows"], *data["summary"]]:
        lines.append(row(r["conversation"], r["turn"], r["kind"], f"{r['tokens']:.0f}",
                         *(opt(r["configs"][c]["tps"], ".2f") for c in configs),
                         *(opt(r["ratios"][label], ".2f", "x") for label in labels)))
    every = data["summary"][-1]["configs"]
    lines.append(row("answers identical to the same tool's without speculation", "", "", "",
                     *(fraction(every[c]["identical"], every[c]["compared"]) for c in configs), *[""] * len(labels)))
    return lines


DROPPED = (("exchanges dropped (context full)", lambda t: t["dropped"]),)


def conversation_totals(data, last=DROPPED) -> list[str]:
    """The conversation scenario's second table: each configuration's turns summed (all conversations and
    repeats): decoding, the prompt tokens processed and kept from the turn before, drafting, tokens
    per target pass, answers cut at -n; then the `last` columns ((header, cell of a total) each): by
    default the exchanges speculate dropped to fit the context."""
    lines = header("config", "turns", "tokens", "decode s", "t/s", "prompt tokens processed",
                   "kept from the turn before", "accepted / drafted", "tokens per pass", "answers cut at -n",
                   *(name for name, _ in last))
    for t in data["totals"]:
        lines.append(row(f"`{t['config']}`", t["turns"], f"{t['tokens']:,}", f"{t['seconds']:.1f}",
                         opt(t["tps"], ".2f"), f"{t['prompt_processed']:,}", f"{t['prompt_kept']:,}",
                         f"{t['accepted']:,} / {t['drafted']:,}", opt(t["tokens_per_pass"], ".2f"), t["cut"],
                         *(cell(t) for _, cell in last)))
    return lines


def agent(data) -> list[str]:
    """The agent scenario's table: conversation's, per turn of each agent session (its timed turns: the
    rewrite turns)."""
    return conversation(data, "session")


def agent_totals(data) -> list[str]:
    """The agent scenario's second table: conversation_totals' columns, then the tool calls that were
    the one their turn asked for (that tool, the session's file, JSON arguments with a string
    `content` for write_file), the lines of the file the rewrites kept (of the lines it had before
    each), and the sessions that ended before their last turn (at a call that was not: the agent
    had no file to go on from)."""
    return conversation_totals(data, (
        ("calls as asked", lambda t: f"{t['calls_ok']}/{t['turns']}"),
        ("file lines the rewrites kept", lambda t: f"{t['lines_kept']:,}/{t['lines_before']:,}"),
        ("sessions ended early", lambda t: f"{t['ended_early']}/{t['sessions']}")))


def commits(data) -> list[str]:
    """The commits scenario's table: per configuration each commit's median tokens/s (min-max), the
    last commit's over the first's, and the time outside llama_decode per token; then per spec type
    -np N's gain over -np 1 for each commit, and the ceiling at N."""
    labels = data["meta"]["commits"]
    lines = header("config", *(f"{c} tokens/s" for c in labels), f"{labels[-1]} / {labels[0]}",
                   "outside llama_decode, ms/token (" + " / ".join(labels) + ")")
    rows = {(r["config"], r["commit"]): r for r in data["rows"]}
    for config in dict.fromkeys(r["config"] for r in data["rows"]):
        mine = [rows[(config, c)] for c in labels]
        lines.append(row(f"`{config}`", *(f"{r['tps']:.2f} ({r['min']:.2f}-{r['max']:.2f})" for r in mine),
                         opt(mine[-1]["ratio"], ".2f", "x"),
                         " / ".join(f"{r['outside_llama_decode_ms']:.2f}" for r in mine)))
    gains = {(g["spec"], g["n"], g["commit"]): g for g in data["gains"]}
    for spec, n in dict.fromkeys((g["spec"], g["n"]) for g in data["gains"]):
        mine = [gains[(spec, n, c)] for c in labels]
        at = mine[0]["ceiling"]
        gains_of = [f"{g['gain']:.2f}x" + (f" ({g['of_ceiling']:.0%} of the ceiling)" if g["of_ceiling"] else "")
                    for g in mine]
        lines.append(row(f"`-np {n}` over `-np 1`, `{spec}`", *gains_of, "-", f"ceiling at {n}: {opt(at, '.2f', 'x')}"))
    return lines


CONVERSATION_RUN = ("python -m scripts.bench conversation --llama-server LLAMA_SERVER "
                    "-o docs/results/conversation.json.gz (the stock build)")

AGENT_RUN = ("python -m scripts.bench agent --speculate .venv/bin/speculate --llama-server LLAMA_SERVER "
             "--calls grammar -o docs/results/agent.json.gz (the stock build)")

TABLES = {t.name: t for t in [
    Table("recurrent", ("recurrent.json",), "python -m scripts.bench recurrent -o docs/results/recurrent.json",
          recurrent),
    Table("pool", ("pool.json",),
          "python -m scripts.bench pool -o /tmp/pool && cp /tmp/pool/report.json docs/results/pool.json", pool),
    Table("cache-ram", ("cache-ram.json",), "python -m scripts.bench cache-ram -o docs/results/cache-ram.json",
          cache_ram),
    Table("prompt-cache", ("prompt-cache.json",),
          "python -m scripts.bench prompt-cache -o docs/results/prompt-cache.json", prompt_cache),
    Table("fim", ("fim.json.gz",), "python -m scripts.bench fim -o docs/results/fim.json.gz", fim),
    Table("state-sizes", ("state-sizes.json",), "python -m scripts.bench state-sizes -o docs/results/state-sizes.json",
          state_sizes),
    Table("doctor", ("doctor.json",), "python -m scripts.bench doctor -o docs/results/doctor.json", doctor),
    Table("flash-attn", ("flash-attn.json",), "python -m scripts.bench flash-attn -o docs/results/flash-attn.json",
          flash_attn),
    Table("mtp-costs", ("mtp.json",), "python -m scripts.bench mtp -o docs/results/mtp.json", mtp_costs),
    Table("mtp-runs", ("mtp.json",), "python -m scripts.bench mtp -o docs/results/mtp.json", mtp_runs),
    Table("measured", ("bench-dev.json.gz",),
          "GGML_CPU_TILED_MM=0 speculate bench scripts/prompts.jsonl -C auto -C ngram-simple -C draft "
          "--sweep draft-max=3,8 -o bench-dev.json (then gzip)", measured),
    Table("replay", ("replay.json",),
          "python scripts/replay_auto.py docs/results/bench-dev.json.gz --json docs/results/replay.json", replay),
    Table("sampled", ("bench-sampled.json.gz",),
          "speculate bench scripts/prompts.jsonl -C draft --sweep accept=rejection,match --temp 0.7 -s 1 -n 64 "
          "-o bench-sampled.json (then gzip; the stock build)", sampled),
    Table("rpc", ("rpc.json",), "python -m scripts.bench rpc -n 48 --delays 0,20 -o docs/results/rpc.json", rpc),
    Table("rpc-100ms", ("rpc-100ms.json",),
          "python -m scripts.bench rpc -n 48 --delays 100 --category complete --limit 3 -C auto,ngram-simple "
          "-C auto,ngram-simple,draft -C draft -o docs/results/rpc-100ms.json", rpc),
    Table("prefill-gap", ("prefill-gap.json",),
          "python -m scripts.bench prefill-gap -o docs/results/prefill-gap.json (the stock build)", prefill_gap),
    Table("parallel", ("parallel.json.gz",),
          "python -m scripts.bench parallel -o docs/results/parallel.json.gz (the stock build)",
          parallel),
    Table("scheduler", ("scheduler.json.gz",),
          "python -m scripts.bench commits f0de9b4 HEAD -o docs/results/scheduler.json.gz (HEAD: the scheduler's "
          "tree; nothing else running)", commits),
    Table("structured", ("structured.json.gz",),
          "python -m scripts.bench structured -o docs/results/structured.json.gz (the stock build)",
          structured),
    Table("structured-costs", ("structured.json.gz",),
          "python -m scripts.bench structured -o docs/results/structured.json.gz (the stock build)",
          structured_costs),
    Table("structured-steps", ("structured.json.gz",),
          "python -m scripts.bench structured -o docs/results/structured.json.gz (the stock build)",
          structured_steps),
    Table("kv", ("kv.json.gz",), "python -m scripts.bench kv -o docs/results/kv.json.gz (the stock build)", kv),
    Table("builds", ("builds.json",),
          "python -m scripts.bench builds .venv .venv-test --env-b GGML_CPU_TILED_MM=0 -o docs/results/builds.json",
          builds),
    Table("conversation", ("conversation.json.gz",), CONVERSATION_RUN, conversation),
    Table("conversation-totals", ("conversation.json.gz",), CONVERSATION_RUN, conversation_totals),
    Table("agent", ("agent.json.gz",), AGENT_RUN, agent),
    Table("agent-totals", ("agent.json.gz",), AGENT_RUN, agent_totals),
    Table("peer-tests", ("peer-tests.json",),
          "python scripts/peer_tests.py compare OUT/llama-server OUT/speculate --json docs/results/peer-tests.json "
          "(after the run below)", peer_tests),
    Table("builds-switches", ("builds-switches.json",),
          "python -m scripts.bench builds .venv .venv --env-b GGML_CPU_TILED_MM=0 --flag-b=-nr "
          "-o docs/results/builds-switches.json", builds),
]}

def render(name: str) -> list[str]:
    table = TABLES[name]
    return table.render(*(load(f) for f in table.files))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"tables to print (default: all): {', '.join(TABLES)}")
    parser.add_argument("--list", action="store_true", help="name, files and command of each table")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in TABLES]
    if unknown:
        parser.error(f"unknown table {', '.join(unknown)} (known: {', '.join(TABLES)})")
    if args.list:
        for table in TABLES.values():
            print(f"{table.name}: docs/results/{', docs/results/'.join(table.files)}  ({table.command})")
        return 0
    for name in args.names or TABLES:
        table = TABLES[name]
        print(f"<!-- table {name} -->  {table.command}")
        print("\n".join(render(name)))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
