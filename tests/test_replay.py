"""scripts/replay_auto.py and scripts/replay.py on a bench file built by hand: the bound's
plan, the best class policy and the continuation shares worked out below, and auto replayed
through the real loop checked for what must hold. No model."""

from __future__ import annotations

import gzip
import json

import pytest

from scripts import replay_auto
from scripts.replay import replay
from speculative.decoding.events import Done, Step, Token
from speculative.decoding.settings import SpecSettings
from speculative.engine import bench

# The prompt: a passage A = 1..12, ten tokens of filler 30..39, a passage B = 20..27.
PROMPT = [*range(1, 13), *range(30, 40), *range(20, 28)]
# The output (20 tokens): a new token, A copied whole (positions 1-12), a new token, the first
# four tokens of B (positions 14-17), two new tokens.
OUTPUT = [50, *range(1, 13), 51, 20, 21, 22, 23, 52, 53]
# v(b) = 1 + (b - 1) / 4 seconds, exact in binary: verifying k drafted tokens costs 1 + k/4.
VERIFY = [1 + k / 4 for k in range(17)]

# ngram-simple (n = 3) proposes at output position i what followed an earlier occurrence of
# the context's last 3 tokens (output[i-3:i] once i >= 3):
#   i = 4..13: (i-3, i-2, i-1) is A's, found in the prompt: the proposal is the prompt from A's
#       token i on, and the output goes on with it for 13 - i tokens (to A's end at 12): the match
#       is 9 at i = 4, 8 at 5, ..., 1 at 12, 0 at 13 (the output has 51 where the prompt has 30).
#       Its class: at 4 the matching context is the 3-gram alone (short, 0); from 5 on it resumes
#       the passage the proposal before came from (resumed, 3) until the matching context
#       reaches 8 tokens at i = 9 (medium, 1, through 13).
#   i = 17: (20, 21, 22) is B's: the proposal is 23, 24, ...; the match is 1 (then 52). Short
#       (0): the context before B does not match, and B lies over 8 tokens away from where A's
#       copy would have gone on (ALIGNED_SLACK), so it does not resume A.
#   i = 18: (21, 22, 23): resumed (3), match 0.
#   no proposal at 0-3, 14-16 (the 3-grams ending in 50, 51 or B's first two tokens are new) and 19.
# The run before a position (the proposals right before it, first token right, in a row):
#   0 at 4, 1-3 at 5-7, 4 at 8, 5-7 at 9-11, 8 at 12, 9 at 13; 0 at 17 (14-16 had none), 1 at 18.
MATCHES = {i: 13 - i for i in range(4, 14)} | {17: 1, 18: 0}


def bench_json(tmp_path, *, output=OUTPUT, n_predict=len(OUTPUT), auto_plans=None, draft_cost=None,
               auto_tokens=None, name="bench.json"):
    """A bench file as cli/bench.py writes it, with the fields the replay reads: one prompt, one
    target-only run and one auto run (its plan given, or plain decoding all along)."""
    plans = auto_plans or [{"drafter": "none", "k": 0, "steps": len(output)}]

    def run(config, **fields):
        return {"prompt": "copy", "category": "edit", "config": config, "repeat": 0, "n_predict": len(output),
                "decode_tps": 1.0, "tokens": list(output), "modelled_speedup": 1.0, "ngram_bound": None,
                "plans": [{"drafter": "none", "k": 0, "steps": len(output)}], **fields}

    meta = {"date": "by hand", "target": {"name": "by hand"}, "draft": None,
            "settings": {"n_predict": n_predict, "temp": 0.0, "repeat": 1},
            "costs": {"target": VERIFY}, "prompt_tokens": {"copy": PROMPT}}
    if draft_cost is not None:
        meta["draft"] = {"name": "draft by hand"}
        meta["costs"]["draft"] = [draft_cost]
    runs = [run(bench.BASELINE, ngram_bound=bench.ngram_bound(PROMPT, list(output), VERIFY)),
            run("auto", plans=plans, modelled_speedup=1.25, tokens=auto_tokens or list(output))]
    path = tmp_path / name
    path.write_text(json.dumps({"meta": meta, "summary": [], "runs": runs}))
    return path


def analysed(tmp_path, **kwargs) -> replay_auto.PromptReport:
    file = replay_auto.BenchFile(bench_json(tmp_path, **kwargs))
    return replay_auto.analyse(file, "copy", 0)


def test_the_proposals_at_every_position_as_worked_out():
    at = replay_auto.positions(OUTPUT, bench.ngram_proposals(PROMPT, OUTPUT, len(VERIFY) - 1))
    assert {i: p.match for i, p in enumerate(at) if p.length} == MATCHES
    assert [at[i].kind for i in (4, 5, 8, 9, 13, 17, 18)] == [0, 3, 3, 1, 1, 0, 3]
    assert [at[i].run for i in (4, 5, 7, 8, 12, 13, 17, 18)] == [0, 1, 3, 4, 8, 9, 0, 1]
    # a policy's cells: the class, and the run in buckets 0, 1-3, 4-7, 8+
    assert [replay_auto.cell(at[i]) for i in (4, 5, 7, 8, 11, 12, 17, 18)] == [
        (0, 0), (3, 1), (3, 1), (3, 2), (1, 2), (1, 3), (0, 0), (3, 1)]


def test_the_bound_and_its_plan():
    # Within a copy, drafting all of the proposal's match m at once costs 1 + m/4 for m + 1
    # tokens (the bonus is the copy's first wrong token), and anything else costs more: fewer
    # leave tokens to a later step at 1 each or more, more are rejected at 1/4 each. So:
    #   positions 0-3 plain: 4 s; at 4 draft 9 (all accepted, the bonus 51 at 13): 1 + 9/4 = 3.25 s;
    #   14-16 plain: 3 s; at 17 draft 1 (accepted, bonus 52 at 18): 1.25 s; 19 plain: 1 s.
    # 12.5 s for 20 tokens, against 20 s alone: 1.6x, in 10 steps.
    proposals = [d.tokens for d in bench.ngram_proposals(PROMPT, OUTPUT, len(VERIFY) - 1)]
    cost, choice = bench.bound_plan(OUTPUT, proposals, VERIFY)
    assert cost == 12.5
    assert bench.ngram_bound(PROMPT, OUTPUT, VERIFY) == 1.6
    steps = replay_auto.walk(len(OUTPUT), choice, replay_auto.positions(OUTPUT, bench.ngram_proposals(
        PROMPT, OUTPUT, len(VERIFY) - 1)))
    assert steps == [(0, 0, 0), (1, 0, 0), (2, 0, 0), (3, 0, 0), (4, 9, 9), (14, 0, 0), (15, 0, 0), (16, 0, 0),
                     (17, 1, 1), (19, 0, 0)]


def test_the_best_class_policy_in_hindsight(tmp_path):
    # Both copies start with a short proposal after a run of 0 (the class policy's cell (0, 0)):
    # the bound drafts 9 at A's start and 1 at B's, a policy the same k at both, capped at
    # B by the output's end (at most 20 - 17 - 1 = 2 there). With a = that k:
    #   a = 9: 4 + (1 + 9/4) = 7.25 s to 13, then 14-16 plain 3, at 17 k = 2 (one accepted)
    #          1.5, 19 plain 1: 5.5 s. 12.75 s in all: 20 / 12.75 = 1.5686x.
    #   a = 1: A costs 4 + 1.25 + (at 6, the best: its match 7 at once, 2.75) = 8, B 3 + 1.25 + 1
    #          = 5.25: 13.25. a = 0: 4 + 1 + (at 5, 8 at once: 3) = 8, B 6 or more: 14 or more.
    #   a = 2..8: A 8 (land inside the copy, draft the rest at once), B 5.5: 13.5.
    #   a >= 10: A 5 + a/4 >= 7.5, B 5.5: 13 or more.
    # Best: a = 9, whatever the other cells say (no step starts in them then): 1.5686x, which is
    # (20/12.75 - 1) / (1.6 - 1) = 94.8% of the bound's gain.
    report = analysed(tmp_path)
    assert report.policy.policy[(0, 0)] == 9
    assert report.policy.speedup == pytest.approx(20 / 12.75)
    assert replay_auto.share(report.policy.speedup, report.bound) == pytest.approx((20 / 12.75 - 1) / 0.6)
    assert "coordinate descent over the 5 kinds" in report.policy.search


def test_the_continuation_shares():
    # First token right: 4-12 (matches 9 down to 1) and 17 (1): 10 proposals. With 4 output
    # tokens left to run on over (positions up to 16): 4-12, of which 4-9 (matches 9-4) ran to 4:
    # 6 of 9. With 8 left (up to 12): 4-12 again, of which 4 and 5 (9 and 8) ran to 8: 2 of 9.
    at = replay_auto.positions(OUTPUT, bench.ngram_proposals(PROMPT, OUTPUT, len(VERIFY) - 1))
    assert replay_auto.continuation([at]) == {"first_right": 10, "ran_4": 6, "of_4": 9, "share_4": 6 / 9,
                                               "ran_8": 2, "of_8": 9, "share_8": 2 / 9}


def test_auto_replayed_drafts_the_copy_only_where_proposals_are_and_its_time_is_its_steps(tmp_path):
    report = analysed(tmp_path)
    (auto,) = report.autos
    assert auto.same_output and auto.stopped_at is None
    # the steps cover the output: each moves past its accepted tokens and the bonus
    assert sum(a + 1 for _, _, _, a in auto.steps) == len(OUTPUT)
    assert [i for i, *_ in auto.steps] == [0, *(i + a + 1 for i, _, _, a in auto.steps[:-1])]
    drafted = [(i, k, a) for i, d, k, a in auto.steps if k]
    assert all(i in MATCHES for i, _, _ in drafted)  # never where no proposal exists
    assert all(a == min(k, MATCHES[i]) for i, k, a in drafted)  # accepted as far as the output goes on
    # It drafts on the copied passage A once its estimates allow, and gains by it.
    assert any(4 <= i < 13 and a for i, _, a in drafted)
    assert 1.0 < auto.modelled <= report.bound
    # Its modelled time is its steps' calibrated costs, and the modelled speedup bench's figure.
    assert auto.seconds == sum(VERIFY[k] for _, _, k, _ in auto.steps)
    assert auto.modelled == pytest.approx(len(OUTPUT) * VERIFY[0] / auto.seconds)
    assert sum(auto.plans.values()) == len(auto.steps)
    # What auto saw at each step it drafted: the proposal it drafted from, and an estimate.
    for i, k, _ in drafted:
        length, kind, estimate = auto.seen[i]["ngram-simple"]
        assert length >= k and 0.0 < estimate < 1.0


def test_an_output_ended_by_end_of_generation_is_replayed_to_it(tmp_path):
    """Bench counts such a run's end-of-generation token as one more target pass."""
    report = analysed(tmp_path, n_predict=32)
    (auto,) = report.autos
    assert report.prompt.stopped and auto.same_output
    assert auto.modelled == pytest.approx((len(OUTPUT) + 1) * VERIFY[0] / auto.seconds)


def test_the_replay_backend_without_a_drafter_is_target_only_decoding():
    events, seconds = replay(PROMPT, OUTPUT, True, VERIFY, SpecSettings(n_predict=32), None, eog=99)
    assert [e.id for e in events if isinstance(e, Token)] == OUTPUT
    assert [e.n_drafted for e in events if isinstance(e, Step)] == [0] * (len(OUTPUT) + 1)  # the last: EOG
    assert seconds == (len(OUTPUT) + 1) * VERIFY[0]
    assert isinstance(events[-1], Done) and events[-1].reason == "stop" and events[-1].t_decode == seconds


def test_the_draft_model_is_declined_where_it_cannot_pay_and_stops_the_replay_where_it_could(tmp_path):
    # A draft token as dear as a target pass: even all accepted, k drafted cost k + 1 + k/4 for
    # k + 1 tokens, slower than plain decoding.
    (declined,) = analysed(tmp_path, draft_cost=1.0).autos
    assert "draft" in declined.drafters and "draft" in declined.declined and declined.stopped_at is None
    assert declined.modelled > 1.0
    # A draft token at 1/100 of a pass: auto tries the model at once, which the file cannot replay.
    (tried,) = analysed(tmp_path, draft_cost=0.01, name="cheap.json").autos
    assert tried.stopped_at == 0


def test_later_prompts_draft_from_the_pool_of_earlier_outputs_as_in_bench(tmp_path):
    """Bench adds each prompt's target-only output to the pool after its runs: the second prompt,
    whose output is the first's and copies nothing of its own prompt, drafts it from the pool."""
    path = bench_json(tmp_path)
    data = json.loads(path.read_text())
    data["meta"]["prompt_tokens"]["second"] = [90, 91, 92]
    data["runs"] += [{**r, "prompt": "second", "ngram_bound": 1.0 if r["ngram_bound"] else None} for r in data["runs"]]
    path.write_text(json.dumps(data))
    file = replay_auto.BenchFile(path)
    assert len(file.pool_before("copy", 1000)) == 0 and file.pool_before("second", 1000).outputs[0] == OUTPUT
    first, second = (replay_auto.analyse(file, pid, 1000) for pid in ("copy", "second"))
    assert first.autos[0].drafters == ["ngram-simple"]
    assert second.autos[0].drafters == ["ngram-simple", "ngram-pool"] and second.bound == 1.0
    assert any(d == "ngram-pool" and a for _, d, _, a in second.autos[0].steps)
    (alone,) = replay_auto.analyse(file, "second", 0).autos  # --pool-tokens 0: as bench without a pool
    assert alone.drafters == ["ngram-simple"] and alone.modelled == 1.0


def test_plan_agreement_counts_the_steps_in_common():
    replayed = {("none", 0): 10, ("ngram-simple", 3): 2}
    run = {("none", 0): 12, ("ngram-simple", 3): 1}
    assert replay_auto.plan_agreement(replayed, run) == 11 / 13  # 10 + 1 in common, of 12 and 13 steps


def test_the_script_prints_and_writes_the_figures(tmp_path, capsys):
    path = bench_json(tmp_path, auto_plans=[{"drafter": "none", "k": 0, "steps": 8},
                                            {"drafter": "ngram-simple", "k": 3, "steps": 4}])
    out = tmp_path / "replay.json"
    assert replay_auto.main([str(path), "--pool-tokens", "0", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    figures = json.loads(out.read_text())
    assert figures["meta"]["bench_file"] == "bench.json" and figures["meta"]["verify_costs"] == VERIFY
    (prompt,) = figures["prompts"]
    (auto,) = prompt["auto"]
    assert prompt["ngram_bound"] == 1.6 and prompt["ngram_bound_agrees"] is True
    assert prompt["bound_steps"] == [{"position": 4, "k": 9, "accepted": 9}, {"position": 17, "k": 1, "accepted": 1}]
    assert prompt["policy"]["speedup"] == pytest.approx(20 / 12.75)
    (edit,) = figures["categories"]
    assert edit["continuation"]["share_4"] == 6 / 9 and edit["continuation"]["share_8"] == 2 / 9
    assert edit["policy"]["speedup"] == pytest.approx(20 / 12.75)
    assert "n-gram bound 1.600x (the file's: 1.600x: agree)" in text
    assert "bound's plan: 10 steps, drafting at 4 (k=9, 9 accepted), 17 (k=1, 1 accepted)" in text
    assert f"modelled {auto['modelled_speedup']:.3f}x" in text
    assert "in the file, repeat 0: modelled 1.250x" in text
    assert "best class policy in hindsight: 1.569x (95% of the bound's gain)" in text
    assert "67% ran on to 4 tokens (6 of 9 with 4 output tokens left), 22% ran on to 8 tokens" in text
    assert "every run of every prompt has its prompt's target-only output (2 runs)" in text


def test_a_gzipped_bench_file_is_read_as_it_is_committed(tmp_path, capsys):
    path = bench_json(tmp_path)
    packed = tmp_path / "bench.json.gz"
    packed.write_bytes(gzip.compress(path.read_bytes()))
    assert replay_auto.main([str(path)]) == 0
    plain = capsys.readouterr().out
    assert replay_auto.main([str(packed)]) == 0
    assert capsys.readouterr().out == plain.replace(str(path), str(packed))


def test_runs_whose_output_differs_are_named_and_a_bound_recorded_with_other_costs_is_told(tmp_path, capsys):
    path = bench_json(tmp_path, auto_tokens=[*OUTPUT[:-1], 54])
    data = json.loads(path.read_text())
    data["runs"][0]["ngram_bound"] = 1.5  # bench measured the calibration again after this run
    path.write_text(json.dumps(data))
    assert replay_auto.main([str(path)]) == 0
    text = capsys.readouterr().out
    assert "outputs: 1 prompt with runs whose output is not the target-only one" in text
    assert "1 run with another output than target-only's: auto (repeat 0)" in text
    assert "n-gram bound 1.600x (the file's: 1.500x: DIFFER)" in text


@pytest.mark.parametrize("content, message", [
    ("{not json", "not JSON (Expecting property name"),
    (b"\x1f\x8b not gzip", "not JSON (gzipped)"),
    (None, "cannot read it (No such file or directory)"),
    ('{"meta": {}, "runs": []}', "no meta.costs or meta.prompt_tokens"),
    ('{"runs": []}', "not a speculate bench file"),
    ('{"meta": {"costs": {"target": [1, 2]}, "prompt_tokens": {}, "settings": {}}, "runs": []}',
     "without a field the replay reads"),
])
def test_a_file_the_replay_cannot_use_is_one_line_and_exit_2(tmp_path, capsys, content, message):
    path = tmp_path / ("bad.json.gz" if isinstance(content, bytes) else "bad.json")
    if content is not None:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert replay_auto.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("replay_auto: error: ")


def test_an_unknown_prompt_or_category_is_refused(tmp_path, capsys):
    path = bench_json(tmp_path)
    assert replay_auto.main([str(path), "--prompt", "nope"]) == 2
    assert "no prompt 'nope' (prompts: copy)" in capsys.readouterr().err
    assert replay_auto.main([str(path), "--category", "chat"]) == 2
    assert "no category 'chat' (categories: edit)" in capsys.readouterr().err
