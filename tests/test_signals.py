"""Ctrl-C, SIGTERM and a closed stdout, on a real model: partial output and statistics,
exit 130 (a closed pipe: 0), never a traceback. The runs go through tests/probe.py, which
says when the moment to signal (or to close the pipe) has come and holds the run there, so
that no signal races the work."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess

import pytest

from tests.conftest import SMOL, SPECULATE, probe_command

def restore_signals() -> None:
    # Signals as at a terminal: a shell without job control starts background jobs with
    # SIGINT ignored, and CI may run us that way.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def start(*args: str, **probes: str) -> subprocess.Popen:
    """`speculate ARGS` under tests/probe.py, with the probes PROBE_<NAME>=value given as NAME=value."""
    env = {**os.environ, **{f"PROBE_{name}": value for name, value in probes.items()}}
    return subprocess.Popen(probe_command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            preexec_fn=restore_signals)


def wait_for(proc: subprocess.Popen, line: str) -> str:
    """Read stderr up to the line starting with `line`; what came before it (calibration, if
    this machine has none cached yet; notices)."""
    before = []
    while not (got := proc.stderr.readline().decode()).startswith(line):
        if not got:
            proc.wait()
            pytest.fail(f"the run ended (exit {proc.returncode}) before {line!r}: {''.join(before)[-2000:]}")
        before.append(got)
    return "".join(before)


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[bytes, str]:
    """The rest of the output, once the run ends; `timeout` only guards against a hang."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"still running {timeout} s after the signal: {err.decode()[-2000:]}")
    return out, err.decode()


def decodes(err: str) -> list[tuple[int, int]]:
    """(tokens, return code) of each llama_decode the probe saw."""
    return [(int(n), int(ret)) for n, ret in re.findall(r"probe: llama_decode of (\d+) tokens returned (-?\d+)", err)]


@pytest.mark.real
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_prompt_processing_stops_llama_cpp_mid_decode(model_path, signum):
    """The probe holds llama.cpp inside the prompt's decode, at its first poll of the abort
    callback, until the signal has come: the decode then returns 2 (aborted, llama.cpp's own
    word that it stopped between graph nodes), and nothing is decoded after it."""
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly kings".split()
    prompt = " ".join(random.Random(1).choice(words) for _ in range(2000))  # ~2k tokens: one long batch
    proc = start("-m", str(model_path(SMOL)), "-p", prompt, "-n", "8", "--temp", "0", DECODE="1")
    wait_for(proc, "probe: llama.cpp is decoding")
    proc.send_signal(signum)
    out, err = finish(proc)
    assert proc.returncode == 130, err
    (n, ret), = decodes(err)  # the decode in flight, and none after it
    assert n >= 1000 and ret == 2, err
    assert "Traceback" not in err and "Exception ignored" not in err
    assert "decoded    0 tokens" in err and "finish    = interrupted" in err, err
    assert out.strip() == b""


@pytest.mark.real
def test_sigterm_during_generation_is_ctrl_c(model_path):
    proc = start("-m", str(model_path(SMOL)), "-p", "Write a long story:", "-n", "-1", "--ignore-eos",
                 "--temp", "0", PIECES="4")
    wait_for(proc, "probe: 4 pieces")  # held there until the signal
    proc.send_signal(signal.SIGTERM)
    out, err = finish(proc)
    assert proc.returncode == 130, err
    assert out.strip() and out.endswith(b"\n")  # the four pieces, and the line ended
    assert "decoded " in err and "finish    = interrupted" in err and "n_predict = " in err
    assert "Traceback" not in err and "speculate: error" not in err


@pytest.mark.real
@pytest.mark.parametrize("reader, json_output", [("head -c 10", False), ("true", False), ("true", True)])
def test_a_reader_that_goes_away_ends_output_quietly(model_path, reader, json_output):
    """`| head -c 10` closes the pipe mid-stream; `| true` before the first byte. The probe
    holds the write after those 10 bytes (or the first) until the reader has gone."""
    smol = model_path(SMOL)
    n = 16 if json_output else 200  # streaming stops at the first write that fails
    command = " ".join(f"'{arg}'" for arg in probe_command())
    cmd = (f"{command} -m '{smol}' -p 'Write a long story:' -n {n} --temp 0 --ignore-eos"
           f"{' --json' if json_output else ''} | {reader}")
    env = {**os.environ, "PROBE_STDOUT": "10" if reader.startswith("head") else "0"}
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, timeout=300, env=env)
    err = proc.stderr.decode()
    assert "probe: stdout's reader is gone" in err, err
    assert len(proc.stdout) == (10 if reader.startswith("head") else 0)
    assert "Traceback" not in err and "Broken pipe" not in err and "BrokenPipeError" not in err
    assert proc.returncode == 0, err
    if not json_output:
        assert "finish    = output closed" in err


@pytest.mark.parametrize("args", [("models", "list"), ("models", "list", "--json"), ("models", "path")])
def test_commands_whose_reader_is_gone_exit_0_quietly(args):
    """The reader closes the pipe before the command has printed anything."""
    read, write = os.pipe()
    os.close(read)  # gone before the command starts
    try:
        proc = subprocess.run([SPECULATE, *args], stdout=write, stderr=subprocess.PIPE, timeout=60)
    finally:
        os.close(write)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stderr == b""

