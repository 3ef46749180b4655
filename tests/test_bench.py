"""speculate bench: its pure helpers, and one small real run."""

from __future__ import annotations

import json

import pytest

from speculative import bench
from speculative.bench import expects_identity, load_prompts, make_configs, parse_sweeps
from speculative.errors import UsageError
from speculative.settings import DRAFT_MAX_AUTO, SamplerSettings, SpecSettings
from tests.conftest import SMOL, speculate


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
def test_a_small_real_bench(model_path, batch_invariant, tmp_path):
    smol = str(model_path(SMOL))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "repeat", "category": "copy", "messages": [{"role": "user", "content": '
                       '"Repeat exactly: the cat sat on the mat and the dog sat on the log."}]}\n'
                       '{"id": "count", "category": "complete", "prompt": "1, 2, 3, 4,"}\n')
    out = tmp_path / "r.json"
    proc = speculate("bench", str(prompts), "-m", smol, "-md", smol, "-C", "draft", "-C", "ngram-simple,draft",
                     "-C", "auto", "-n", "24", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    configs = {r["config"] for r in report["runs"]}
    assert configs == {"target only", "draft", "ngram-simple,draft", "auto"}
    assert len(report["runs"]) == 2 * 4
    assert all(r["mismatch"] is None for r in report["runs"])  # sample-and-match + invariant build
    baseline = [r for r in report["runs"] if r["config"] == "target only"]
    assert all(r["speedup"] == 1.0 and r["baseline_drift"] > 0 for r in baseline)
    # the noise-free figure: target only is 1.0 by construction; SmolLM2 drafting for itself
    # accepts everything, so its modelled time is below target-only's at the calibrated costs
    assert all(r["modelled_speedup"] == pytest.approx(1.0) for r in baseline)
    drafted = [r for r in report["runs"] if r["config"] == "draft" and r["n_accept"] > 0]
    assert drafted and all(r["modelled_speedup"] > 0 for r in drafted)
    rows = {(r["category"], r["config"]) for r in report["summary"]}
    assert ("all", "auto") in rows and ("copy", "draft") in rows
    assert "speedup per configuration" in proc.stdout.decode()
    again = speculate("bench", str(prompts), "-m", smol, "-o", str(out))
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
