"""`speculate bench`: what speculation buys on this machine, measured, not assumed.

Every prompt runs under every configuration with the models loaded once. Per
prompt (and repeat), target-only decoding runs before, between every two and
after the configurations, so a machine that speeds up or slows down over the
minutes hits baseline and speculation alike; each configuration's speedup is its
tokens per second over the mean of the two baseline runs around it (the
baseline's row reports the mean of all of them, and their spread as drift). Greedy
outputs, and sampled ones under sample-and-match (same seed, same random stream),
are compared token for token with the baseline: they are identical whenever
scoring is batch-invariant, and a mismatch is reported with its position and the
target's top-2 logit margin there. Speculative sampling draws other tokens from
the same distribution, so its outputs are not compared.
"""

from __future__ import annotations

import itertools
import json
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

from speculative.decoding import scheduler
from speculative.decoding.settings import (DRAFT_MAX_AUTO, NGRAM_N_AUTO, NgramSettings, SamplerSettings, SpecSettings,
                                           acceptance)
from speculative.drafters import registry
from speculative.engine.chat import prompt_or_messages
from speculative.engine.stream import complete
from speculative.errors import UsageError
from speculative.grammar import given

if TYPE_CHECKING:  # annotations only: the engine loads llama.cpp, the drafters numpy
    from speculative.decoding.drafter import Draft
    from speculative.engine.engine import Engine

BASELINE = "target only"
BASELINE_EVERY = 2  # configurations between two target-only runs

# --sweep KEY=v1,v2: which setting each key changes.
SWEEP_KEYS = {
    "draft-max": ("draft_max", int),
    "draft-min": ("draft_min", int),
    "draft-p-min": ("draft_p_min", float),
    "accept": ("accept", str),  # --spec-accept: rejection, match (sampled runs)
    "np": ("branches", int),    # -np: draft-tree branches (--spec-type draft)
    "p-split": ("p_split", float),  # --draft-p-split
    "ngram-n": ("n", int),
    "ngram-m": ("m", int),
    "ngram-min-hits": ("min_hits", int),
}


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    prompt: str | None = None
    messages: list | None = None
    grammar: str = ""  # its own `grammar` or `json_schema` field, as GBNF ('' : the command's, if any)


@dataclass(frozen=True)
class Config:
    label: str
    spec: SpecSettings


@dataclass
class Run:
    prompt: str
    category: str
    config: str
    repeat: int
    n_predict: int
    decode_tps: float
    speedup: float = 0.0
    accept_rate: float = 0.0
    mean_accepted_length: float = 0.0
    n_drafted: int = 0
    n_accept: int = 0
    t_draft_s: float = 0.0
    t_verify_s: float = 0.0
    t_decode_s: float = 0.0
    python_share: float = 0.0
    t_plan_s: float = 0.0   # auto's own planning and scoring (stats.t_plan)
    modelled_speedup: float = 0.0  # the same run's speedup at calibrated costs (see modelled_speedup)
    plans: list = field(default_factory=list)
    mismatch: dict | None = None
    baseline_drift: float | None = None  # target only: fastest of its runs over the slowest
    ngram_bound: float | None = None     # target only: the best any n-gram plan could do (see below)
    tokens: list[int] = field(default_factory=list)  # the output, to compare runs and builds


def load_prompts(path: Path) -> list[BenchPrompt]:
    """JSONL: each line an object with `prompt` or chat `messages`, optional id and category, and
    optionally the `grammar` (GBNF) or `json_schema` its answer must follow."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read prompt file {path}: {getattr(e, 'strerror', None) or e}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except (ValueError, RecursionError) as e:  # a number over 4300 digits, nesting too deep
            reason = e.msg if isinstance(e, json.JSONDecodeError) else "a number or nesting too large"
            raise UsageError(f"{path}:{number}: not JSON ({reason})") from None
        try:
            prompt, messages = prompt_or_messages(item)
            grammar = given.from_fields(item.get("grammar"), item.get("json_schema"), f"{path}:{number}: ")
        except ValueError as e:
            raise UsageError(f"{path}:{number}: {e}") from None
        prompts.append(BenchPrompt(str(item.get("id", f"line-{number}")), str(item.get("category", "all")),
                                   prompt, messages, grammar))
    if not prompts:
        raise UsageError(f"{path}: no prompts")
    return prompts


def parse_sweeps(sweeps: Iterable[str]) -> dict[str, list]:
    grid: dict[str, list] = {}
    for sweep in sweeps:
        key, _, values = sweep.partition("=")
        if key not in SWEEP_KEYS or not values:
            raise UsageError(f"--sweep {sweep!r}: expected KEY=v1,v2,... with KEY one of {', '.join(SWEEP_KEYS)}")
        kind = SWEEP_KEYS[key][1]
        try:
            grid[key] = [kind(v) for v in values.split(",")]
        except ValueError:
            raise UsageError(f"--sweep {sweep!r}: values must be {kind.__name__}s") from None
    return grid


def make_configs(spec_types: list[str], grid: dict[str, list], base: SpecSettings) -> list[Config]:
    """The baseline, then every --spec-type value under every combination of the sweep.

    draft-max applies to fixed types only (auto picks its own k up to its cap)."""
    configs = [Config(BASELINE, replace(base, types=("none",)))]
    for types in spec_types:
        kinds = registry.canonical(t.strip() for t in types.split(",") if t.strip())
        if kinds == ("none",):
            continue
        keys = [k for k in grid if not (k == "draft-max" and "auto" in kinds)]
        for values in itertools.product(*(grid[k] for k in keys)):
            spec = replace(base, types=kinds, draft_max=DRAFT_MAX_AUTO if "auto" in kinds else base.draft_max)
            for key, value in zip(keys, values):
                spec = _set(spec, key, value)
            registry.check(spec)
            label = ",".join(kinds) + "".join(f" {k}={v}" for k, v in zip(keys, values))
            configs.append(Config(label, spec))
    return configs


def _set(spec: SpecSettings, key: str, value) -> SpecSettings:
    name = SWEEP_KEYS[key][0]
    if key.startswith("ngram-"):
        lookups = [t for t in registry.TYPES.values() if t.settings and issubclass(t.settings, NgramSettings)]
        return replace(spec, **{t.settings_field: replace(spec.own(t.name), **{name: value}) for t in lookups})
    if key == "draft-max":  # a draft-max swept caps llama.cpp's n-gram types too, as the flag does
        return replace(spec, draft_max=value, draft_max_given=True)
    return replace(spec, **{name: value})


def count_runs(n_prompts: int, n_configs: int, repeats: int) -> int:
    """How many timed runs run_bench makes of `n_configs` configurations, target only included:
    per prompt and repeat, each configuration once and target only around every BASELINE_EVERY
    of the others (fewer if the target answers a prompt with nothing)."""
    others = n_configs - 1
    return n_prompts * repeats * (n_configs + (others + BASELINE_EVERY - 1) // BASELINE_EVERY)


def run_bench(engine: Engine, prompts: list[BenchPrompt], configs: list[Config], sampling: SamplerSettings,
              repeats: int = 1, on_run: Callable[[Run], None] | None = None,
              progress: Callable[[str], None] | None = None) -> list[Run]:
    """All runs, speedups filled in; `on_run` hears of each run as it ends (before its speedup),
    `progress` which run begins (its number, configuration, round and prompt).

    Per prompt and repeat, target-only runs come first, last and after every
    BASELINE_EVERY configurations; each configuration is compared with the mean of
    the two baseline runs around it, so machine drift hits both sides alike. Each repeat
    starts the configurations at another place in their list (run_order).
    """
    runs: list[Run] = []
    seed = sampling.resolved_seed()
    baseline, rest = configs[0], configs[1:]
    # Every run of a prompt drafts from the pool as it was before the prompt: the pool learns
    # the prompt's output once all its runs are done, not from one configuration for the next.
    learn, engine.learn = engine.learn, False
    say = progress or (lambda text: None)
    total, begun = count_runs(len(prompts), len(configs), repeats), itertools.count(1)
    try:
        say(f"warming up: an untimed run of {prompts[0].id}")
        _warm_up(engine, prompts[0], baseline, sampling, seed)
        for number, prompt in enumerate(prompts, 1):
            own = replace(sampling, grammar=prompt.grammar) if prompt.grammar else sampling

            def starting(config: Config, repeat: int) -> None:
                say(f"run {next(begun)}/{total}: {config.label}, round {repeat + 1}/{repeats}, "
                    f"prompt {number}/{len(prompts)} {prompt.id}")  # the longest last, where a status line is cut

            own_runs = _prompt_runs(engine, prompt, baseline, rest, own, seed, repeats, on_run, starting)
            runs += own_runs
            if engine.pool is not None and learn and own_runs:
                engine.pool.add(runs[-1].tokens)  # the target-only output (the last run appended)
    finally:
        engine.learn = learn
    return runs


def _prompt_runs(engine: Engine, prompt: BenchPrompt, baseline: Config, rest: list[Config],
                 sampling: SamplerSettings, seed: int, repeats: int,
                 on_run: Callable[[Run], None] | None,
                 starting: Callable[[Config, int], None] | None = None) -> list[Run]:
    """One prompt's runs: per repeat, target-only around every BASELINE_EVERY configurations."""
    runs: list[Run] = []
    tokens = prompt_tokens(engine, prompt)

    def run(config: Config, repeat: int) -> tuple[list[int], Run]:
        if starting:
            starting(config, repeat)
        out, result = _run(engine, tokens, config, sampling, seed, prompt, repeat)
        if on_run:
            on_run(result)
        return out, result

    for repeat in range(repeats):
        base_tokens, first = run(baseline, repeat)
        if not base_tokens:  # the target ends at once: no decode to time (and nothing to draft)
            if engine.notify:
                engine.notify(f"bench: {prompt.id}: the target's answer is empty, so it has no speed to compare; "
                              "left out")
            return []
        bases = [first]
        order = run_order(rest, repeat, repeats)
        for start in range(0, len(order), BASELINE_EVERY):
            measured = [(config, *run(config, repeat)) for config in order[start : start + BASELINE_EVERY]]
            bases.append(run(baseline, repeat)[1])
            around = (bases[-2].decode_tps + bases[-1].decode_tps) / 2
            for config, out, result in measured:
                result.speedup = result.decode_tps / around
                if out != base_tokens and expects_identity(config.spec, sampling):
                    result.mismatch = _mismatch(engine, tokens, base_tokens, out)
                runs.append(result)
        speeds = [b.decode_tps for b in bases]
        first.decode_tps, first.speedup = statistics.mean(speeds), 1.0
        first.baseline_drift = max(speeds) / min(speeds)
        first.ngram_bound = ngram_bound(tokens, base_tokens, engine.costs("target", DRAFT_MAX_AUTO + 1))
        runs.append(first)
    return runs


def run_order(configs: list, repeat: int, repeats: int) -> list:
    """The configurations in the order a repeat runs them: rotated by an equal share of the list
    per repeat. A place in the sequence has its own bias: on the 2-core development machine,
    runs that drafted nothing measured 0.99x in the first pair after target-only and 1.02x in
    the third, over 33 runs each, so a fixed order would favour whichever came third."""
    shift = repeat * len(configs) // repeats
    return configs[shift:] + configs[:shift]


def prompt_tokens(engine: Engine, prompt: BenchPrompt) -> list[int]:
    return engine.chat_tokens(prompt.messages) if prompt.messages else engine.prompt_tokens(prompt.prompt)


def _warm_up(engine: Engine, prompt: BenchPrompt, baseline: Config, sampling: SamplerSettings, seed: int) -> None:
    """An untimed run first: the first pass over memory-mapped weights pays for page faults."""
    complete(engine, prompt_tokens(engine, prompt), sampling, replace(baseline.spec, n_predict=16), seed)


def _run(engine: Engine, tokens: list[int], config: Config, sampling: SamplerSettings, seed: int,
         prompt: BenchPrompt, repeat: int) -> tuple[list[int], Run]:
    final = complete(engine, tokens, sampling, config.spec, seed)
    stats = final.stats
    # target-only decoding's passes: one per token, and one more for an end-of-generation token
    modelled = modelled_speedup(engine, stats.plans, stats.n_predict + (stats.finish_reason == "stop"))
    return final.tokens, Run(
        prompt=prompt.id, category=prompt.category, config=config.label, repeat=repeat,
        n_predict=stats.n_predict, decode_tps=stats.decode_tps, accept_rate=stats.accept_rate,
        mean_accepted_length=stats.mean_accepted_length, n_drafted=stats.n_drafted, n_accept=stats.n_accept,
        t_draft_s=stats.t_draft, t_verify_s=stats.t_verify, t_decode_s=stats.t_decode,
        python_share=stats.python_share, t_plan_s=stats.t_plan, modelled_speedup=modelled,
        plans=[{"drafter": d, "k": k, "steps": n} for (d, k), n in sorted(stats.plans.items())],
        tokens=final.tokens)


def modelled_speedup(engine: Engine, plans: dict[tuple[str, int], int], passes_alone: int) -> float:
    """A run's speedup without the machine's noise: target-only decoding's time over the run's,
    both modelled from their steps at this machine's calibrated costs (a step that drafted k
    tokens: the target's verify of k + 1, plus a draft model's calibrated cost per token; n-gram
    lookups cost next to nothing). A loss this figure shows too is in the plan, not the noise."""
    if not passes_alone or not plans:
        return 0.0
    verify = engine.costs("target", max(k for _, k in plans) + 1)
    per_token = {name: engine.costs(role, 1)[0] for name, role in (("draft", "draft"), ("draft-mtp", "mtp"))
                 if any(d == name for d, _ in plans)}
    seconds = sum(steps * (verify[k] + k * per_token.get(drafter, 0.0)) for (drafter, k), steps in plans.items())
    return passes_alone * verify[0] / seconds


def expects_identity(spec: SpecSettings, sampling: SamplerSettings) -> bool:
    """Whether a run must reproduce the baseline's tokens exactly (on an invariant build)."""
    return acceptance(sampling, spec) != "rejection"


def top2(engine: Engine, context: list[int]) -> tuple[tuple[int, float], tuple[int, float]]:
    """The target's two best next tokens after `context`, with their logits."""
    import numpy as np

    (row,) = scheduler.run(engine.caches["target"].sync(context, "last"))
    second, first = np.argpartition(row, -2)[-2:]
    if row[second] > row[first]:
        first, second = second, first
    return (int(first), float(row[first])), (int(second), float(row[second]))


def _mismatch(engine: Engine, prompt: list[int], expected: list[int], got: list[int]) -> dict:
    position = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    (first, l1), (second, l2) = top2(engine, prompt + expected[:position])
    return {"position": position, "baseline_token": expected[position] if position < len(expected) else None,
            "token": got[position] if position < len(got) else None,
            "top2": [first, second], "margin": l1 - l2}


def ngram_bound(prompt: list[int], output: list[int], verify: list[float], n: int = NGRAM_N_AUTO) -> float:
    """The speedup over target-only decoding that a planner knowing the output in advance
    would get from n-gram proposals (ngram-simple, n tokens, up to len(verify) - 1 drafted),
    with the measured verify costs: a bound for what auto can do with them on this machine.
    Dynamic programming over positions: cost[i] = min over k of v(k+1) + cost[i + accepted + 1]."""
    proposals = [draft.tokens for draft in ngram_proposals(prompt, output, len(verify) - 1, n)]
    cost, _ = bound_plan(output, proposals, verify)
    return len(output) * verify[0] / cost if cost else 1.0


def ngram_proposals(prompt: list[int], output: list[int], max_k: int, n: int = NGRAM_N_AUTO) -> list[Draft]:
    """ngram-simple's proposal (up to max_k tokens) at every position of the output, asked in
    order, position after position."""
    from speculative.drafters import NgramSimple

    drafter = NgramSimple(n=n, m=max_k)
    return [drafter.propose(prompt + output[:i], max_k) for i in range(len(output))]


def bound_plan(output: list[int], proposals: list[list[int]], verify: list[float]) -> tuple[float, list[int]]:
    """ngram_bound's dynamic programming: the least time to produce the output when each step
    may draft k tokens of the proposal at its position, and the k that achieves it at every
    position (0: plain decoding; the plan is the steps from position 0 on, each moving past
    its accepted tokens and the bonus)."""
    cost = [0.0] * (len(output) + 1)
    choice = [0] * len(output)
    for i in range(len(output) - 1, -1, -1):
        best = verify[0] + cost[i + 1]
        for k in range(1, min(len(proposals[i]), len(output) - i - 1) + 1):
            accepted = next((j for j in range(k) if proposals[i][j] != output[i + j]), k)
            if verify[k] + cost[i + accepted + 1] < best:  # ties keep the shorter draft
                best, choice[i] = verify[k] + cost[i + accepted + 1], k
        cost[i] = best
    return cost[0], choice


def summarize(runs: list[Run]) -> list[dict]:
    """One row per (category, config), then per config over all prompts ('all'). Speedups
    are medians over the prompts of each prompt's median over its repeats (single runs
    swing by 10% and more on a shared machine), and `min_speedup` is the worst prompt's."""
    rows = []
    groups: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.category, run.config), []).append(run)
        groups.setdefault(("all", run.config), []).append(run)
    for (category, config), group in groups.items():
        drafted = sum(r.n_drafted for r in group)
        decode = sum(r.t_decode_s for r in group) or 1.0
        speedups, modelled = per_prompt(group, "speedup"), per_prompt(group, "modelled_speedup")
        rows.append({
            "category": category, "config": config, "runs": len(group),
            "median_speedup": statistics.median(speedups.values()),
            "min_speedup": min(speedups.values()),
            "median_tps": statistics.median(r.decode_tps for r in group),
            "accept_rate": sum(r.n_accept for r in group) / drafted if drafted else 0.0,
            "mean_accepted_length": statistics.mean(r.mean_accepted_length for r in group),
            "draft_share": sum(r.t_draft_s for r in group) / decode,
            "verify_share": sum(r.t_verify_s for r in group) / decode,
            "python_share": sum(r.python_share * r.t_decode_s for r in group) / decode,
            "plan_share": sum(r.t_plan_s for r in group) / decode,
            "median_modelled_speedup": statistics.median(modelled.values()),
            "min_modelled_speedup": min(modelled.values()),
            "mismatches": sum(r.mismatch is not None for r in group),
        })
        bounds = [r.ngram_bound for r in group if r.ngram_bound is not None]
        if bounds:
            rows[-1]["median_ngram_bound"] = statistics.median(bounds)
    return rows


def per_prompt(runs: list[Run], field: str) -> dict[str, float]:
    """Each prompt's median of `field` over its repeats."""
    values: dict[str, list[float]] = {}
    for run in runs:
        values.setdefault(run.prompt, []).append(getattr(run, field))
    return {prompt: statistics.median(xs) for prompt, xs in values.items()}


def report(runs: list[Run], rows: list[dict], meta: dict) -> dict:
    return {"meta": meta, "summary": rows, "runs": [asdict(r) for r in runs]}
