#!/usr/bin/env python3
"""How close auto comes to the n-gram bound, and why it cannot reach it: replays over a bench file.

    scripts/replay_auto.py BENCH.json[.gz] [--category CAT ...] [--prompt ID ...] [--pool-tokens N]
                           [--json OUT]

Offline and in seconds: a `speculate bench` file holds every input (each prompt's tokens in
`meta.prompt_tokens`, the calibrated verify costs of 1..17 tokens in `meta.costs.target`, each
run's output and plan). For each prompt chosen (default: all), over its target-only output:

1. the n-gram bound (bench.ngram_bound, checked against the file's) and the bound's plan: where
   it drafts and how many tokens;
2. auto replayed: speculative's own Auto driven by the real loop over a target that replays the
   output (scripts/replay.py) at the calibrated costs, so its timing corrections see those
   costs; with the drafters the bench gave it (ngram-simple, the pool of the earlier prompts'
   outputs, the draft model, which it must decline: no model here), compared with the file's
   auto runs (their plans and modelled speedups);
3. the best class policy in hindsight: a fixed draft length per kind of proposal (auto's match
   class, and how long the copy has run), per prompt and per category, as a share of the
   bound's gain over 1.0;
4. continuation statistics: of the proposals whose first token was right, the share whose match
   ran on to 4 and to 8 tokens.

The bound and the policies see ngram-simple's proposal at every position of the output, asked
position after position as bench.ngram_bound asks it; a policy's run at a position is how many
output tokens right before it those proposals predicted in a row (their first token right,
drafted or not: auto scores every proposal so). Their speedups count target-only decoding as
ngram_bound does (a pass per output token); auto's modelled speedup as bench does (one more
pass for an end-of-generation token), so the replayed figure compares with the file's.

Plain text on stdout (docs/benchmarks.md quotes it), the same figures as JSON with --json. Exit 2 for a
file that is not a bench file with the replay's inputs, or a selection that matches nothing.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench.harness import meta  # noqa: E402
from speculative.decoding.backend import Work  # noqa: E402
from speculative.decoding.drafter import LONG, MEDIUM, RESUMED, SHORT, Draft, Drafter  # noqa: E402
from speculative.decoding.events import Step, Token  # noqa: E402
from speculative.decoding.settings import POOL_TOKENS  # noqa: E402
from speculative.decoding.settings import DRAFT_MAX_AUTO, NGRAM_N_AUTO, SpecSettings  # noqa: E402
from speculative.decoding.stats import Stats  # noqa: E402
from speculative.drafters import NgramMapK, NgramSimple  # noqa: E402
from speculative.drafters.auto import Auto  # noqa: E402
from speculative.drafters.pool import Pool, PoolDrafter  # noqa: E402
from scripts.replay import replay  # noqa: E402
from speculative.engine import bench  # noqa: E402

RUN_BUCKETS = ((0, 0), (1, 3), (4, 7), (8, None))  # how long the copy has run: 0, 1-3, 4-7, 8+
CLASSES = (SHORT, MEDIUM, LONG, RESUMED)  # ngram-simple's match classes (drafters/ngram.py, match_class)
CLASS_NAMES = {SHORT: "short", MEDIUM: "medium", LONG: "long", RESUMED: "resumed"}
LENGTHS = range(DRAFT_MAX_AUTO + 1)  # a policy's draft lengths, k = 0 (plain decoding) included
EXHAUSTIVE_MAX = 5000  # policies tried one by one up to this many; beyond, coordinate descent
DESCENT_STARTS = (0, 1, 2, 4, 8, 16)  # coordinate descent starts from each uniform k of these
RUN_ON = (4, 8)  # continuation statistics: matches running on to at least this many tokens


class ReplayError(Exception):
    """A bench file the replay cannot use: one line, exit 2."""


# -- the bench file --------------------------------------------------------------------------


@dataclass
class Prompt:
    id: str
    category: str
    tokens: list[int]
    output: list[int]           # the target-only output
    stopped: bool               # it ended on an end-of-generation token (before -n)
    runs: list[dict]            # every run of the prompt, in the file's order
    differing: list[str]        # runs whose output is not the target-only output


class BenchFile:
    def __init__(self, path: Path):
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise ReplayError(f"{path}: cannot read it ({e.strerror or e})") from None
        try:
            data = json.loads(gzip.decompress(raw) if path.name.endswith(".gz") else raw)
        except (OSError, EOFError, ValueError, RecursionError) as e:  # (gzip.BadGzipFile is an OSError)
            raise ReplayError(f"{path}: not JSON{' (gzipped)' if path.name.endswith('.gz') else ''} ({e})") from None
        meta = data.get("meta") if isinstance(data, dict) else None
        if not isinstance(meta, dict) or not isinstance(data.get("runs"), list):
            raise ReplayError(f"{path}: not a speculate bench file (no meta and runs)")
        if "costs" not in meta or "prompt_tokens" not in meta:
            raise ReplayError(f"{path}: no meta.costs or meta.prompt_tokens (written by a bench from before "
                              "the replay's inputs were kept): run the benchmark again")
        if meta.get("settings", {}).get("temp", 0.0) != 0.0:
            raise ReplayError(f"{path}: sampled runs (--temp {meta['settings']['temp']}): the replay is of greedy output")
        self.path = path
        self.meta = meta
        self.runs: list[dict] = data["runs"]
        try:
            self.verify: list[float] = [float(c) for c in meta["costs"]["target"]]
            self.n_predict = int(meta["settings"]["n_predict"])
            tokens = [[int(t) for t in ts] for ts in (*meta["prompt_tokens"].values(), *(r["tokens"] for r in self.runs))]
            for r in self.runs:
                str(r["prompt"]), str(r["category"]), str(r["config"]), int(r["repeat"]), float(r["modelled_speedup"])
                [(str(p["drafter"]), int(p["k"]), int(p["steps"])) for p in r["plans"]]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ReplayError(f"{path}: a bench file without a field the replay reads ({type(e).__name__}: {e})") from None
        if len(self.verify) < 2:
            raise ReplayError(f"{path}: meta.costs.target holds {len(self.verify)} costs: the replay needs v(1) and more")
        self.order = list(dict.fromkeys(r["prompt"] for r in self.runs))  # the order bench ran them in
        # An end-of-generation token no drafter can propose: one past every token in the file.
        self.eog = 1 + max((t for ts in tokens for t in ts), default=0)

    def prompt(self, pid: str) -> Prompt:
        runs = [r for r in self.runs if r["prompt"] == pid]
        alone = [r for r in runs if r["config"] == bench.BASELINE]
        if not alone or pid not in self.meta["prompt_tokens"]:
            raise ReplayError(f"{self.path}: prompt {pid} has no target-only run or no tokens in meta")
        output = alone[0]["tokens"]
        differing = [f"{r['config']} (repeat {r['repeat']})" for r in runs if r["tokens"] != output]
        return Prompt(pid, runs[0]["category"], self.meta["prompt_tokens"][pid], output,
                      len(output) < self.n_predict, runs, differing)

    def pool_before(self, pid: str, max_tokens: int) -> Pool | None:
        """The pool as bench had it for this prompt's runs: the earlier prompts' target-only
        outputs (bench adds each prompt's last target-only run after all its runs)."""
        if max_tokens <= 0:
            return None
        pool = Pool(max_tokens=max_tokens)
        for earlier in self.order[: self.order.index(pid)]:
            alone = [r for r in self.runs if r["prompt"] == earlier and r["config"] == bench.BASELINE]
            pool.add(alone[-1]["tokens"])
        return pool

    def auto_configs(self) -> list[str]:
        return [c for c in dict.fromkeys(r["config"] for r in self.runs) if "auto" in c.split(" ")[0].split(",")]

    def costs(self, role: str, max_batch: int) -> list[float]:
        """Engine.costs from the file (what bench.modelled_speedup asks of an engine)."""
        return [float(c) for c in self.meta["costs"][role][:max_batch]]


# -- 1. the bound and its plan --------------------------------------------------------------


@dataclass
class Position:
    """ngram-simple's proposal at one output position, as the bound (and auto's scoring) sees it."""
    length: int    # tokens proposed (0: no proposal)
    kind: int      # its match class
    match: int     # how many of them the output goes on with
    run: int       # output tokens right before it that the proposals there predicted, in a row


def positions(output: list[int], drafts: list[Draft]) -> list[Position]:
    """What the bound and the policies know of each position, from ngram-simple's proposals there."""
    out, run = [], 0
    for i, draft in enumerate(drafts):
        match = next((j for j, t in enumerate(draft.tokens) if i + j >= len(output) or t != output[i + j]),
                     len(draft.tokens))
        out.append(Position(len(draft.tokens), draft.kind, match, run))
        run = run + 1 if match else 0
    return out


def walk(output_length: int, ks: Sequence[int], at: list[Position]) -> list[tuple[int, int, int]]:
    """The steps (position, k, accepted) of drafting ks[i] tokens at each position a step starts
    at, capped as the bound caps them (the proposal's length, the output's last token a bonus)."""
    steps, i = [], 0
    while i < output_length:
        k = min(ks[i], at[i].length, output_length - i - 1)
        accepted = min(k, at[i].match)
        steps.append((i, k, accepted))
        i += accepted + 1
    return steps


def steps_time(steps: list[tuple[int, int, int]], verify: list[float]) -> float:
    return sum(verify[k] for _, k, _ in steps)


# -- 2. auto replayed -------------------------------------------------------------------------


class ModelNeeded(Exception):
    """Auto chose the draft model, which a replay without the model cannot follow."""


class DraftModelStandIn(Drafter):
    """The draft model bench loaded for auto: its calibrated cost lets auto decide whether it
    could ever pay (it declines it where it could not); its drafts are not known."""

    name = "draft"

    def propose(self, context: Sequence[int], k: int) -> Draft:
        raise ModelNeeded(len(context))


Seen = dict[str, tuple[int, int, float]]  # free drafter -> its proposal's length, kind, and auto's
                                           # cautious first-token estimate for that kind


class ObservedAuto(Auto):
    """Auto, noting what it saw at every step it planned (by the context's length then)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: dict[int, Seen] = {}

    def proposing(self, context: Sequence[int], k: int) -> Work[Draft]:
        draft = yield from super().proposing(context, k)  # planned: the estimates below are the ones it planned with
        self.seen[len(context)] = {name: (len(p.tokens), p.kind, float(self.estimates(name, p.kind).rates(cautious=True)[0]))
                                   for name, p in self._proposals.items() if p.tokens}
        return draft


def auto_spec(label: str, n_predict: int) -> SpecSettings:
    """The SpecSettings bench ran a configuration label with (bench.make_configs)."""
    types, *sweeps = label.split(" ")
    configs = bench.make_configs([types], bench.parse_sweeps(sweeps), SpecSettings(n_predict=n_predict))
    return next(c.spec for c in configs if c.label == label)


def auto_drafter(spec: SpecSettings, file: BenchFile, pool: Pool | None) -> ObservedAuto:
    """Auto as DrafterFactory.make (engine/factory.py) builds it for a bench run: ngram-simple, the pool where it
    holds anything, and the draft model where bench loaded one."""
    names = spec.drafters or ("ngram-simple", *(("ngram-pool",) if pool else ()),
                              *(("draft",) if file.meta.get("draft") else ()))
    drafters: list[Drafter] = []
    for name in names:
        if name in ("ngram-simple", "ngram-map-k"):
            ngram = spec.ngram_simple if name == "ngram-simple" else spec.ngram_map_k
            drafters.append((NgramSimple if name == "ngram-simple" else NgramMapK)(ngram.size(True), ngram.m,
                                                                                  ngram.min_hits))
        elif name == "ngram-pool" and pool is not None:
            drafters.append(PoolDrafter(pool))
        elif name == "draft" and "draft" in file.meta["costs"]:
            drafters.append(DraftModelStandIn())
        else:
            raise ReplayError(f"auto with {name}: the replay knows ngram-simple, ngram-map-k, ngram-pool "
                              "and (declined) the draft model only")
    k_max = spec.draft_max
    draft_costs = {"draft": file.costs("draft", 1)[0]} if "draft" in names else {}
    # Engine gives a draft model's catch-up cost from a batch of 16 too; the file keeps its cost
    # per token alone, and a replay that needs the catch-up cost (a model auto tries) stops anyway.
    return ObservedAuto(drafters, file.verify[: k_max + 1], k_max, draft_costs, dict(draft_costs))


@dataclass
class AutoReplay:
    config: str
    drafters: list[str]
    steps: list[tuple[int, str | None, int, int]] = field(default_factory=list)  # (position, drafter, k, accepted)
    seen: dict[int, Seen] = field(default_factory=dict)  # position -> what auto saw there
    plans: dict[tuple[str, int], int] = field(default_factory=dict)
    seconds: float = 0.0
    modelled: float = 0.0
    same_output: bool = True
    declined: dict[str, str] = field(default_factory=dict)
    stopped_at: int | None = None  # where auto chose the draft model (the replay ends there)


def replay_auto(prompt: Prompt, file: BenchFile, config: str, pool: Pool | None) -> AutoReplay:
    spec = auto_spec(config, file.n_predict)
    auto = auto_drafter(spec, file, pool)
    result = AutoReplay(config, [d.name for d in auto.drafters])
    try:
        events, result.seconds = replay(prompt.tokens, prompt.output, prompt.stopped, file.verify, spec, auto,
                                        file.eog)
    except ModelNeeded as e:
        result.stopped_at = e.args[0] - len(prompt.tokens)
        return result
    stats, emitted = Stats(), []
    for event in events:
        stats.add(event)
        if isinstance(event, Step):
            result.steps.append((len(emitted), event.drafter, event.n_drafted, event.n_accepted))
        elif isinstance(event, Token):
            emitted.append(event.id)
    result.same_output = emitted == prompt.output
    result.seen = {at - len(prompt.tokens): seen for at, seen in auto.seen.items()}
    result.plans = dict(stats.plans)
    result.modelled = bench.modelled_speedup(file, stats.plans, stats.n_predict + (stats.finish_reason == "stop"))
    result.declined = dict(auto.declined)
    return result


def plan_agreement(a: dict[tuple[str, int], int], b: dict[tuple[str, int], int]) -> float:
    """The share of steps two plans have in common, as (drafter, k) counts."""
    common = sum(min(n, b.get(key, 0)) for key, n in a.items())
    return common / max(sum(a.values()), sum(b.values()), 1)


def file_plans(run: dict) -> dict[tuple[str, int], int]:
    return {(p["drafter"], p["k"]): p["steps"] for p in run["plans"]}


# -- 3. class policies --------------------------------------------------------------------------


def bucket(run: int) -> int:
    return next(b for b, (low, high) in enumerate(RUN_BUCKETS) if run >= low and (high is None or run <= high))


def cell(p: Position) -> tuple[int, int]:
    return p.kind, bucket(p.run)


def policy_lengths(policy: dict[tuple[int, int], int], at: list[Position]) -> list[int]:
    return [policy.get(cell(p), 0) if p.length else 0 for p in at]


def policy_speedup(policy: dict[tuple[int, int], int], output_length: int, at: list[Position],
                   verify: list[float]) -> float:
    """A policy's speedup over target-only decoding, as ngram_bound counts it."""
    if not output_length:
        return 1.0
    return output_length * verify[0] / steps_time(walk(output_length, policy_lengths(policy, at), at), verify)


def cells_used(ats: list[list[Position]]) -> list[tuple[int, int]]:
    """The cells a policy's choice can matter in: positions with a proposal, not the last."""
    return sorted({cell(p) for at in ats for p in at[:-1] if p.length})


@dataclass
class PolicyResult:
    policy: dict[tuple[int, int], int]
    speedup: float   # a prompt's, or the median over the category's prompts
    search: str      # how it was found


def best_policy(prompts: list[tuple[int, list[Position]]], verify: list[float]) -> PolicyResult:
    """The policy maximising the median speedup over `prompts` ((output length, positions) each):
    every policy over the cells that occur where they are few, else coordinate descent from each
    uniform start in DESCENT_STARTS (the best found)."""
    cells = cells_used([at for _, at in prompts])

    def score(policy: dict) -> float:
        return statistics.median(policy_speedup(policy, n, at, verify) for n, at in prompts)

    if len(LENGTHS) ** len(cells) <= EXHAUSTIVE_MAX:
        best = max((dict(zip(cells, ks)) for ks in itertools.product(LENGTHS, repeat=len(cells))), key=score)
        return PolicyResult(best, score(best), f"exhaustive: {len(LENGTHS) ** len(cells)} policies "
                                               f"over the {len(cells)} kinds of proposal that occur")
    found = [descend({c: min(k, DRAFT_MAX_AUTO) for c in cells}, cells, score) for k in DESCENT_STARTS]
    best = max(found, key=lambda pv: pv[1])  # the first of equals: the earliest start
    return PolicyResult(best[0], best[1], f"coordinate descent over the {len(cells)} kinds of proposal that occur, "
                                          f"from k = {', '.join(map(str, DESCENT_STARTS))} everywhere: the best found")


def descend(policy: dict, cells: list, score) -> tuple[dict, float]:
    """Set one cell at a time to its best length, the others fixed, until none improves."""
    value = score(policy)
    improved = True
    while improved:
        improved = False
        for c in cells:
            for k in LENGTHS:
                trial = {**policy, c: k}
                trial_value = score(trial)
                if trial_value > value + 1e-12:
                    policy, value, improved = trial, trial_value, True
    return policy, value


def share(x: float | None, bound: float | None) -> float | None:
    """x's share of the bound's gain over target-only decoding."""
    if x is None or bound is None or bound <= 1.0:
        return None
    return (x - 1.0) / (bound - 1.0)


# -- 4. continuation ----------------------------------------------------------------------------


def continuation(ats: list[list[Position]]) -> dict:
    """Of the proposals whose first token was right, how many ran on to RUN_ON tokens (among those
    with that many output tokens left to run on over)."""
    out = {"first_right": sum(1 for at in ats for p in at if p.match)}
    for n in RUN_ON:
        room = [p for at in ats for i, p in enumerate(at) if p.match and len(at) - i >= n]
        out[f"ran_{n}"] = sum(p.match >= n for p in room)
        out[f"of_{n}"] = len(room)
        out[f"share_{n}"] = out[f"ran_{n}"] / len(room) if room else None
    return out


# -- putting it together ------------------------------------------------------------------------


@dataclass
class PromptReport:
    prompt: Prompt
    at: list[Position]
    bound: float
    bound_recorded: list[float]
    bound_steps: list[tuple[int, int, int]]
    autos: list[AutoReplay]
    policy: PolicyResult


def analyse(file: BenchFile, pid: str, pool_tokens: int) -> PromptReport:
    prompt = file.prompt(pid)
    drafts = bench.ngram_proposals(prompt.tokens, prompt.output, len(file.verify) - 1)
    at = positions(prompt.output, drafts)
    bound = bench.ngram_bound(prompt.tokens, prompt.output, file.verify)  # the function bench recorded it with
    _, choice = bench.bound_plan(prompt.output, [d.tokens for d in drafts], file.verify)
    recorded = [r["ngram_bound"] for r in prompt.runs if r["config"] == bench.BASELINE and r.get("ngram_bound")]
    pool = file.pool_before(pid, pool_tokens)
    autos = [replay_auto(prompt, file, config, pool) for config in file.auto_configs()]
    policy = best_policy([(len(prompt.output), at)], file.verify)
    return PromptReport(prompt, at, bound, recorded, walk(len(prompt.output), choice, at), autos, policy)


def category_rows(reports: list[PromptReport], file: BenchFile) -> list[dict]:
    groups: dict[str, list[PromptReport]] = {}
    for r in reports:
        groups.setdefault(r.prompt.category, []).append(r)
    if len(groups) > 1:
        groups["all"] = reports
    rows = []
    for category, group in groups.items():
        bound = statistics.median(r.bound for r in group)
        row = {"category": category, "prompts": [r.prompt.id for r in group], "bound": bound, "auto": {}}
        for config in file.auto_configs():
            replayed = [a.modelled for r in group for a in r.autos if a.config == config and a.stopped_at is None]
            in_file = [statistics.median(run["modelled_speedup"] for run in r.prompt.runs if run["config"] == config)
                       for r in group if any(run["config"] == config for run in r.prompt.runs)]
            row["auto"][config] = {"replayed": statistics.median(replayed) if replayed else None,
                                   "in_file": statistics.median(in_file) if in_file else None}
        row["policy_per_prompt"] = statistics.median(r.policy.speedup for r in group)
        row["policy"] = best_policy([(len(r.prompt.output), r.at) for r in group], file.verify)
        row["continuation"] = continuation([r.at for r in group])
        rows.append(row)
    return rows


# -- text ----------------------------------------------------------------------------------------


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def x(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def plan_text(plans: dict[tuple[str, int], int]) -> str:
    return ", ".join(f"{d}:{k} x{n}" for (d, k), n in sorted(plans.items()))


def policy_text(policy: dict[tuple[int, int], int], used: list[tuple[int, int]], indent: str) -> list[str]:
    """The policy as a table: a row per match class, a column per run bucket ('.': never occurs)."""
    head = "".join(f"{'run ' + (f'{lo}+' if hi is None else f'{lo}' if lo == hi else f'{lo}-{hi}'):>9}"
                   for lo, hi in RUN_BUCKETS)
    lines = [f"{indent}{'k by class':12}{head}"]
    for c in CLASSES:
        if any(u[0] == c for u in used):
            cells = "".join(f"{policy.get((c, b), 0) if (c, b) in used else '.':>9}" for b in range(len(RUN_BUCKETS)))
            lines.append(f"{indent}{f'{c} {CLASS_NAMES[c]}':12}{cells}")
    return lines


def step_rows(report: PromptReport, replayed: AutoReplay) -> list[str]:
    """One line per position where auto or the bound drafted."""
    bound_at = {i: (k, a) for i, k, a in report.bound_steps}
    auto_at = {i: (d, k, a) for i, d, k, a in replayed.steps}
    wanted = sorted({i for i, (k, _) in bound_at.items() if k} | {i for i, (_, k, _) in auto_at.items() if k})
    lines = [f"    {'pos':>4}  {'proposal (len class match run)':31}{'bound':13}auto"]
    for i in wanted:
        p = report.at[i]
        proposal = f"{p.length:3} {p.kind} {CLASS_NAMES[p.kind]:8}{p.match:3} {p.run:3}" if p.length else "none"
        bound = "-" if i not in bound_at else f"k={bound_at[i][0]} acc {bound_at[i][1]}"
        if i not in auto_at:
            auto = "- (inside a draft)"
        else:
            d, k, a = auto_at[i]
            seen = replayed.seen.get(i)
            auto = f"{d}:{k} acc {a}" if k else "k=0"
            if seen:
                name = d if k else ("ngram-simple" if "ngram-simple" in seen else next(iter(seen)))
                length, kind, estimate = seen[name]
                auto += f"  (saw {name} {length} tokens, class {kind}, first-token estimate {estimate:.2f})"
        lines.append(f"    {i:4}  {proposal:31}{bound:13}{auto}")
    return lines


def bound_agrees(report: PromptReport) -> bool | None:
    """Whether the bound computed here is the one bench recorded (None: none recorded). They
    differ where the calibration was measured again during the bench (a stale one)."""
    if not report.bound_recorded:
        return None
    return all(abs(b - report.bound) <= 1e-9 * report.bound for b in report.bound_recorded)


def prompt_text(report: PromptReport, file: BenchFile) -> list[str]:
    p = report.prompt
    lines = [f"== {p.id} ({p.category}): {len(p.output)} tokens, finished by "
             f"{'an end-of-generation token' if p.stopped else 'the -n cap'}"]
    if p.differing:
        lines.append(f"  outputs: {plural(len(p.differing), 'run')} with another output than target-only's: "
                     f"{', '.join(p.differing)}")
    if report.bound_recorded:
        recorded = (f"the file's: {', '.join(x(b) for b in report.bound_recorded)}: "
                    f"{'agree' if bound_agrees(report) else 'DIFFER'}")
    else:
        recorded = "none in the file"
    lines.append(f"  n-gram bound {x(report.bound)} ({recorded})")
    drafting = [(i, k, a) for i, k, a in report.bound_steps if k]
    lines.append(f"  bound's plan: {len(report.bound_steps)} steps, drafting at "
                 + (", ".join(f"{i} (k={k}, {a} accepted)" for i, k, a in drafting) or "no position"))
    for a in report.autos:
        lines.append(f"  {a.config} replayed (drafters {', '.join(a.drafters)}):")
        if a.stopped_at is not None:
            lines.append(f"    chose the draft model at position {a.stopped_at}: a replay without the model stops there")
            continue
        for name, why in a.declined.items():
            lines.append(f"    declined {name}: {why}")
        if not a.same_output:
            lines.append("    REPLAYED OUTPUT DIFFERS from the target-only output")
        lines.append(f"    modelled {x(a.modelled)} ({share_text(a.modelled, report.bound)}), "
                     f"{a.seconds:.3f} s at the calibrated costs, {len(a.steps)} steps: {plan_text(a.plans)}")
        for run in [r for r in p.runs if r["config"] == a.config]:
            plans = file_plans(run)
            lines.append(f"    in the file, repeat {run['repeat']}: modelled {x(run['modelled_speedup'])} "
                         f"(replay {a.modelled - run['modelled_speedup']:+.3f}), {sum(plans.values())} steps, "
                         f"{pct(plan_agreement(a.plans, plans))} of steps in common: {plan_text(plans)}")
        lines += step_rows(report, a)
    pol = report.policy
    lines.append(f"  best class policy in hindsight: {x(pol.speedup)} ({share_text(pol.speedup, report.bound)}); "
                 f"{pol.search}")
    lines += policy_text(pol.policy, cells_used([report.at]), "    ")
    return lines


def share_text(value: float | None, bound: float | None) -> str:
    s = share(value, bound)
    return "bound's gain: -" if s is None else f"{pct(s)} of the bound's gain"


def summary_text(rows: list[dict], reports: list[PromptReport]) -> list[str]:
    lines = ["== by category: medians over the prompts (each prompt's auto in the file: the median over its "
             "repeats), and each as a share of the bound's gain over 1.0 ((x - 1) / (bound - 1))"]
    for row in rows:
        lines.append(f"{row['category']} ({plural(len(row['prompts']), 'prompt')}): n-gram bound {x(row['bound'])}")
        for config, figures in row["auto"].items():
            lines.append(f"  {config}: replayed {x(figures['replayed'])} ({share_text(figures['replayed'], row['bound'])}), "
                         f"in the file (modelled) {x(figures['in_file'])} ({share_text(figures['in_file'], row['bound'])})")
        lines.append(f"  best class policy per prompt, in hindsight: {x(row['policy_per_prompt'])} "
                     f"({share_text(row['policy_per_prompt'], row['bound'])})")
        pol = row["policy"]
        lines.append(f"  one class policy for the category, in hindsight: {x(pol.speedup)} "
                     f"({share_text(pol.speedup, row['bound'])}); {pol.search}")
        group = [r for r in reports if r.prompt.id in row["prompts"]]
        lines += policy_text(pol.policy, cells_used([r.at for r in group]), "    ")
        c = row["continuation"]
        lines.append(f"  continuation: of {c['first_right']} proposals whose first token was right, "
                     + ", ".join(f"{pct(c[f'share_{n}'])} ran on to {n} tokens ({c[f'ran_{n}']} of {c[f'of_{n}']} "
                                 f"with {n} output tokens left)" for n in RUN_ON))
    return lines


def header_text(file: BenchFile, reports: list[PromptReport], pool_tokens: int) -> list[str]:
    meta = file.meta
    v = ", ".join(f"{1000 * c:.1f}" for c in file.verify)
    lines = [f"replay of {file.path}: {plural(len(reports), 'prompt')}, {file.n_predict} tokens per run, "
             f"target {meta.get('target', {}).get('name')}, bench of {meta.get('date')}",
             f"calibrated verify of 1..{len(file.verify)} tokens (ms): {v}",
             f"auto's drafters: ngram-simple (n={NGRAM_N_AUTO}), "
             + (f"the pool of the earlier prompts' target-only outputs ({pool_tokens} tokens at most), "
                if pool_tokens > 0 else "no pool, ")
             + ("the draft model (its calibrated cost; its drafts are not known)" if meta.get("draft") else "no draft model"),
             f"the bound and the policies use ngram-simple's proposal at every position (n={NGRAM_N_AUTO}, "
             f"up to {DRAFT_MAX_AUTO} tokens); a policy's run: the output tokens right before a position that "
             "the proposals there predicted, in a row (buckets 0, 1-3, 4-7, 8+)"]
    differing = [r for r in reports if r.prompt.differing]
    runs = sum(len(r.prompt.runs) for r in reports)
    lines.append(f"outputs: every run of every prompt has its prompt's target-only output ({runs} runs)" if not differing
                 else f"outputs: {plural(len(differing), 'prompt')} with runs whose output is not the target-only one "
                      f"(kernels: {', '.join(meta.get('machine', {}).get('batch_variant_kernels') or []) or 'none listed'})")
    return lines


# -- JSON ----------------------------------------------------------------------------------------


def policy_json(pol: PolicyResult) -> dict:
    return {"speedup": pol.speedup, "search": pol.search,
            "k": [{"class": c, "run": list(RUN_BUCKETS[b]), "k": k} for (c, b), k in sorted(pol.policy.items())]}


def report_json(file: BenchFile, reports: list[PromptReport], rows: list[dict], pool_tokens: int) -> dict:
    prompts = []
    for r in reports:
        autos, bound_drafts = [], {i for i, k, _ in r.bound_steps if k}
        for a in r.autos:
            runs = [{"repeat": run["repeat"], "modelled_speedup": run["modelled_speedup"],
                     "steps_in_common": plan_agreement(a.plans, file_plans(run))}
                    for run in r.prompt.runs if run["config"] == a.config]
            autos.append({
                "config": a.config, "drafters": a.drafters, "stopped_at": a.stopped_at, "modelled_speedup": a.modelled,
                "share_of_bound": share(a.modelled, r.bound), "seconds": a.seconds, "same_output": a.same_output,
                "plans": [{"drafter": d, "k": k, "steps": n} for (d, k), n in sorted(a.plans.items())],
                "steps": [{"position": i, "drafter": d, "k": k, "accepted": acc,
                           "seen": {name: {"length": n, "class": c, "first_token_estimate": e}
                                    for name, (n, c, e) in a.seen.get(i, {}).items()}}
                          for i, d, k, acc in a.steps if k or i in bound_drafts],
                "declined": a.declined, "in_file": runs})
        prompts.append({
            "id": r.prompt.id, "category": r.prompt.category, "tokens": len(r.prompt.output),
            "stopped": r.prompt.stopped, "differing_runs": r.prompt.differing,
            "ngram_bound": r.bound, "ngram_bound_in_file": r.bound_recorded, "ngram_bound_agrees": bound_agrees(r),
            "bound_steps": [{"position": i, "k": k, "accepted": a} for i, k, a in r.bound_steps if k],
            "bound_n_steps": len(r.bound_steps),
            "auto": autos, "policy": {**policy_json(r.policy), "share_of_bound": share(r.policy.speedup, r.bound)}})
    categories = [{**{k: v for k, v in row.items() if k != "policy"},
                   "policy_per_prompt_share": share(row["policy_per_prompt"], row["bound"]),
                   "policy": {**policy_json(row["policy"]), "share_of_bound": share(row["policy"].speedup, row["bound"])}}
                  for row in rows]
    replayed = {"bench_file": file.path.name, "bench_date": file.meta.get("date"), "pool_tokens": pool_tokens,
                "verify_costs": file.verify}
    return {"meta": meta(**replayed), "prompts": prompts, "categories": categories}


# -- command line --------------------------------------------------------------------------------


def chosen_prompts(file: BenchFile, categories: list[str] | None, ids: list[str] | None) -> list[str]:
    known = {r["prompt"]: r["category"] for r in file.runs}
    for pid in ids or []:
        if pid not in known:
            raise ReplayError(f"{file.path}: no prompt {pid!r} (prompts: {', '.join(file.order)})")
    for cat in categories or []:
        if cat not in known.values():
            raise ReplayError(f"{file.path}: no category {cat!r} (categories: {', '.join(sorted(set(known.values())))})")
    chosen = [p for p in file.order if (not categories or known[p] in categories) and (not ids or p in ids)]
    if not chosen:
        raise ReplayError("no prompt is both of the categories and among the ids given")
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench_file", type=Path, metavar="BENCH.json",
                        help="what `speculate bench -o` wrote (gzipped as committed: BENCH.json.gz)")
    parser.add_argument("--category", action="append", help="only prompts of this category (repeatable)")
    parser.add_argument("--prompt", action="append", metavar="ID", help="only this prompt (repeatable)")
    parser.add_argument("--pool-tokens", type=int, default=POOL_TOKENS, metavar="N",
                        help="the pool bench ran with (--spec-pool-tokens; 0: none) [default: %(default)s]")
    parser.add_argument("--json", type=Path, metavar="OUT", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    try:
        file = BenchFile(args.bench_file)
        reports = [analyse(file, pid, args.pool_tokens) for pid in chosen_prompts(file, args.category, args.prompt)]
    except ReplayError as e:
        print(f"replay_auto: error: {e}", file=sys.stderr)
        return 2
    rows = category_rows(reports, file)
    lines = header_text(file, reports, args.pool_tokens)
    for report in reports:
        lines += ["", *prompt_text(report, file)]
    lines += ["", *summary_text(rows, reports)]
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(report_json(file, reports, rows, args.pool_tokens), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
