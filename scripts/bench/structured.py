"""Structured output: what a JSON schema costs decoding, and what its forced tokens buy back.

    .venv/bin/python -m scripts.bench structured -o docs/results/structured.json.gz

    python -m scripts.bench structured [-m MODEL] [-md DRAFT] [-n 160] [-t THREADS] [--limit N] [--seed 2026]
                                       [--no-llama-server] [-o OUT.json]

The requests: the extraction prompts of scripts/structured_prompts.jsonl (chat messages, each with
the JSON schema of its answer), and the 20 log-to-JSON requests of the `pool` scenario
(`requests(20)`, its INSTRUCTION) with LOG_SCHEMA, the schema of INSTRUCTION's fields. --limit N
keeps the first N of each set. Schemas become GBNF through speculative.grammar.given.from_schema.

In one process, one Engine (target -m and draft -md, -c 4096, -t THREADS), after an untimed
warm-up (which also lets auto calibrate), per request, -n tokens at most:

  greedy    unconstrained target-only (--spec-type none, no grammar), constrained target-only
            (none and the schema: the reference), constrained auto (which adds `forced` to its
            choices), constrained forced (--spec-type forced, --draft-max 16: forced text costs
            nothing to draft), constrained auto without forced (auto over ngram-simple,
            ngram-pool and draft only)
  sampled   --temp 0.8, --seed fixed, llama.cpp's default chain: sample-and-match (--spec-accept
            match) target-only, unconstrained and constrained; the rejection rule (--spec-accept
            rejection) with the draft model drafting (--spec-type draft, --draft-max 3),
            unconstrained and constrained

Each request runs its configurations back to back, the list rotated by one place per request
(speculative.engine.bench.run_order), so no configuration always comes first. The pool
(ngram-pool) learns each request's constrained target-only output after all its runs, as
`speculate bench` does: later requests draft from earlier answers, no run from its own.

Per run: tokens, decode seconds and tokens/s, kind (a) tokens (certain: the grammar admits one
token alone, appended unsampled; `n_certain`), kind (b) (forced text drafted as the tokenizer
spells it and verified: `n_forced_drafted`, `n_forced_accept`), `t_grammar` (the grammar's own
checks), the finish reason, whether a constrained answer parses as JSON, and (greedy) whether
its text equals constrained target-only's: on a batch-invariant build it must; on the stock
build a near-tie may part them, which is reported, not failed.

The pinned llama-server (built and cached as for the `parallel` scenario) runs beside it, twice:
the target alone, `-np 1 -c 4096 -t THREADS -fa off` (flash attention off, as speculate's -fa auto
leaves it on a CPU: llama.cpp's auto turns it on, which decodes ~2% faster here; equal settings),
its defaults otherwise, asked through /v1/chat/completions, greedy, with `response_format`
json_schema and without; and with `-md DRAFT --spec-type draft-simple` (its draft-model
speculation at its defaults, --draft-max 3), constrained: the pinned build loads `-md` alone and
drafts nothing (its speculative types default to none), so the goal against it holds only where
its timings report drafted tokens (`draft_n`). Its three configurations join each request's
greedy rotation, so a request's runs, speculate's and llama-server's, come back to back and
share whatever the machine was doing then; a server waits idle while the others run. Its speed
is the answer's `timings.predicted_per_second`. --no-llama-server skips them.

Summary per request set (extract, logs) and decoding (greedy, sampled): mean tokens/s of each
configuration, its mean per-request speedup over constrained target-only (sampled: over
match's constrained target-only), the shares of answer tokens of kind (a) and (b), and the
grammar's ms per token and share of decode time; the constraint's cost (time per token
constrained over unconstrained, greedy, match and rejection); and the goals, printed as PASS or
FAIL lines with their numbers:
  - greedy and sample-and-match: the constraint costs under 5% of decode speed (the rejection
    rule's cost is reported, not held to it);
  - constrained auto ahead of constrained target-only on every request whose forced run had
    kinds (a) and (b) together a quarter of its answer or more;
  - constrained auto ahead of llama-server constrained (greedy), alone and with -md.
Prints the tables as Markdown; -o writes {"meta", "args", "runs", "llama_server", "summary",
"costs", "goals"} as JSON.

Time: with the defaults (the Qwen 1.5B/0.5B pair, 34 requests, 9 configurations and 3 of
llama-server's, up to 160 tokens each) 41 minutes on the 2-core development machine (the sampled
rejection runs are the slow ones); run it on an idle machine. On SmolLM2 135M as both
models, --limit 3: 3 minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from scripts.bench import harness, pool
from scripts.bench.parallel import CTX
from scripts.bench.servers import Server, llama_server_binary
from scripts.tables import fraction, opt
from speculative.decoding.settings import DRAFT_MAX_AUTO, DRAFT_MAX_FIXED, ModelSpec, SamplerSettings, SpecSettings
from speculative.engine.bench import run_order
from speculative.engine.stream import complete
from speculative.grammar import given

PROMPTS = harness.ROOT / "scripts" / "structured_prompts.jsonl"
TEMP = 0.8
GOAL_COST = 0.05       # the constraint alone: under 5% of decode speed
GOAL_FORCED_SHARE = 0.25  # kinds (a) and (b) a quarter of the answer or more: auto must be ahead


def _obj(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


# INSTRUCTION's fields (the `pool` scenario's), in its order
LOG_SCHEMA = _obj({"service": {"type": "string"}, "first_timestamp": {"type": "string"},
                   "last_timestamp": {"type": "string"}, "error_count": {"type": "integer"},
                   "warning_count": {"type": "integer"}, "slowest_request_id": {"type": "string"},
                   "slowest_latency_ms": {"type": "integer"},
                   "error_messages": {"type": "array", "items": {"type": "string"}}})


@dataclasses.dataclass(frozen=True)
class Config:
    label: str
    types: tuple[str, ...]
    constrained: bool
    accept: str = "rejection"  # sampled runs: how drafts are verified

    def spec(self, n_predict: int) -> SpecSettings:
        free = "auto" in self.types or "forced" in self.types
        spec = SpecSettings(types=self.types, draft_max=DRAFT_MAX_AUTO if free else DRAFT_MAX_FIXED,
                            n_predict=n_predict, accept=self.accept)
        spec.validate()
        return spec


REFERENCE = "constrained target-only"
UNCONSTRAINED = "unconstrained target-only"
AUTO = "constrained auto"
FORCED = "constrained forced"
GREEDY = [Config(UNCONSTRAINED, ("none",), False), Config(REFERENCE, ("none",), True),
          Config(AUTO, ("auto",), True), Config(FORCED, ("forced",), True),
          Config("constrained auto, no forced", ("auto", "ngram-simple", "ngram-pool", "draft"), True)]
MATCH_U, MATCH_C = "match: unconstrained target-only", "match: constrained target-only"
REJ_U, REJ_C = "rejection: unconstrained draft", "rejection: constrained draft"
SAMPLED = [Config(MATCH_U, ("none",), False, "match"), Config(MATCH_C, ("none",), True, "match"),
           Config(REJ_U, ("draft",), False, "rejection"), Config(REJ_C, ("draft",), True, "rejection")]
SERVER_C, SERVER_U, SERVER_MD = "llama-server constrained", "llama-server unconstrained", "llama-server -md constrained"
SERVER_CONFIGS = [SERVER_U, SERVER_C, SERVER_MD]


@dataclasses.dataclass(frozen=True)
class Request:
    id: str
    set: str  # "extract" or "logs"
    messages: list
    schema: dict
    grammar: str  # the schema as GBNF


def load_requests(limit: int | None) -> list[Request]:
    """The extraction prompts, then the 20 log requests; the first `limit` of each set."""
    extract = [(r["id"], "extract", r["messages"], r["json_schema"]) for r in harness.jsonl(PROMPTS)]
    logs = [(f"logs-{i:02d}", "logs", [{"role": "user", "content": p}], LOG_SCHEMA)
            for i, p in enumerate(pool.requests(20))]
    if limit is not None:
        extract, logs = extract[:limit], logs[:limit]
    return [Request(*r, given.from_schema(r[3])) for r in extract + logs]


def parses(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def sampling(request: Request, config: Config, greedy: bool, seed: int) -> SamplerSettings:
    """How a run samples: greedy or at TEMP, under the request's grammar where it is constrained."""
    return SamplerSettings(temp=0.0 if greedy else TEMP, seed=seed,
                           grammar=request.grammar if config.constrained else "")


def measure(engine, request: Request, prompt: list[int], config: Config, greedy: bool,
            bench: argparse.Namespace) -> tuple[dict, list[int]]:
    """One run: its figures, and its tokens."""
    final = complete(engine, prompt, sampling(request, config, greedy, bench.seed), config.spec(bench.n_predict),
                     bench.seed)
    s = final.stats
    run = {"request": request.id, "set": request.set, "mode": "greedy" if greedy else "sampled",
           "config": config.label, "constrained": config.constrained, "tokens": s.n_predict,
           "decode_s": s.t_decode, "tps": s.decode_tps, "steps": s.n_steps, "n_drafted": s.n_drafted,
           "n_accept": s.n_accept, "n_certain": s.n_certain, "n_forced_drafted": s.n_forced_drafted,
           "n_forced_accept": s.n_forced_accept, "t_grammar_s": s.t_grammar, "finish_reason": s.finish_reason,
           "incomplete": s.incomplete, "json_ok": parses(final.text) if config.constrained else None,
           "plans": [{"drafter": d, "k": k, "steps": n} for (d, k), n in sorted(s.plans.items())],
           "text": final.text}
    print(f"{request.id:24s} {run['mode']:7s} {config.label:34s} {s.n_predict:4d} tokens {s.decode_tps:7.2f} t/s"
          f"  a {s.n_certain:3d}  b {s.n_forced_accept:3d}/{s.n_forced_drafted:<3d}"
          f"  grammar {1000 * s.t_grammar / max(1, s.n_predict):6.3f} ms/token  {s.finish_reason}",
          file=sys.stderr, flush=True)
    return run, final.tokens


def warm_up(engine, request: Request, prompt: list[int], bench: argparse.Namespace) -> None:
    """Untimed: page the weights in, build the grammar's vocabulary index, let auto calibrate."""
    for config, greedy in ((GREEDY[0], True), (GREEDY[2], True), (SAMPLED[3], False)):
        complete(engine, prompt, sampling(request, config, greedy, bench.seed), config.spec(16), bench.seed)


def greedy_pass(engine, requests: list[Request], prompts: dict, bench: argparse.Namespace,
                servers: dict[str, Server]) -> tuple[list[dict], list[dict]]:
    """Every request under every greedy configuration, llama-server's (`servers`: label -> the
    server that runs it) among them; each constrained text compared with the reference's; the
    pool learns the reference's tokens once the request's runs are done. The runs of speculate,
    and of llama-server."""
    runs, served = [], []
    learn, engine.learn = engine.learn, False
    configs = GREEDY + list(servers)
    try:
        for i, request in enumerate(requests):
            got = {}
            for config in run_order(configs, i % len(configs), len(configs)):
                if isinstance(config, str):
                    served.append(ask_server(servers[config], request, config, bench.n_predict))
                    continue
                got[config.label] = measure(engine, request, prompts[request.id], config, True, bench)
            reference = got[REFERENCE][0]["text"]
            for config in GREEDY:
                run = got[config.label][0]
                run["same_as_reference"] = run["text"] == reference if config.constrained else None
                runs.append(run)
            if engine.pool is not None:
                engine.pool.add(got[REFERENCE][1])
    finally:
        engine.learn = learn
    return runs, served


def sampled_pass(engine, requests: list[Request], prompts: dict, bench: argparse.Namespace) -> list[dict]:
    runs = []
    learn, engine.learn = engine.learn, False  # none of these drafts from the pool: keep it as it is
    try:
        for i, request in enumerate(requests):
            for config in run_order(SAMPLED, i % len(SAMPLED), len(SAMPLED)):
                runs.append(measure(engine, request, prompts[request.id], config, False, bench)[0])
    finally:
        engine.learn = learn
    return runs


def run_all(bench: argparse.Namespace, requests: list[Request],
            servers: dict[str, Server]) -> tuple[list[dict], list[dict]]:
    """Every speculate run, in one process with the target and the draft model loaded once, and
    llama-server's among its greedy ones: (speculate's runs, llama-server's)."""
    from speculative.engine.engine import Engine  # loads llama.cpp

    target = ModelSpec(bench.target_path, bench.target_name, n_ctx=CTX, n_threads=bench.threads)
    draft = ModelSpec(bench.draft_path, bench.draft_name, n_ctx=CTX, n_threads=bench.threads)
    with Engine(target, draft) as engine:
        prompts = {r.id: engine.chat_tokens(r.messages) for r in requests}
        warm_up(engine, requests[0], prompts[requests[0].id], bench)
        for label, server in servers.items():  # untimed, as the engine's warm-up
            ask_server(server, requests[0], label, 16)
        runs, served = greedy_pass(engine, requests, prompts, bench, servers)
        write(bench, requests, runs, served)  # an hour's runs are kept whatever comes next
        return runs + sampled_pass(engine, requests, prompts, bench), served


def ask_server(server: Server, request: Request, label: str, n_predict: int) -> dict:
    """One greedy request through /v1/chat/completions, with the schema as response_format unless
    `label` is the unconstrained one."""
    constrained = label != SERVER_U
    body = {"messages": request.messages, "max_tokens": n_predict, "temperature": 0,
            **({"response_format": {"type": "json_schema", "json_schema": {"schema": request.schema}}}
               if constrained else {})}
    status, answer = server.post("/v1/chat/completions", body)
    if status != 200:
        raise RuntimeError(f"llama-server: request {request.id} failed ({status}): {answer}")
    choice, timings = answer["choices"][0], answer.get("timings", {})
    text = choice["message"]["content"] or ""
    run = {"request": request.id, "set": request.set, "mode": "greedy", "config": label, "constrained": constrained,
           "tokens": answer["usage"]["completion_tokens"], "tps": timings.get("predicted_per_second"),
           "decode_s": timings.get("predicted_ms", 0.0) / 1000, "n_drafted": timings.get("draft_n"),
           "n_accept": timings.get("draft_n_accepted"), "finish_reason": choice.get("finish_reason"),
           "json_ok": parses(text) if constrained else None, "text": text}
    print(f"{request.id:24s} greedy  {label:34s} {run['tokens']:4d} tokens {run['tps'] or 0:7.2f} t/s",
          file=sys.stderr, flush=True)
    return run


def start_servers(bench: argparse.Namespace, work: Path, stack: contextlib.ExitStack) -> dict[str, Server]:
    """The pinned llama-server, alone and with -md: label -> the server that runs it (none where
    one did not start, which is said)."""
    servers: dict[str, Server] = {}
    for labels, draft in (([SERVER_U, SERVER_C], []),
                          ([SERVER_MD], ["-md", str(bench.draft_path), "--spec-type", "draft-simple"])):
        flags = ["-m", str(bench.target_path), *draft, "-np", "1", "-c", str(CTX), "-t", str(bench.threads),
                 "-fa", "off"]  # as speculate's -fa auto on a CPU: equal settings
        log = work / f"llama-server{'-md' if draft else ''}.log"
        try:
            server = Server(flags, log, command=[str(bench.llama_server)], env=dict(os.environ))
        except SystemExit as e:  # Server gives up with sys.exit and the log's tail
            print(f"llama-server {' '.join(flags)} did not start: {e}", file=sys.stderr)
            continue
        stack.callback(server.close)
        servers.update(dict.fromkeys(labels, server))
    return servers


def total(runs: list[dict], key: str) -> float:
    return sum(r.get(key) or 0 for r in runs)  # llama-server's runs lack the kinds and t_grammar


def config_row(runs: list[dict], reference: dict[str, dict]) -> dict:
    """One configuration's runs of one set and decoding, against the reference's by request."""
    tokens = total(runs, "tokens")
    ratios = [r["tps"] / reference[r["request"]]["tps"] for r in runs
              if r["tps"] and r["request"] in reference and reference[r["request"]]["tps"]]
    constrained = [r for r in runs if r["constrained"]]
    compared = [r for r in runs if r.get("same_as_reference") is not None]
    speeds = [r["tps"] for r in runs if r["tps"] is not None]
    return {"set": runs[0]["set"], "mode": runs[0]["mode"], "config": runs[0]["config"], "runs": len(runs),
            "tokens": tokens, "mean_tps": statistics.mean(speeds) if speeds else None,
            "speedup": statistics.mean(ratios) if ratios else None,
            "kind_a_share": total(runs, "n_certain") / tokens if tokens else 0.0,
            "kind_b_share": total(runs, "n_forced_accept") / tokens if tokens else 0.0,
            "kind_b_drafted": total(runs, "n_forced_drafted"), "kind_b_accepted": total(runs, "n_forced_accept"),
            "grammar_ms_per_token": 1000 * total(runs, "t_grammar_s") / tokens if tokens else 0.0,
            "grammar_share": total(runs, "t_grammar_s") / total(runs, "decode_s") if total(runs, "decode_s") else 0.0,
            "json_ok": sum(bool(r["json_ok"]) for r in constrained) if constrained else None,
            "constrained": len(constrained),
            "same_as_reference": sum(r["same_as_reference"] for r in compared) if compared else None,
            "compared": len(compared)}


def summarise(runs: list[dict], served: list[dict]) -> list[dict]:
    """One row per set, decoding and configuration (llama-server's against constrained target-only)."""
    rows = []
    everything = runs + served
    for set_name in dict.fromkeys(r["set"] for r in runs):
        for mode, labels, base in (("greedy", [c.label for c in GREEDY], REFERENCE),
                                   ("sampled", [c.label for c in SAMPLED], MATCH_C),
                                   ("greedy", SERVER_CONFIGS, REFERENCE)):
            mine = [r for r in everything if r["set"] == set_name and r["mode"] == mode]
            reference = {r["request"]: r for r in mine if r["config"] == base}
            for label in labels:
                picked = [r for r in mine if r["config"] == label]
                if picked:
                    rows.append(config_row(picked, reference))
    return rows


def costs(runs: list[dict]) -> list[dict]:
    """The constraint's cost per set and decoding rule: time per token constrained over unconstrained."""
    out = []
    for set_name in dict.fromkeys(r["set"] for r in runs):
        for rule, plain, constrained in (("greedy", UNCONSTRAINED, REFERENCE), ("sample-and-match", MATCH_U, MATCH_C),
                                         ("rejection, draft model", REJ_U, REJ_C)):
            u = [r for r in runs if r["set"] == set_name and r["config"] == plain]
            c = [r for r in runs if r["set"] == set_name and r["config"] == constrained]
            if not u or not c or not total(u, "tokens") or not total(c, "tokens"):
                continue
            per_u, per_c = total(u, "decode_s") / total(u, "tokens"), total(c, "decode_s") / total(c, "tokens")
            out.append({"set": set_name, "rule": rule, "ms_per_token_unconstrained": 1000 * per_u,
                        "ms_per_token_constrained": 1000 * per_c, "cost": per_c / per_u - 1,
                        "grammar_ms_per_token": 1000 * total(c, "t_grammar_s") / total(c, "tokens"),
                        "grammar_share": total(c, "t_grammar_s") / total(c, "decode_s")})
    return out


def forced_goal(runs: list[dict], set_name: str) -> dict:
    """Constrained auto ahead of constrained target-only on every request whose forced run had
    kinds (a) and (b) together a quarter of its answer or more."""
    by = {(r["request"], r["config"]): r for r in runs if r["set"] == set_name and r["mode"] == "greedy"}
    share = {req: (r["n_certain"] + r["n_forced_accept"]) / r["tokens"] for (req, label), r in by.items()
             if label == FORCED and r["tokens"]}
    qualify = [req for req, x in share.items() if x >= GOAL_FORCED_SHARE]
    if not qualify:
        most = max(share.values(), default=0.0)
        return {"goal": f"{set_name}: auto ahead of constrained target-only where (a)+(b) >= 25%", "pass": None,
                "detail": f"no request's forced run had that much; the most: {100 * most:.1f}%"}
    ratios = [by[(q, AUTO)]["tps"] / by[(q, REFERENCE)]["tps"] for q in qualify]
    ahead = sum(x > 1 for x in ratios)
    return {"goal": f"{set_name}: auto ahead of constrained target-only where (a)+(b) >= 25%",
            "pass": ahead == len(ratios),
            "detail": f"ahead on {ahead} of {len(ratios)} such requests; auto / target-only min "
                      f"{min(ratios):.2f}x, mean {statistics.mean(ratios):.2f}x"}


def server_goal(served: list[dict], set_name: str, server: str, auto: float, theirs: float) -> dict:
    """Constrained auto ahead of a llama-server configuration; with -md, only if llama-server did
    draft (its timings' draft_n: the pinned build loads -md and drafts nothing without --spec-type)."""
    goal = {"goal": f"{set_name}: constrained auto ahead of {server}", "pass": auto > theirs,
            "detail": f"{auto:.2f} t/s against {theirs:.2f} t/s ({auto / theirs:.2f}x)"}
    if server == SERVER_MD:
        mine = [r for r in served if r["set"] == set_name and r["config"] == server]
        drafted, accepted = total(mine, "n_drafted"), total(mine, "n_accept")
        goal["detail"] += f"; llama-server drafted {drafted:.0f} tokens, accepted {accepted:.0f}"
        if not drafted:
            goal["pass"] = None  # not a speculative run: nothing to compare with
    return goal


def goals(rows: list[dict], cost_rows: list[dict], runs: list[dict], served: list[dict]) -> list[dict]:
    out = []
    for c in cost_rows:
        held = c["rule"] != "rejection, draft model"
        out.append({"goal": f"{c['set']}: the constraint alone costs under 5% of decode speed, {c['rule']}",
                    "pass": c["cost"] < GOAL_COST if held else None,
                    "detail": f"time per token {100 * c['cost']:+.1f}% ({c['ms_per_token_unconstrained']:.2f} -> "
                              f"{c['ms_per_token_constrained']:.2f} ms); the grammar's checks "
                              f"{c['grammar_ms_per_token']:.3f} ms/token, {100 * c['grammar_share']:.1f}% of decode"})
    for set_name in dict.fromkeys(r["set"] for r in runs):
        out.append(forced_goal(runs, set_name))
        speed = {r["config"]: r["mean_tps"] for r in rows if r["set"] == set_name and r["mode"] == "greedy"}
        for server in (SERVER_C, SERVER_MD):
            if speed.get(server) and speed.get(AUTO):
                out.append(server_goal(served, set_name, server, speed[AUTO], speed[server]))
    return out


def print_tables(rows: list[dict], cost_rows: list[dict], found: list[dict]) -> None:
    print("| set | decoding | config | runs | tokens | mean t/s | vs constrained target-only | kind (a) | "
          "kind (b) accepted (drafted) | grammar ms/token | grammar share of decode | valid JSON | "
          "same text as constrained target-only |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['set']} | {r['mode']} | {r['config']} | {r['runs']} | {r['tokens']:.0f} | "
              f"{opt(r['mean_tps'], '.2f')} | {opt(r['speedup'], '.2f', 'x')} | {100 * r['kind_a_share']:.1f}% | "
              f"{100 * r['kind_b_share']:.1f}% ({r['kind_b_accepted']:.0f}/{r['kind_b_drafted']:.0f}) | "
              f"{r['grammar_ms_per_token']:.3f} | {100 * r['grammar_share']:.1f}% | "
              f"{fraction(r['json_ok'], r['constrained'])} | {fraction(r['same_as_reference'], r['compared'])} |")
    print()
    print("| set | decoding | ms/token unconstrained | ms/token constrained | constraint's cost | "
          "grammar ms/token | grammar share of decode |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for c in cost_rows:
        print(f"| {c['set']} | {c['rule']} | {c['ms_per_token_unconstrained']:.2f} | "
              f"{c['ms_per_token_constrained']:.2f} | {100 * c['cost']:+.1f}% | {c['grammar_ms_per_token']:.3f} | "
              f"{100 * c['grammar_share']:.1f}% |")
    print()
    for g in found:
        print(f"{'INFO' if g['pass'] is None else 'PASS' if g['pass'] else 'FAIL'}  {g['goal']}: {g['detail']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.parser(__name__, __doc__)
    p.add_argument("-m", "--model", default="qwen2.5-coder-1.5b-instruct", help="target (path or registry name)")
    p.add_argument("-md", "--model-draft", dest="draft", default="qwen2.5-coder-0.5b-instruct",
                   help="draft model (path or registry name)")
    p.add_argument("-n", "--n-predict", type=int, default=160, help="most tokens per answer (default 160)")
    harness.add_threads(p)
    p.add_argument("--limit", type=int, help="only the first N requests of each set")
    p.add_argument("--seed", type=int, default=2026, help="the sampled runs' seed (default 2026)")
    p.add_argument("--no-llama-server", action="store_true", help="skip the llama-server runs")
    harness.add_output(p, "the raw runs, summary and goals")
    return harness.parse(p, argv)


def write(bench: argparse.Namespace, requests: list[Request], runs: list[dict], served: list[dict],
          **summary) -> None:
    """-o's JSON (nothing without -o): the raw runs, and the summary once there is one."""
    if not bench.output:
        return
    args = {k: str(v) if isinstance(v, Path) else v for k, v in vars(bench).items()}
    harness.write(bench.output, {
        "meta": harness.meta(model=bench.model, draft=bench.draft, threads=bench.threads, ctx=CTX,
                             n_predict=bench.n_predict, temp=TEMP, seed=bench.seed, requests=[r.id for r in requests],
                             llama_server=args["llama_server"], GGML_CPU_TILED_MM=os.environ.get("GGML_CPU_TILED_MM")),
        "args": args, "runs": runs, "llama_server": served, **summary})


def resolved(model: str) -> tuple[Path, str]:
    """A model's file (harness.model_file) and the name it loads under: its file's for a path, else
    the registry name given."""
    path = harness.model_file(model)
    return path, path.name if Path(model).is_file() else model


def main(argv: list[str] | None = None) -> int:
    bench = parse_args(argv)
    bench.target_path, bench.target_name = resolved(bench.model)
    bench.draft_path, bench.draft_name = resolved(bench.draft)
    bench.llama_server = None if bench.no_llama_server else llama_server_binary()
    requests = load_requests(bench.limit)
    with tempfile.TemporaryDirectory(prefix="bench-structured-") as tmp, contextlib.ExitStack() as stack:
        servers = {} if bench.no_llama_server else start_servers(bench, Path(tmp), stack)
        runs, served = run_all(bench, requests, servers)
    rows, cost_rows = summarise(runs, served), costs(runs)
    found = goals(rows, cost_rows, runs, served)
    print_tables(rows, cost_rows, found)
    write(bench, requests, runs, served, summary=rows, costs=cost_rows, goals=found)
    return 0
