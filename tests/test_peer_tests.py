"""scripts/peer_tests.py: llama.cpp's own server tests run against a server of ours.

Without a model: how the wrapper makes a test's model local (and leaves every other flag
alone), that the stand-ins cover the suite's presets, how results are read and compared, and a
whole run against a fake server (the suite copied from the sdist, the plugin, the wrapper).
With models: the tests NAMED against `speculate serve`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.peer_tests import DOWNLOADS, STAND_INS, comparison_table, read_junit, stand_in, wrapped_command
from tests.conftest import QWEN, SMOL, SPECULATE, vendored_tree

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "peer_tests.py"
CONFIG = {"server": ["/bin/server", "serve"], "paths": {SMOL: "/m/smol.gguf", QWEN: "/m/qwen.gguf"}}
# what llama.cpp checks of seeds, batch sizes and a draft model (issue 44), and of what agents and
# hosts read of an answer (issue 46): __verbose, the usage chunk, the context's error, a prefill in parts,
# the decode rate's steps, Vertex AI's /predict
NAMED = ["unit/test_completion.py::test_consistent_result_same_seed",
         "unit/test_completion.py::test_consistent_result_different_batch_size",
         "unit/test_speculative.py::test_with_and_without_draft",
         "unit/test_chat_completion.py::test_verbose_debug",
         "unit/test_chat_completion.py::test_chat_completion_with_timings_per_token",
         "unit/test_chat_completion.py::test_context_size_exceeded_stream",
         "unit/test_chat_completion.py::test_chat_template_assistant_prefill",
         "unit/test_metrics.py::test_metrics_generation_rate_excludes_first_token",
         "unit/test_compat_gcp.py"]


def test_the_model_location_becomes_a_stand_in_where_it_stood_and_every_other_flag_stays():
    args = ["--port", "8080", "--temp", "0.8", "--hf-repo", "ggml-org/test-model-stories260K",
            "--batch-size", "32", "--no-jinja"]
    assert wrapped_command(CONFIG, args) == ["/bin/server", "serve", "--port", "8080", "--temp", "0.8",
                                             "-m", "/m/smol.gguf", "--batch-size", "32", "--no-jinja"]
    split = ["-hf", "ggml-org/models", "--seed", "42", "--hf-file=tinyllamas/stories260K.gguf"]
    assert wrapped_command(CONFIG, split) == ["/bin/server", "serve", "-m", "/m/smol.gguf", "--seed", "42"]
    infill = ["--model-url", "https://example.org/ggml-org/test-model-stories260K-infill/model.gguf"]
    assert wrapped_command(CONFIG, infill)[2:] == ["-m", "/m/qwen.gguf"]
    local = ["-m", "/elsewhere/model.gguf", "--model-draft", "/m/smol.gguf", "--alias", "x"]
    assert wrapped_command(CONFIG, local) == ["/bin/server", "serve", *local]


def test_only_speculate_started_with_no_model_gets_the_small_stand_in():
    """The suite's router preset names no model: llama-server runs in router mode, speculate serve
    (no router mode) would load its default pair, past the suite's time to start."""
    router = ["--port", "8080", "--cors-origins", "localhost", "--ctx-size", "1024"]
    assert wrapped_command({**CONFIG, "no_model": "/m/smol.gguf"}, router) == [
        "/bin/server", "serve", "-m", "/m/smol.gguf", *router]
    assert wrapped_command(CONFIG, router) == ["/bin/server", "serve", *router]  # llama-server's config: none
    for given in (["--model", "/m/x.gguf"], ["-m=/m/x.gguf"]):
        assert wrapped_command({**CONFIG, "no_model": "/m/smol.gguf"}, given) == ["/bin/server", "serve", *given]


def test_a_model_with_no_stand_in_is_refused_by_name():
    with pytest.raises(SystemExit, match="no local stand-in for ggml-org/models/bert-bge-small/ggml-model-f16.gguf"):
        wrapped_command(CONFIG, ["--hf-repo", "ggml-org/models", "--hf-file", "bert-bge-small/ggml-model-f16.gguf"])


def test_the_stand_ins_cover_the_suites_text_presets_and_nothing_else(tmp_path):
    """Every ServerPreset of the pinned utils.py with a generating text model has a stand-in; the
    embedding, reranking and vision ones have none (their tests skip), nor has a LoRA download."""
    suite = vendored_tree(tmp_path, "tools/server/tests/utils.py", "tools/server/tests/unit/test_speculative.py",
                          "tools/server/tests/unit/test_lora.py") / "tools" / "server" / "tests"
    utils = (suite / "utils.py").read_text()
    presets = dict(re.findall(r"def (\w+)\(\) -> ServerProcess:.*?model_hf_repo = \"([^\"]+)\"", utils, re.S))
    assert {name for name, repo in presets.items() if stand_in(repo, STAND_INS)} == {
        "tinyllama2", "tinyllama_infill", "stories15m_moe"}
    assert {"bert_bge_small", "jina_reranker_tiny", "tinygemma3"} <= set(presets)
    speculative = (suite / "unit" / "test_speculative.py").read_text()
    draft_url = re.search(r'MODEL_DRAFT_FILE_URL = "([^"]+)"', speculative)[1]
    assert stand_in(draft_url, DOWNLOADS) == stand_in("ggml-org/stories15M_MOE/", STAND_INS) == SMOL
    lora = (suite / "unit" / "test_lora.py").read_text()
    assert all(stand_in(url, DOWNLOADS) is None for url in re.findall(r'"(https://[^"]+\.gguf)"', lora))


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="unit.test_completion" name="test_ok[1]"/>
<testcase classname="unit.test_completion" name="test_start[2]">
  <failure message="RuntimeError: Server process died with return code 2&#10;more">trace</failure>
  <system-out>tests: starting server with: ...&#10;speculate: error: No such option: --temp</system-out>
</testcase>
<testcase classname="unit.test_completion" name="test_vision"><skipped message="needs the network: x"/></testcase>
<testcase classname="unit.test_completion.TestGroup" name="test_in_class"><error message="fixture broke"/></testcase>
</testsuite></testsuites>"""


def test_junit_results_are_read_per_test_with_the_servers_last_error(tmp_path):
    (tmp_path / "run.xml").write_text(JUNIT)
    assert read_junit(tmp_path / "run.xml")["tests"] == {
        "test_ok[1]": {"outcome": "passed", "reason": ""},
        "test_start[2]": {"outcome": "failed", "reason": "RuntimeError: Server process died with return code 2",
                          "server_said": "speculate: error: No such option: --temp"},
        "test_vision": {"outcome": "skipped", "reason": "needs the network: x"},
        "TestGroup::test_in_class": {"outcome": "error", "reason": "fixture broke", "server_said": ""},
    }


def test_the_comparison_counts_each_file_and_lists_only_tests_whose_outcome_differs():
    a = {"server": "llama-server", "files": {"unit/test_x.py": {"tests": {
        "test_a": {"outcome": "passed", "reason": ""}, "test_b": {"outcome": "passed", "reason": ""}}}}}
    b = {"server": "speculate", "files": {"unit/test_x.py": {"tests": {
        "test_a": {"outcome": "passed", "reason": ""},
        "test_b": {"outcome": "failed", "reason": "RuntimeError", "server_said": "refused --temp"}}}}}
    table = comparison_table(a, b)
    assert "| unit/test_x.py | 2/0/0/0 | 1/1/0/0 |" in table
    assert "| test_x::test_b | passed | failed | refused --temp |" in table
    assert "test_a |" not in table


def test_a_run_against_a_fake_server_shows_what_it_was_given_and_why_each_test_ended(tmp_path):
    """The whole path without a model: the suite copied from the sdist, run in this Python with the
    plugin, starting the wrapper, which starts a fake server that records its arguments and refuses
    them. The stories target and the downloaded draft arrive as local stand-ins, the suite's other
    flags unchanged; the vision test skips before any server starts, with no network."""
    args_log = tmp_path / "args.jsonl"
    fake_server = tmp_path / "fake-server"
    fake_server.write_text(f"#!{sys.executable}\nimport json, sys\n"
                           f"open({str(args_log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
                           "sys.exit('fake-server: error: refusing to start')\n")
    fake_speculate = tmp_path / "fake-speculate"  # answers `models path NAME` only
    fake_speculate.write_text(f"#!{sys.executable}\nimport sys\nprint('/models/' + sys.argv[3] + '.gguf')\n")
    for exe in (fake_server, fake_speculate):
        exe.chmod(0o755)
    proc = subprocess.run([sys.executable, str(SCRIPT), "run", "--server", str(fake_server), "--python",
                           sys.executable, "--speculate", str(fake_speculate), "--out", str(tmp_path / "out"),
                           "unit/test_speculative.py::test_with_and_without_draft",
                           "unit/test_compat_anthropic.py::test_anthropic_vision_base64_with_multimodal_model"],
                          capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "out" / "fake-server" / "summary.json").read_text())
    spec = summary["files"]["unit/test_speculative.py"]["tests"]["test_with_and_without_draft"]
    assert spec["outcome"] == "failed" and spec["server_said"] == "fake-server: error: refusing to start"
    vision = summary["files"]["unit/test_compat_anthropic.py"]["tests"]
    assert vision["test_anthropic_vision_base64_with_multimodal_model"]["outcome"] == "skipped"
    started = [json.loads(line) for line in args_log.read_text().splitlines()]
    assert len(started) == 1  # the test stopped at its first server, without a draft
    args = started[0]
    assert args[args.index("-m") + 1] == f"/models/{SMOL}.gguf"
    assert not {"--hf-repo", "--hf-file", "-hf", "--model-url"} & set(args)
    assert {"--temp", "--seed", "--alias", "--n-predict", "--no-jinja"} <= set(args)


@pytest.mark.real
def test_llama_cpps_own_tests_named_here_pass_against_speculate(tmp_path):
    """NAMED, tests of the pinned llama.cpp's server suite, through scripts/peer_tests.py against
    `speculate serve` on the stand-ins, in this Python (the packages scripts/test.sh installs)."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "run", "--server", "speculate", "--speculate", SPECULATE,
                           "--python", sys.executable, "--out", str(tmp_path), *NAMED],
                          capture_output=True, text=True)
    summary = json.loads((tmp_path / "speculate" / "summary.json").read_text())
    outcomes = {f"{file}::{name}": test for file, result in summary["files"].items()
                for name, test in result["tests"].items()}
    for named in NAMED:
        assert any(node == named or node.startswith((named + "[", named + "::")) for node in outcomes), (
            named, proc.stdout)
    failed = {node: test for node, test in outcomes.items() if test["outcome"] != "passed"}
    assert not failed
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
