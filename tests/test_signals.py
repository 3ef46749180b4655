"""Ctrl-C, SIGTERM and a closed stdout, on a real model: partial output and statistics,
exit 130 (a closed pipe: 0), never a traceback."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import SMOL, SPECULATE

pytestmark = pytest.mark.real


def restore_signals() -> None:
    # Signals as at a terminal: a shell without job control starts background jobs with
    # SIGINT ignored, and CI may run us that way.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def start(*args: str, probe: bool = False) -> subprocess.Popen:
    """`speculate ARGS`; with `probe`, the same main() with a line on stderr as the prompt goes in."""
    command = [sys.executable, "-c", PROBE, *args] if probe else [SPECULATE, *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=restore_signals)


PROBE = """
import sys
import speculative.engine as engine
generate = engine.generate
def probed(*args, **kw):
    sys.stderr.write("probe: prompt processing starts\\n")
    sys.stderr.flush()
    return generate(*args, **kw)
engine.generate = probed
from cli.main import main
main()
"""


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[bytes, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"still running {timeout} s after the signal: {err.decode()[-2000:]}")
    return out, err.decode()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_prompt_processing_stops_it_at_once(model_path, signum):
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly kings".split()
    prompt = " ".join(random.Random(1).choice(words) for _ in range(8000))  # ~8k tokens: seconds to minutes
    proc = start("-m", str(model_path(SMOL)), "-p", prompt, "-c", "12288", "-n", "8", "--temp", "0", probe=True)
    line = proc.stderr.readline().decode()
    while line and not line.startswith("probe:"):  # calibration, if this machine has none cached yet
        line = proc.stderr.readline().decode()
    assert line, "the run ended before prompt processing"
    time.sleep(0.3)
    proc.send_signal(signum)
    sent = time.monotonic()
    out, err = finish(proc)
    assert time.monotonic() - sent < 10, "llama.cpp was not stopped mid-prompt"
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Exception ignored" not in err
    assert "decoded    0 tokens" in err and "finish    = interrupted" in err, err
    assert out.strip() == b""


def test_sigterm_during_generation_is_ctrl_c(model_path):
    proc = start("-m", str(model_path(SMOL)), "-p", "Write a long story:", "-n", "-1", "--ignore-eos",
                 "--temp", "0")
    first = proc.stdout.read(20)  # generation has started
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = finish(proc)
    assert proc.returncode == 130, err
    assert first and out.endswith(b"\n")
    assert "decoded " in err and "finish    = interrupted" in err and "n_predict = " in err
    assert "Traceback" not in err and "speculate: error" not in err


@pytest.mark.parametrize("reader, json_output", [("head -c 10", False), ("true", False), ("true", True)])
def test_a_reader_that_goes_away_ends_output_quietly(model_path, reader, json_output):
    """`| head -c 10` closes the pipe mid-stream; `| true` before the first byte."""
    smol = model_path(SMOL)
    n = 16 if json_output else 200  # streaming stops at the first write that fails
    cmd = (f"'{SPECULATE}' -m '{smol}' -p 'Write a long story:' -n {n} --temp 0 --ignore-eos"
           f"{' --json' if json_output else ''} | {reader}")
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, timeout=300)
    err = proc.stderr.decode()
    assert len(proc.stdout) == (10 if reader.startswith("head") else 0)
    assert "Traceback" not in err and "Broken pipe" not in err and "BrokenPipeError" not in err
    assert proc.returncode == 0, err
    if not json_output:
        assert "finish    = output closed" in err


@pytest.mark.parametrize("args", [("models", "list"), ("models", "list", "--json"), ("models", "path")])
def test_commands_whose_reader_is_gone_exit_0_quietly(args):
    """The reader closes the pipe before the command has printed anything."""
    proc = subprocess.Popen([SPECULATE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0, err
    assert err == ""
