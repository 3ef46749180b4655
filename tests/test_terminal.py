"""Output that fits a terminal (cli/terminal.py) and the status line of long steps
(cli/progress.py): text wrapped only between words or whole fields, tables that show fewer or
narrower columns rather than break a word or a number, and progress drawn in place on a
terminal, silent in a pipe. Terminals are real pseudo-terminals (os.openpty) of a set size."""

from __future__ import annotations

import fcntl
import io
import json
import os
import re
import struct
import subprocess
import termios
import threading

import pytest
from rich.console import Console

from speculative.cli import terminal
from speculative.cli.progress import StatusLine, shortened
from tests.conftest import SMOL, SPECULATE

CLEAR = "\r\x1b[K"

# -- wrapping ---------------------------------------------------------------------------

TEXT = ("calibrating qwen2.5-coder-1.5b-instruct: verify cost of batches of 1-17 tokens (once for this model, "
        "threads and build; cached in /root/.local/share/speculate/calibration.json)")


@pytest.mark.parametrize("columns", [20, 40, 80])
def test_wrap_breaks_only_between_words(columns):
    lines = terminal.wrap(TEXT, columns)
    assert " ".join(" ".join(lines).split()) == TEXT  # every word whole, in order
    assert all(fit(line, columns) for line in lines)
    assert all(line.startswith(terminal.CONTINUED) for line in lines[1:])


def fit(line: str, columns: int) -> bool:
    """Within `columns`, or a single word that is longer (a path: never broken)."""
    return len(line) <= columns or len(line.split()) == 1


def test_no_width_keeps_lines_whole():
    assert terminal.wrap(TEXT + "\nsecond", None) == [TEXT, "second"]


def test_fields_are_never_split_and_keep_their_padding():
    items = ["[12/24]", "count   ", "ngram-simple draft-max=1", "23.40 t/s", "accepted 18/20"]
    for columns in (20, 30, 50, 200):
        lines = terminal.fields(items, columns)
        text = "\n".join(lines)
        assert all(item.strip() in text for item in items), lines
        assert all(len(line) <= columns or line.strip() in items for line in lines)  # or a field alone
    assert terminal.fields(items, None) == ["[12/24]  count     ngram-simple draft-max=1  23.40 t/s  accepted 18/20"]


def test_fields_break_after_a_visible_separator():
    lines = terminal.fields(["CPU : SSE3 = 1", "AVX = 1", "AVX2 = 1"], 20, " | ")
    assert lines == ["CPU : SSE3 = 1 |", "  AVX = 1 | AVX2 = 1"]


# -- tables -----------------------------------------------------------------------------

COLUMNS = [
    terminal.Column("name", ["qwen2.5-coder-1.5b-instruct (qwen-1.5b)", "smollm2-135m-instruct (smollm2)",
                             "bartowski/Qwen2.5-Coder-14B-Instruct-GGUF:Q4_K_M"]),
    terminal.Column("size", ["1,117 MB", "98 MB", "8,988 MB"], "right", whole=True),
    terminal.Column("note", ["the default target, pulled from the package index", "", "from the hub"]),
    terminal.Column("path", ["/root/.cache/speculate/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                             "/root/.cache/speculate/models/SmolLM2-135M-Instruct.Q4_1.gguf", "/x/y.gguf"]),
]


def rendered(table, columns: int) -> str:
    console = Console(width=columns, file=io.StringIO(), color_system=None)
    console.print(table)
    return console.file.getvalue()


def words(columns) -> set[str]:
    return {word for column in columns for text in column.texts() for word in text.split()}


@pytest.mark.parametrize("columns", [70, 80, 100, 150, 200])
def test_a_fitting_table_breaks_no_word_and_no_line(columns):
    name, size, note, path = COLUMNS
    candidates = list(terminal.dropping(COLUMNS, [path, note]))
    shown = terminal.first_fitting(candidates, columns)
    assert terminal.fits(shown, columns) and not any(terminal.fits(c, columns) for c in candidates[:candidates.index(shown)])
    text = rendered(terminal.table(shown, columns), columns)
    assert all(len(line) <= columns for line in text.splitlines()), text
    printed = set(text.replace("│", " ").replace("┃", " ").split())
    assert words(shown) <= printed, words(shown) - printed  # no word cut into two lines
    assert terminal.left_out(shown, COLUMNS) == [c.header for c in COLUMNS if c not in shown]
    assert len(shown) == {70: 2, 80: 3, 100: 3, 150: 4, 200: 4}[columns]  # 48 + 8 (+ 7 (+ 68)) and the frame


def test_a_table_without_a_width_is_as_wide_as_its_cells():
    text = rendered(terminal.table(COLUMNS, None), 1000)
    assert all(cell in text for column in COLUMNS for cell in column.texts())


def test_when_nothing_fits_the_narrowest_candidate_is_shown():
    name, size, note, path = COLUMNS
    assert terminal.first_fitting(terminal.dropping(COLUMNS, [path, note, size]), 10) == [name]


# -- the status line ----------------------------------------------------------------------


class Pty:
    """A pseudo-terminal of `columns` columns: `slave` is what a program writes to; `read()`
    is everything written once it is closed."""

    def __init__(self, columns: int = 80):
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
        attrs = termios.tcgetattr(slave)
        attrs[1] &= ~termios.OPOST  # no \n -> \r\n: the bytes as written
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        self.slave = slave
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: every writer has closed the slave side
                return
            if not chunk:
                return
            self._chunks.append(chunk)

    def read(self) -> str:
        os.close(self.slave)
        self._reader.join(timeout=600)
        os.close(self.master)
        return b"".join(self._chunks).decode("utf-8", errors="replace")


def screen(written: str) -> list[str]:
    """The lines a terminal shows for what was written: each \\r returns to the line's start,
    \\x1b[K erases the rest of it."""
    lines, line, at = [], [], 0
    written = re.sub(r"\x1b\[[0-9;]*m", "", written)  # colours and bold
    for token in re.findall(r"\x1b\[K|\r|\n|[^\r\n\x1b]+", written):
        if token == "\n":
            lines.append("".join(line))
            line, at = [], 0
        elif token == "\r":
            at = 0
        elif token == "\x1b[K":
            del line[at:]
        else:
            line[at:at + len(token)] = token
            at += len(token)
    return lines + (["".join(line)] if line else [])


def test_on_a_terminal_updates_replace_the_line_and_a_message_clears_it(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    pty = Pty(columns=40)
    with os.fdopen(os.dup(pty.slave), "w") as stream:
        with StatusLine(stream) as status:
            assert status.live
            status.update("loading smollm2-135m-instruct")
            status.update("step 2/3: scoring positions one at a time and in batches: a batch of 12")
            detail = status.step(3, 3, "sequences")
            detail("alone")
            status.say("calibrated in 1.2 s: 1:10ms 2:12ms 3:13ms 4:15ms 5:16ms 6:18ms")
            status.update("last words")
    written = pty.read()
    assert written.startswith("\rloading smollm2-135m-instruct" + "\x1b[K")
    assert "\rstep 3/3: sequences: alone\x1b[K" in written
    updates = re.findall(r"\r([^\r\n\x1b]*)\x1b\[K", written)
    assert all(len(u) < 40 for u in updates) and "step 2/3: scoring positions one at a…" in updates
    assert written.endswith(CLEAR)  # leaving the block takes the last status away
    assert screen(written) == ["calibrated in 1.2 s: 1:10ms 2:12ms", "  3:13ms 4:15ms 5:16ms 6:18ms"]


def test_through_a_pipe_there_is_no_progress_and_messages_stay_whole(monkeypatch):
    monkeypatch.setenv("COLUMNS", "20")  # a width for tables; a message in a pipe stays one line
    read, write = os.pipe()
    with os.fdopen(write, "w") as stream, StatusLine(stream) as status:
        assert not status.live
        status.update("loading")
        status.step(1, 2, "doctor")("detail")
        status.say("a notice longer than twenty columns, as it always was")
    with os.fdopen(read) as pipe:
        assert pipe.read() == "a notice longer than twenty columns, as it always was\n"


def test_silenced_on_a_terminal_there_is_no_progress(monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    pty = Pty()
    with os.fdopen(os.dup(pty.slave), "w") as stream, StatusLine(stream, enabled=False) as status:
        status.update("loading")
        status.say("notice")
    assert pty.read() == "notice\n"


def test_a_dumb_terminal_gets_no_progress(monkeypatch):
    monkeypatch.setenv("TERM", "dumb")
    pty = Pty()
    with os.fdopen(os.dup(pty.slave), "w") as stream, StatusLine(stream) as status:
        status.update("loading")
    assert pty.read() == ""


def test_shortened_cuts_after_a_whole_word():
    assert shortened("scoring positions one at a time", 20) == "scoring positions…"
    assert shortened("short", 20) == "short"
    assert len(shortened("x" * 50, 20)) == 20


# -- the commands -------------------------------------------------------------------------


def bench_runs() -> list:
    from speculative.engine import bench

    configs = ["target only", "draft", "ngram-simple,draft ngram-n=3 draft-max=8", "auto"]
    return [bench.Run(prompt=f"prompt-{p}", category=("code", "prose")[p % 2], config=c, repeat=0, n_predict=64,
                      decode_tps=10.0 + i + p, speedup=1.0 + i / 10, accept_rate=0.5, mean_accepted_length=1.5,
                      n_drafted=40, n_accept=20, t_draft_s=0.1, t_verify_s=1.0, t_decode_s=2.0, python_share=0.02,
                      modelled_speedup=1.1, ngram_bound=1.3 if c == "target only" else None)
            for p in range(3) for i, c in enumerate(configs)]


@pytest.mark.parametrize("columns", [80, 300])
def test_bench_tables_show_what_fits_and_say_what_is_left_out(monkeypatch, capsys, columns):
    from speculative.cli.bench import _print_results
    from speculative.engine import bench

    monkeypatch.setenv("COLUMNS", str(columns))
    runs = bench_runs()
    _print_results(bench.summarize(runs), runs, {"machine": {"batch_variant_kernels": []}}, True, "r.json")
    out = capsys.readouterr().out
    assert all(len(line) <= columns for line in out.splitlines()), out
    assert ("left out at this width" in out) == (columns == 80), out
    printed = set(out.replace("│", " ").split())
    for figure in ("1.30x", "2.0%", "5%"):  # a speedup stays; the python and draft shares are in the results file
        assert (figure in printed) == (columns == 300 or figure == "1.30x"), figure
    assert {f"prompt-{p}" for p in range(3)} <= printed and {"ngram-simple,draft", "draft-max=8"} <= printed


@pytest.mark.parametrize("columns", [80, None])
def test_the_doctor_report_breaks_no_field(columns):
    from speculative.cli.doctor import _report_lines

    report = {"llama_cpp_python": "0.3.36", "gpu_offload": False, "rpc": True,
              "system_info": "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
                             "AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | OPENMP = 1 | ",
              "model": "qwen2.5-coder-1.5b-instruct", "architecture": "qwen2", "recurrent": False, "threads": 2,
              "n_gpu_layers": -1, "flash_attn": "auto", "flash_attn_on": False, "cache_type_k": "f16",
              "cache_type_v": "q8_0", "placement": "cpu", "overrides": [["blk\\.[0-9]+\\.ffn_.*_exps", "CPU"]],
              "batch_variant_kernels": ["TILED_MM"], "parallel": 4, "kv_unified": True, "sequence_invariant": False,
              "checks": [{"cached": 16, "batch": b, "max_abs_diff": 0.0} for b in range(2, 17)],
              "sequences": {"others": 3, "positions": 8, "max_abs_diff": 0.6}, "batch_invariant": True}
    lines = _report_lines(report, columns)
    assert all(len(line) <= (columns or 1000) for line in lines), lines
    joined = "\n".join(lines)
    for field in ("AVX512_VNNI = 1", "-ngl -1", "-fa auto (off)", "KV cache K f16 V q8_0", "2 threads"):
        assert field in joined, field  # on one line
    assert len(lines) == (7 if columns is None else len(lines)) and "OPENMP = 1 |" not in joined


def test_models_list_fits_80_columns():
    from tests.conftest import speculate_here

    proc = speculate_here("models", "list", env={"COLUMNS": "80"})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.decode()
    assert all(len(line) <= 80 for line in out.splitlines()), out
    rows = [json.loads(line) for line in speculate_here("models", "list", "--json").stdout.decode().splitlines()]
    assert all(row["name"] in out for row in rows)  # every name whole


def run_on_terminals(*args: str, columns: int = 80, stdout_terminal: bool = True, env: dict | None = None):
    """`speculate ARGS` with stderr (and stdout, unless `stdout_terminal` is False: a pipe) on
    pseudo-terminals `columns` wide: (exit status, stdout, stderr) as written."""
    err = Pty(columns)
    out = Pty(columns) if stdout_terminal else None
    proc = subprocess.Popen([SPECULATE, *args], stdin=subprocess.DEVNULL, stderr=err.slave,
                            stdout=out.slave if out else subprocess.PIPE, env=terminal_env(env))
    piped = proc.stdout.read().decode() if out is None else None
    code = proc.wait(timeout=600)
    return code, out.read() if out else piped, err.read()


def terminal_env(env: dict | None = None) -> dict:
    """The environment of a program on a terminal: its size from the terminal, not COLUMNS."""
    return {k: v for k, v in os.environ.items() if k != "COLUMNS"} | {"TERM": "xterm", **(env or {})}


@pytest.mark.real
def test_a_run_on_a_terminal_clears_its_status_before_the_text(model_path):
    """stdout and stderr on one terminal, as a user runs it: the status line (loading the
    model) is gone before the first token is written, so the text starts on a clean line."""
    args = ("-m", str(model_path(SMOL)), "-p", "Once upon a time", "-n", "8", "--temp", "0", "--ignore-eos",
            "--spec-type", "none")  # nothing to calibrate
    tty = Pty()
    proc = subprocess.Popen([SPECULATE, *args], stdin=subprocess.DEVNULL, stdout=tty.slave, stderr=tty.slave,
                            env=terminal_env())
    assert proc.wait(timeout=600) == 0
    written = tty.read()
    text = json.loads(subprocess.run([SPECULATE, *args, "--json"], capture_output=True, check=True).stdout)["text"]
    lines = screen(written)  # notices (a calibration) may come first, each on a line of its own
    assert "\rloading " in written and not any("loading" in line for line in lines)  # a status shown, then gone
    assert text.split("\n")[0] in lines  # the text's first line as it is: nothing of the status left on it
    code, out, err = run_on_terminals(*args, "--json")
    assert code == 0 and "\r" not in err and json.loads(out)["text"] == text  # --json: no progress


def test_models_list_fits_the_terminal_it_is_shown_on():
    code, out, err = run_on_terminals("models", "list", columns=60)
    assert code == 0, err
    lines = screen(out)
    assert lines and all(len(line) <= 60 for line in lines), out
    listed = json.loads(subprocess.run([SPECULATE, "models", "list", "--json"], capture_output=True,
                                       check=True).stdout.splitlines()[0])
    assert listed["name"] in out  # the name whole, on one line
    assert "left out at this width" in out and "--json" in out


def test_models_list_into_a_file_keeps_whole_lines(tmp_path):
    proc = subprocess.run([SPECULATE, "models", "list"], capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "COLUMNS"})
    assert proc.returncode == 0 and "left out" not in proc.stdout
    rows = [json.loads(line) for line in subprocess.run([SPECULATE, "models", "list", "--json"], capture_output=True,
                                                        text=True, check=True).stdout.splitlines()]
    assert all(row["path"] in proc.stdout for row in rows)  # every path whole


@pytest.mark.real
def test_doctor_says_each_step_on_a_terminal_and_nothing_in_a_pipe(model_path):
    smol = str(model_path(SMOL))
    code, out, err = run_on_terminals("doctor", "-m", smol, "-np", "2", stdout_terminal=False)
    assert code == 0, err
    statuses = re.findall(r"\r([^\r\n\x1b]*)\x1b\[K", err)
    assert any(s.startswith("step 1/3: loading ") for s in statuses), statuses
    assert "step 2/3: positions alone vs in batches: 300 cached, a batch of 16 (15/15)" in statuses
    assert "step 3/3: a request alone vs among 1 other: among the others" in statuses
    assert all(len(s) < 80 for s in statuses) and err.endswith(CLEAR) and screen(err) == []
    assert "verdict:" in out and "\r" not in out
    piped = subprocess.run([SPECULATE, "doctor", "-m", smol, "-np", "1"], capture_output=True, text=True,
                           env={k: v for k, v in os.environ.items() if k != "COLUMNS"})
    assert piped.returncode == 0 and piped.stderr == "" and "verdict:" in piped.stdout  # no progress
    silent = run_on_terminals("doctor", "-m", smol, "-np", "1", "--json", stdout_terminal=False)
    assert silent[0] == 0 and silent[2] == "" and json.loads(silent[1])["sequences"] is None


@pytest.mark.real
def test_bench_shows_which_run_and_fits_its_tables_to_the_terminal(tmp_path):
    from tests.tiny_model import write_model
    from speculative.engine import bench

    tiny = str(write_model("llama", tmp_path / "tiny.gguf"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a-prompt-with-a-rather-long-identifier", "category": "complete", "prompt": "1, 2,"}\n'
                       '{"id": "b", "category": "copy", "prompt": "the cat sat on the mat. the cat"}\n')
    code, out, err = run_on_terminals(
        "bench", str(prompts), "-m", tiny, "-C", "ngram-simple", "-C", "auto", "--sweep", "ngram-n=2,3", "-n", "8",
        "-t", "1", "-o", str(tmp_path / "r.json"), "--per-prompt", env={"SPECULATE_HOME": str(tmp_path)})
    assert code == 0, err
    total = bench.count_runs(2, 5, 1)  # target only, ngram-simple and auto with ngram-n 2 and 3
    statuses = re.findall(r"\r([^\r\n\x1b]*)\x1b\[K", err)
    assert f"run 1/{total}: target only, round 1/1, prompt 1/2…" in statuses  # the long id cut, whole
    assert f"run {total}/{total}: target only, round 1/1, prompt 2/2 b" in statuses, statuses
    assert all(len(s) < 80 for s in statuses)
    shown = screen(err)
    results = [line for line in shown if line.startswith("[")]
    assert len(results) == total and all(fit(line, 80) for line in shown), shown
    assert all(re.search(r"\d+\.\d\d t/s", line) for line in shown if "t/s" in line)  # a figure with its unit
    table = screen(out)
    # the results file's path alone on its line, whole (a temporary folder's length varies)
    assert all(len(line) <= 80 for line in table if line.strip() != str(tmp_path / "r.json")), out
    assert "left out at this width:" in out and "ngram-simple" in out


@pytest.mark.real
def test_a_calibration_shows_its_round_and_time_left_on_a_terminal_and_nothing_in_a_pipe(model_path, tmp_path):
    """A model the book of costs does not know is calibrated first: on a terminal the status line
    says which round and size it is at and about how long is left, and is gone after; through a
    pipe the calibration's two notices are all there is."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(model_path(SMOL).parent)
    args = ("-m", SMOL, "-p", "def fib(n):", "-n", "1", "--temp", "0", "--draft-max", "4")
    code, out, err = run_on_terminals(*args, stdout_terminal=False, env={"SPECULATE_HOME": str(home)})
    assert code == 0, err
    statuses = re.findall(r"\r([^\r\n\x1b]*)\x1b\[K", err)
    rounds = [s for s in statuses if re.fullmatch(rf"calibrating {SMOL}: round \d of \d, \d tokens? "
                                                  r"\(about \d+ s left\)( \(again: .*)?", s)]
    assert rounds, statuses
    assert all(len(s) < 80 for s in statuses) and not any(re.search(r"round \d of \d", line) for line in screen(err))
    assert any(line.startswith(f"calibrating {SMOL}'s passes") for line in screen(err))
    (home / "costs.json").unlink()
    piped = subprocess.run([SPECULATE, *args], capture_output=True, text=True,
                           env=terminal_env({"SPECULATE_HOME": str(home)}))
    # no status line (a busy machine's calibration may still say its rounds differed)
    assert piped.returncode == 0 and "\r" not in piped.stderr and not re.search(r"round \d of \d", piped.stderr)
    assert f"calibrating {SMOL}'s passes" in piped.stderr and "calibrated in" in piped.stderr
