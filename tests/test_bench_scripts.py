"""The parts of the benchmark scenarios whose output backs the README's figures: how `mtp` reads
llama.cpp's log and auto's steps, and how `flash-attn` cuts its prompts (no model: fast); where
two answers part and the margin there (divergence.py, on SmolLM2); that `structured`'s runs add
up, and that `commits` runs each commit's code and times llama_decode apart (on SmolLM2)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.bench.flash_attn import leading_lines
from scripts.bench.mtp import MARK, buffers, mtp_trail, sections
from tests.conftest import SMOL

# As llama.cpp (the pinned build) logs a model load and a context (SPECULATE_LLAMA_LOG=1).
LOAD_LOG = """\
load_tensors:   CPU_Mapped model buffer size =   628.41 MiB
llama_context:        CPU  output buffer size =     0.00 MiB
llama_kv_cache:        CPU KV buffer size =     8.00 MiB
llama_kv_cache: size =    8.00 MiB (  4096 cells,   1 layers,  1/1 seqs), K (f16):    4.00 MiB, V (f16):    4.00 MiB
llama_memory_recurrent:        CPU RS buffer size =     2.46 MiB
sched_reserve:        CPU compute buffer size =   148.02 MiB
"""
HEAD_LOG = """\
llama_kv_cache:        CPU KV buffer size =     8.00 MiB
sched_reserve:        CPU compute buffer size =   140.00 MiB
sched_reserve:       RPC0 compute buffer size =     1.50 MiB
"""
FREED = "~llama_context:        CPU compute buffer size is  148.0156 MiB, matches expectation of  148.0156 MiB\n"


def test_buffers_are_read_per_kind_from_the_log_of_each_stage():
    stderr = f"startup noise\n{MARK}load\n{LOAD_LOG}{MARK}head\n{HEAD_LOG}{MARK}end\n{FREED}"
    logs = sections(stderr)
    assert set(logs) == {"load", "head", "end"}
    assert buffers(logs["load"]) == {"model": 628.41, "output": 0.0, "KV": 8.0, "RS": 2.46, "compute": 148.02}
    assert buffers(logs["head"]) == {"KV": 8.0, "compute": 141.5}  # summed over devices
    assert buffers(logs["end"]) == {}  # a context freed reports its size, not a new buffer


def test_the_mtp_trail_counts_the_heads_steps_and_what_drafted_after_the_last():
    steps = [[None, 0, 0], ["draft-mtp", 3, 2], ["draft-mtp", 3, 0], [None, 0, 0], ["ngram-simple", 4, 1],
             ["draft-mtp", 2, 2], [None, 0, 0], ["ngram-simple", 4, 0], [None, 0, 0]]
    assert mtp_trail(steps) == {"mtp_steps": 3, "first_mtp_step": 2, "last_mtp_step": 6, "drafted_after_last_mtp": 1}
    assert mtp_trail([[None, 0, 0], ["ngram-simple", 2, 2]]) == {
        "mtp_steps": 0, "first_mtp_step": None, "last_mtp_step": None, "drafted_after_last_mtp": 1}


def test_leading_lines_comes_nearest_the_tokens_asked():
    lines = [f"line {i}\n" for i in range(10)]

    def count(text: str) -> int:
        return 3 * text.count("\n")  # three tokens a line

    assert leading_lines(lines, count, 9) == 3  # exactly 9 tokens
    assert leading_lines(lines, count, 10) == 3  # 9 is nearer than 12
    assert leading_lines(lines, count, 11) == 4  # 12 is nearer than 9
    assert leading_lines(lines, count, 1) == 1  # never no text
    assert leading_lines(lines, count, 1000) == 10  # not enough text: all of it


@pytest.mark.real
def test_divergence_finds_where_two_answers_part_and_the_margin_there(model_path):
    """Answers that part at their second token (" Paris" then "." or ","), and one that goes on
    after the other ends: the position is where their tokens part, with the target's top-2
    margin there and the gap between the two tokens' logits (None when one answer ended)."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "divergence.py"
    pairs = [{"prompt": "The capital of France is", "reference": " Paris. It is", "other": " Paris, which"},
             {"messages": [{"role": "user", "content": "Name a colour."}], "reference": "Blue", "other": "Blue."}]
    proc = subprocess.run([sys.executable, str(script), str(model_path(SMOL)), "-t", "1", "-c", "256"],
                          input=json.dumps(pairs), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    parted, ended = json.loads(proc.stdout)
    assert parted["position"] == 1 and parted["top2_margin"] >= 0 and parted["gap"] >= 0
    assert ended["position"] == 1 and ended["gap"] is None and ended["top2_margin"] >= 0


@pytest.mark.real
@pytest.mark.parametrize("kind", ["draft-eagle3", "draft-dspark", "draft-mtp x2", "gemma4-assistant"])
def test_the_drafters_scenario_measures_each_drafter_beside_its_target(kind):
    from scripts.bench.drafters import measure

    row = measure(kind, "64x4", threads=1, repeat=1)
    assert row["pass_s"] > 0 and row["per_token_s"] > 0 and row["per_token_vs_pass"] > 0
    assert row["k"] == (2 if kind == "draft-mtp x2" else 4)
    assert (row["catch_up_s"] is None) == (kind == "gemma4-assistant")


@pytest.mark.real
def test_the_structured_scenario_runs_every_configuration_and_its_counts_add_up(model_path, batch_invariant, tmp_path):
    """The structured scenario on SmolLM2 (target and draft), two requests of each set, 24 tokens, no
    llama-server: every request ran under every configuration once; the kinds of forced tokens
    fit in the answers and in what was drafted; and, on this batch-invariant build, every greedy
    text under the grammar is constrained target-only's."""
    from scripts.bench.structured import FORCED, GREEDY, REFERENCE, SAMPLED

    smol, out = str(model_path(SMOL)), tmp_path / "structured.json"
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-m", "scripts.bench", "structured", "-m", smol, "-md", smol, "--limit", "2",
                           "-n", "24", "-t", "1", "--no-llama-server", "-o", str(out)], capture_output=True, text=True,
                          cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    requests = report["meta"]["requests"]
    assert [r.split("-")[0] for r in requests] == ["extract", "extract", "logs", "logs"]
    assert report["llama_server"] == []
    configs = [("greedy", c) for c in GREEDY] + [("sampled", c) for c in SAMPLED]
    assert sorted((r["request"], r["mode"], r["config"]) for r in report["runs"]) == sorted(
        (i, mode, c.label) for i in requests for mode, c in configs)
    for r in report["runs"]:
        assert 0 < r["tokens"] <= 24 and r["finish_reason"] in ("stop", "length")
        assert r["n_certain"] + r["n_forced_accept"] <= r["tokens"]
        assert r["n_forced_accept"] <= r["n_forced_drafted"] and r["n_accept"] <= r["n_drafted"]
        assert 0 <= r["t_grammar_s"] <= r["decode_s"] and r["tps"] == pytest.approx(r["tokens"] / r["decode_s"])
        if r["config"] == FORCED:  # it drafts nothing else: every drafted token is of kind (a) or (b)
            assert r["n_drafted"] == r["n_certain"] + r["n_forced_drafted"]
            assert r["n_accept"] == r["n_certain"] + r["n_forced_accept"]
        if not r["constrained"] or r["config"].endswith("no forced"):
            assert r["n_certain"] == r["n_forced_drafted"] == 0
        assert (r["t_grammar_s"] > 0) == r["constrained"]
        if r["constrained"]:  # an end of generation is admitted only where the grammar is complete
            assert isinstance(r["json_ok"], bool) and (r["json_ok"] or r["finish_reason"] == "length")
        else:
            assert r["json_ok"] is None
        if r["mode"] == "greedy" and r["constrained"]:
            assert r["same_as_reference"] is True, (r["request"], r["config"])
    rows = {(r["set"], r["mode"], r["config"]): r for r in report["summary"]}
    assert set(rows) == {(s, mode, c.label) for s in ("extract", "logs") for mode, c in configs}
    assert all(rows[(s, "greedy", REFERENCE)]["speedup"] == pytest.approx(1.0) for s in ("extract", "logs"))
    assert len(report["costs"]) == 6 and all(g["pass"] in (True, False, None) for g in report["goals"])
    assert "| set | decoding | config |" in proc.stdout and "constraint alone" in proc.stdout


@pytest.mark.real
def test_the_commits_scenario_runs_each_commit_s_code_and_times_llama_decode_apart(model_path, tmp_path):
    """The commits scenario on SmolLM2, the working tree against HEAD (a worktree made and removed):
    every configuration ran under each commit's code (its own tree's, not the repository's the
    command was run in), the wrapper counted llama_decode's own time
    (less than the run's), the gain of -np 2 is put against the ceiling measured in the same run,
    and the table renders from what it wrote."""
    from scripts import tables

    root, out = Path(__file__).resolve().parent.parent, tmp_path / "commits.json.gz"
    worktrees = subprocess.run(["git", "-C", str(root), "worktree", "list"], capture_output=True, text=True).stdout
    smol = str(model_path(SMOL))
    proc = subprocess.run([sys.executable, "-m", "scripts.bench", "commits", ".", "HEAD", "-m", smol, "--np", "1,2",
                           "--spec-type", "none", "-n", "8", "--repeats", "1", "-t", "1", "-c", "512", "-o", str(out)],
                          capture_output=True, text=True, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert subprocess.run(["git", "-C", str(root), "worktree", "list"], capture_output=True,
                          text=True).stdout == worktrees
    report = json.loads(gzip.decompress(out.read_bytes()))
    labels = report["meta"]["commits"]
    assert len(labels) == 2 and labels[0].split()[0].rstrip("+") == labels[1]  # "hash+" or "hash (tree)"
    assert sorted((r["config"], r["commit"]) for r in report["runs"]) == sorted(
        (f"batch -np {n} none", c) for n in (1, 2) for c in labels)
    code = {r["commit"]: Path(r["code"]) for r in report["runs"]}  # each commit's runs ran its own tree's code
    assert code[labels[0]] == root / "speculative" and code[labels[1]].parent != root
    for r in report["runs"]:
        assert Path(r["code"]) == code[r["commit"]]
        assert r["n_predict"] == 8 * 8 and r["tps"] == pytest.approx(r["n_predict"] / r["seconds"])
        assert 0 < r["llama_decode_s"] < r["seconds"] and r["llama_decodes"] > 1
        assert r["outside_llama_decode_ms"] > 0
    assert [(g["n"], g["commit"]) for g in report["gains"]] == [(2, c) for c in labels]
    assert all(g["ceiling"] > 0 and g["of_ceiling"] == pytest.approx(g["gain"] / g["ceiling"])
               for g in report["gains"])
    assert tables.commits(report) == proc.stdout.strip().splitlines()[-len(tables.commits(report)):]
