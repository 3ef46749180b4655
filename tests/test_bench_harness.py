"""scripts/bench/: the one command and the harness its scenarios share, without a model.

Every module of the package but the shared two is a scenario the command lists and runs, whose
options are parsed by the harness (so its results' meta says `python -m scripts.bench NAME`), and
every published table's command names a scenario that exists."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import tables
from scripts.bench import harness
from scripts.bench.__main__ import SHARED, main, scenarios

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(p.stem for p in (ROOT / "scripts" / "bench").glob("*.py") if not p.stem.startswith("_"))


def run_command(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def test_every_module_but_the_shared_ones_is_a_listed_scenario():
    assert sorted(scenarios().values()) == [m for m in MODULES if m not in SHARED]
    assert SHARED <= set(MODULES)
    code, out, _ = run_command()
    assert code == 0
    for name in scenarios():
        assert any(line.split()[:1] == [name] and len(line.split()) > 1 for line in out.splitlines()), name


@pytest.mark.parametrize("name", sorted(scenarios()))
def test_each_scenario_parses_its_options_through_the_harness(name):
    code, out, err = run_command(name, "--help")
    assert code == 0, err
    assert out.startswith(f"usage: python -m scripts.bench {name} ")


def test_an_unknown_scenario_is_one_line_and_exit_2():
    code, _, err = run_command("no-such-thing")
    assert code == 2
    assert err.count("\n") == 1 and "no scenario 'no-such-thing'" in err and "parallel" in err


def test_the_command_runs_from_the_repository_root():
    proc = subprocess.run([sys.executable, "-m", "scripts.bench", "ceiling", "--help"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "python -m scripts.bench ceiling" in proc.stdout


def test_every_published_table_names_a_scenario_that_exists():
    for table in tables.TABLES.values():
        words = table.command.split()
        if words[:3] == ["python", "-m", "scripts.bench"]:
            assert words[3] in scenarios(), table.name
        else:  # what is not a scenario is a script of scripts/ or speculate's own command
            assert words[0] == "speculate" or words[0].startswith("GGML") or (ROOT / words[1]).is_file(), table.name


def test_repeats_interleave_every_configuration():
    assert list(harness.interleaved("ab", 2)) == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]
    assert list(harness.interleaved("abc", 3, rotate=True)) == [
        (0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"), (2, "c"), (2, "a"), (2, "b")]
    assert list(harness.interleaved([], 2)) == []


def test_a_ratio_needs_its_baseline():
    assert harness.ratio(3.0, 2.0) == 1.5
    assert harness.ratio(3.0, None) is None and harness.ratio(None, 2.0) is None and harness.ratio(1.0, 0) is None


def test_meta_records_the_scenario_as_it_was_run():
    parser = harness.parser("scripts.bench.cache_ram", "What it measures.\n\nMore.")
    parser.add_argument("-n", type=int)
    assert harness.parse(parser, ["-n", "3"]).n == 3
    assert harness.meta(model="m")["command"] == ["python", "-m", "scripts.bench", "cache-ram", "-n", "3"]
    args, extra = harness.parse(parser, ["-n", "4", "--", "-fa", "on"], known=True)
    assert (args.n, extra) == (4, ["-fa", "on"])


def test_results_are_written_whole_and_gzipped_by_name(tmp_path):
    data = {"meta": {"date": "d"}, "rows": [{"x": 1.5, "text": "é"}]}
    harness.write(tmp_path / "a.json", data)
    harness.write(tmp_path / "sub" / "a.json.gz", data)
    assert json.loads((tmp_path / "a.json").read_text()) == data
    assert json.loads(gzip.decompress((tmp_path / "sub" / "a.json.gz").read_bytes())) == data
    with pytest.raises(TypeError):  # what cannot be written leaves the file there was
        harness.write(tmp_path / "a.json", {"rows": [object()]})
    assert json.loads((tmp_path / "a.json").read_text()) == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "sub"]


def test_a_command_that_fails_exits_with_one_message_naming_it(tmp_path):
    assert harness.run_json([sys.executable, "-c", "print('{\"a\": 1}')"]) == {"a": 1}
    with pytest.raises(SystemExit, match=r"exited 3:\n.*boom"):
        harness.run_json([sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"])
    with pytest.raises(SystemExit, match="not JSON"):
        harness.run_json([sys.executable, "-c", "print('hello')"])
    log = tmp_path / "log"
    rss = harness.run_logged([sys.executable, "-c", "print('ran'); b = bytearray(64 << 20)"], log)
    assert log.read_text() == "ran\n" and rss >= 64
    with pytest.raises(SystemExit, match="exited 1"):
        harness.run_logged([sys.executable, "-c", "raise SystemExit(1)"], log)


def test_rows_are_picked_by_id_in_the_order_asked(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a"}\n\n{"id": "b"}\n')
    rows = harness.jsonl(path)
    assert harness.by_ids(rows, ["b", "a"], "prompt", path) == [{"id": "b"}, {"id": "a"}]
    assert harness.by_ids(rows, None, "prompt", path) == rows
    with pytest.raises(ValueError, match="no prompt c in .*; there are: a, b"):
        harness.by_ids(rows, ["c"], "prompt", path)
    path.write_text('{"id": "a"}\nnot json\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: not JSON"):
        harness.jsonl(path)


def test_commits_refuses_two_names_of_one_commit_before_loading_anything():
    proc = subprocess.run([sys.executable, "-m", "scripts.bench", "commits", "HEAD", "HEAD", "-m", "no-such-model"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1 and "name the same commit" in proc.stderr and "Traceback" not in proc.stderr
