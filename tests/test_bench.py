"""speculate bench: its pure helpers, and one small real run."""

from __future__ import annotations

import json

import pytest

from speculative.decoding.settings import DRAFT_MAX_AUTO, SamplerSettings, SpecSettings
from speculative.engine import bench
from speculative.engine.bench import expects_identity, load_prompts, make_configs, parse_sweeps
from speculative.errors import UsageError
from tests.conftest import speculate
from tests.tiny_model import write_model


def test_prompts_accept_text_or_chat_messages(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "category": "x", "prompt": "hi"}\n\n'
                    '{"messages": [{"role": "user", "content": "yo"}]}\n')
    a, b = load_prompts(path)
    assert (a.id, a.category, a.prompt) == ("a", "x", "hi")
    assert (b.id, b.category, b.messages[0]["content"]) == ("line-3", "all", "yo")


@pytest.mark.parametrize("line, message", [
    ("{not json", ":1: not JSON"),
    ('{"prompt": "x", "n": ' + "9" * 5000 + "}", ":1: not JSON"),
    ("[" * 100_000, ":1: not JSON"),
    ('{"prompt": 3}', ":1: needs a string `prompt`"),
    ('{"messages": [{"role": "user"}]}', ":1: needs a string `prompt`"),
])
def test_bad_prompt_lines_name_the_line(tmp_path, line, message):
    path = tmp_path / "p.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(UsageError, match=message):
        load_prompts(path)


def test_sweeps_make_a_grid_and_auto_keeps_its_own_cap():
    grid = parse_sweeps(["draft-max=1,4", "ngram-n=2,3"])
    configs = make_configs(["ngram-simple", "auto"], grid, SpecSettings(n_predict=16))
    labels = [c.label for c in configs]
    assert labels == ["target only",
                      "ngram-simple draft-max=1 ngram-n=2", "ngram-simple draft-max=1 ngram-n=3",
                      "ngram-simple draft-max=4 ngram-n=2", "ngram-simple draft-max=4 ngram-n=3",
                      "auto ngram-n=2", "auto ngram-n=3"]
    assert configs[0].spec.types == ("none",)
    assert configs[1].spec.draft_max == 1 and configs[1].spec.ngram_simple.n == 2
    assert configs[-1].spec.draft_max == DRAFT_MAX_AUTO and configs[-1].spec.ngram_map_k.n == 3


def test_tree_sweeps_size_the_draft_trees():
    configs = make_configs(["draft"], parse_sweeps(["np=1,3", "p-split=0.05"]), SpecSettings(n_predict=16))
    assert [(c.spec.branches, c.spec.p_split) for c in configs[1:]] == [(1, 0.05), (3, 0.05)]
    with pytest.raises(UsageError, match="draft trees come from a draft model"):
        make_configs(["ngram-simple"], parse_sweeps(["np=2"]), SpecSettings(n_predict=16))


@pytest.mark.parametrize("sweep", ["draft-max", "nope=1", "draft-max=a"])
def test_bad_sweeps_are_usage_errors(sweep):
    with pytest.raises(UsageError):
        parse_sweeps([sweep])


@pytest.mark.real
def test_a_small_real_bench(batch_invariant, tmp_path):
    """On the tiny llama of tests/tiny_model.py, as target and as its own draft (it accepts
    every drafted token, and never ends early: its end-of-text row is zero): 12 runs in about
    a second here, so that no load on the machine brings them near the command's timeout
    (SmolLM2 took over 600 s with both cores busy)."""
    tiny = str(write_model("llama", tmp_path / "tiny.gguf"))
    env = {"SPECULATE_HOME": str(tmp_path)}  # its own calibration
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "repeat", "category": "copy", "messages": [{"role": "user", "content": '
                       '"Repeat exactly: the cat sat on the mat and the dog sat on the log."}]}\n'
                       '{"id": "count", "category": "complete", "prompt": "1, 2, 3, 4,"}\n')
    out = tmp_path / "r.json"
    proc = speculate("bench", str(prompts), "-m", tiny, "-md", tiny, "-C", "draft", "-C", "ngram-simple,draft",
                     "-C", "auto", "-n", "24", "-t", "1", "-o", str(out), env=env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    configs = {r["config"] for r in report["runs"]}
    assert configs == {"target only", "draft", "ngram-simple,draft", "auto"}
    assert len(report["runs"]) == 2 * 4
    assert all(r["mismatch"] is None for r in report["runs"])  # sample-and-match + invariant build
    baseline = [r for r in report["runs"] if r["config"] == "target only"]
    assert all(r["speedup"] == 1.0 and r["baseline_drift"] > 0 for r in baseline)
    # the noise-free figure: target only is 1.0 by construction; what it is for drafted runs
    # depends on this machine's calibration (its arithmetic: the unit tests below)
    assert all(r["modelled_speedup"] == pytest.approx(1.0) for r in baseline)
    drafted = [r for r in report["runs"] if r["config"] == "draft"]
    assert len(drafted) == 2 and all(r["n_accept"] == r["n_drafted"] > 0 and r["modelled_speedup"] > 0
                                     for r in drafted)
    rows = {(r["category"], r["config"]) for r in report["summary"]}
    assert ("all", "auto") in rows and ("copy", "draft") in rows
    assert "speedup per configuration" in proc.stdout.decode()
    again = speculate("bench", str(prompts), "-m", tiny, "-o", str(out), env=env)
    assert again.returncode == 2 and "never overwrites" in again.stderr


def test_only_runs_that_must_reproduce_the_baseline_are_compared():
    greedy, sampled = SamplerSettings(temp=0.0), SamplerSettings(temp=0.7)
    assert expects_identity(SpecSettings(), greedy)
    assert expects_identity(SpecSettings(accept="match"), sampled)
    assert not expects_identity(SpecSettings(accept="rejection"), sampled)


def test_categories_are_judged_by_each_prompts_median_over_its_repeats():
    def run(prompt, speedup):
        return bench.Run(prompt, "edit", "auto", 0, 128, 20.0, speedup=speedup, modelled_speedup=speedup)

    # one bad run of prompt a and one of b (noise); c is slow every time
    runs = [run("a", s) for s in (1.2, 0.7, 1.1)] + [run("b", s) for s in (1.0, 1.05, 0.6)] + \
        [run("c", s) for s in (0.95, 0.9, 0.92)]
    row = next(r for r in bench.summarize(runs) if r["category"] == "edit")
    assert row["median_speedup"] == 1.0 and row["min_speedup"] == 0.92  # medians 1.1, 1.0, 0.92
    assert row["median_modelled_speedup"] == 1.0 and row["min_modelled_speedup"] == 0.92


def test_each_repeat_runs_the_configurations_from_another_place(monkeypatch):
    ran = []

    def fake_run(engine, tokens, config, sampling, seed, prompt, repeat):
        ran.append((repeat, config.label))
        return [7], bench.Run(prompt.id, prompt.category, config.label, repeat, 1, 10.0)

    monkeypatch.setattr(bench, "_run", fake_run)
    monkeypatch.setattr(bench, "prompt_tokens", lambda engine, prompt: [1])
    monkeypatch.setattr(bench, "ngram_bound", lambda *args: 1.0)
    engine = type("Engine", (), {"costs": lambda self, role, n: [0.05] * n})()
    baseline, *rest = [bench.Config(name, SpecSettings()) for name in ("target only", *"abcdef")]
    prompt = bench.BenchPrompt("p", "c", prompt="x")
    runs = bench._prompt_runs(engine, prompt, baseline, rest, SamplerSettings(temp=0.0), 1, 3, None)
    orders = [[label for r, label in ran if r == repeat and label != "target only"] for repeat in range(3)]
    assert orders == [list("abcdef"), list("cdefab"), list("efabcd")]
    places = {label: {order.index(label) // bench.BASELINE_EVERY for order in orders} for label in "abcdef"}
    assert all(len(blocks) == 3 for blocks in places.values())  # each in a different block every repeat
    assert [label for r, label in ran if r == 0] == ["target only", "a", "b", "target only", "c", "d",
                                                    "target only", "e", "f", "target only"]
    assert sorted(r.config for r in runs) == sorted(["target only"] * 3 + list("abcdef") * 3)
    assert all(r.speedup == 1.0 for r in runs)  # every run as fast as the target-only runs around it


def test_a_prompt_the_target_answers_with_nothing_is_left_out_and_said(monkeypatch):
    """A model that ends at once (its first token is the end) has no decode speed to divide by."""
    ran, said = [], []

    def fake_run(engine, tokens, config, sampling, seed, prompt, repeat):
        ran.append(config.label)
        return [], bench.Run(prompt.id, prompt.category, config.label, repeat, 0, 0.0)

    monkeypatch.setattr(bench, "_run", fake_run)
    monkeypatch.setattr(bench, "prompt_tokens", lambda engine, prompt: [1])
    engine = type("Engine", (), {"notify": staticmethod(said.append)})()
    baseline, *rest = [bench.Config(name, SpecSettings()) for name in ("target only", "a")]
    runs = bench._prompt_runs(engine, bench.BenchPrompt("poem", "c", prompt="x"), baseline, rest,
                              SamplerSettings(temp=0.0), 1, 2, None)
    assert runs == [] and ran == ["target only"]
    assert said == ["bench: poem: the target's answer is empty, so it has no speed to compare; left out"]


class Calibrated:
    """What modelled_speedup reads of an engine: calibrated costs by role, nothing else (a role
    not given is a model the engine did not load: asking for its costs is an error)."""

    def __init__(self, **costs: list[float]):
        self._costs = costs

    def costs(self, role: str, max_batch: int) -> list[float]:
        return self._costs[role][:max_batch]


def test_the_modelled_speedup_prices_each_step_at_calibrated_costs():
    engine = Calibrated(target=[0.010, 0.012, 0.014, 0.020], draft=[0.002], mtp=[0.001])
    plans = {("none", 0): 10, ("ngram-simple", 3): 5, ("draft", 2): 4, ("draft-mtp", 1): 3}
    # 10 plain steps:             10 x v(1) = 10 x 10 ms              = 100 ms
    # 5 n-gram drafts of 3:        5 x v(4) =  5 x 20 ms (lookups free) = 100 ms
    # 4 draft-model drafts of 2:   4 x (v(3) + 2 x 2 ms) = 4 x 18 ms   =  72 ms
    # 3 MTP drafts of 1:           3 x (v(2) + 1 x 1 ms) = 3 x 13 ms   =  39 ms   -> 311 ms
    # the same 44 tokens target-only: 44 passes x 10 ms = 440 ms      -> 440 / 311
    assert bench.modelled_speedup(engine, plans, 44) == pytest.approx(440 / 311)
    # without a draft model or a head, only the target is asked: 4 x 10 + 3 x v(3) = 82 ms
    # for 4 + 3 x 3 = 13 tokens (every draft accepted), 130 ms alone
    only_target = Calibrated(target=[0.010, 0.012, 0.014])
    assert bench.modelled_speedup(only_target, {("none", 0): 4, ("ngram-simple", 2): 3}, 13) == pytest.approx(130 / 82)
    assert bench.modelled_speedup(only_target, {("none", 0): 13}, 13) == pytest.approx(1.0)  # target only
    assert bench.modelled_speedup(only_target, {}, 0) == 0.0  # a run that made no step


@pytest.mark.parametrize("verify, cost", [
    # v(1), v(2), v(3): the DP below, by hand, gives cost[0] (target-only: 5 x v(1) = 5)
    ([1.0, 1.2, 1.5], 3.5),  # drafts of 2 pay: the best plan drafts [7, 8] at output position 2
    ([1.0, 1.2, 2.5], 4.2),  # the draft of 2 at position 2 costs more than a draft of 1 at 3 and a plain step
    ([1.0, 2.5, 3.0], 5.0),  # no draft beats plain decoding: the bound is 1.0
])
def test_the_ngram_bound_is_the_best_plan_knowing_the_output(verify, cost):
    """Output [5, 6, 7, 8, 1] after the prompt [5, 6, 7, 8], bigram lookup (n = 2), at most
    len(verify) - 1 = 2 drafted tokens. What ngram-simple proposes before output position i:
      i = 0, 1: nothing (the last bigrams (7, 8), (8, 5) occur nowhere earlier);
      i = 2: after (5, 6), [7, 8]: both right (output[2:4] = 7, 8);
      i = 3: after (6, 7), [8, 5]: only 8 right (output[4] = 1); and with one token left after
             it, at most 1 may be drafted: [8], right;
      i = 4: the last token, drafted nothing (a step must end with the target's own token).
    cost[i], the best time for output[i:], over k drafted tokens with a accepted:
      cost[5] = 0, cost[4] = v(1)
      cost[3] = min(v(1) + cost[4], v(2) + cost[5])
      cost[2] = min(v(1) + cost[3], v(2) + cost[4], v(3) + cost[5])
      cost[1] = v(1) + cost[2], cost[0] = v(1) + cost[1]
    with [1, 1.2, 1.5]: cost[3] = 1.2, cost[2] = min(2.2, 2.2, 1.5) = 1.5, cost[0] = 3.5
    with [1, 1.2, 2.5]: cost[3] = 1.2, cost[2] = min(2.2, 2.2, 2.5) = 2.2, cost[0] = 4.2
    with [1, 2.5, 3.0]: cost[3] = 2.0, cost[2] = min(3.0, 3.5, 3.0) = 3.0, cost[0] = 5.0"""
    assert bench.ngram_bound([5, 6, 7, 8], [5, 6, 7, 8, 1], verify, n=2) == pytest.approx(5 * verify[0] / cost)


def test_the_ngram_bound_leaves_the_last_token_to_the_target():
    """Output [5, 6, 7, 8]: at position 2 the proposal [7, 8] is right to the end, but a step
    yields its drafted tokens and one of the target's, so with 2 tokens left only [7] may be
    drafted: cost[3] = v(1) = 1, cost[2] = min(1 + 1, v(2) = 1.2) = 1.2, cost[0] = 2 + 1.2 = 3.2,
    against 4 passes alone."""
    assert bench.ngram_bound([5, 6, 7, 8], [5, 6, 7, 8], [1.0, 1.2, 1.5], n=2) == pytest.approx(4 / 3.2)


def test_progress_names_each_run_as_it_begins_and_the_count_is_the_runs_made(monkeypatch):
    """What `speculate bench` shows on its status line: run i of n, the configuration, the round,
    the prompt; n is what bench announces, and it is the number of timed runs."""
    ran, said = [], []

    def fake_run(engine, tokens, config, sampling, seed, prompt, repeat):
        ran.append((prompt.id, config.label, repeat))
        return [7], bench.Run(prompt.id, prompt.category, config.label, repeat, 1, 10.0)

    monkeypatch.setattr(bench, "_run", fake_run)
    monkeypatch.setattr(bench, "_warm_up", lambda *args: None)
    monkeypatch.setattr(bench, "prompt_tokens", lambda engine, prompt: [1])
    monkeypatch.setattr(bench, "ngram_bound", lambda *args: 1.0)
    engine = type("Engine", (), {"costs": lambda self, role, n: [0.05] * n, "learn": True, "pool": None})()
    configs = [bench.Config(name, SpecSettings()) for name in ("target only", "a", "b", "c")]
    prompts = [bench.BenchPrompt(name, "c", prompt="x") for name in ("p", "q")]
    bench.run_bench(engine, prompts, configs, SamplerSettings(temp=0.0), 2, progress=said.append)
    total = bench.count_runs(2, 4, 2)
    assert said[0] == "warming up: an untimed run of p" and len(said) - 1 == len(ran) == total
    assert said[1] == f"run 1/{total}: target only, round 1/2, prompt 1/2 p"
    assert said[-1] == f"run {total}/{total}: target only, round 2/2, prompt 2/2 q"
    assert [s.split(": ", 1)[1] for s in said[1:]] == [f"{c}, round {r + 1}/2, prompt {'pq'.index(p) + 1}/2 {p}"
                                                       for p, c, r in ran]
