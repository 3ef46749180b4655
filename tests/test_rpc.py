"""llama.cpp's RPC backend: `speculate rpc-server`, the target's layers on RPC servers with
--rpc, exactness over loopback, and the faults (a server not there, a server killed mid-generation)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time
from contextlib import contextmanager

import pytest

from speculative import rpc
from speculative.errors import ModelError, UsageError
from speculative.llamacpp import LlamaModel, rpc_available
from tests.conftest import SMOL, SPECULATE, speculate, speculate_json

pytestmark = pytest.mark.real
PROMPT = "def fibonacci(n):\n    # return the n-th Fibonacci number\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def rpc_server(*args: str, port: int | None = None):
    """A `speculate rpc-server` on loopback, ready (it answered ggml's greeting): (process, endpoint)."""
    port = port or free_port()
    proc = subprocess.Popen([SPECULATE, "rpc-server", "-p", str(port), "-t", "1", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    endpoint = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                rpc.check(endpoint, timeout=2)
                break
            except ModelError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.2)
        yield proc, endpoint
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stderr.close()


@pytest.fixture(scope="module", autouse=True)
def rpc_build():
    if not rpc_available():
        pytest.fail("llama.cpp was built without RPC: build it as scripts/test.sh does (-DGGML_RPC=ON)")


def test_rpc_endpoints_are_read_as_llama_cpp_reads_them():
    assert rpc.parse("127.0.0.1:50052,gpu-box:1") == ["127.0.0.1:50052", "gpu-box:1"]
    for bad in ("127.0.0.1", "host:port", ":50052", "host:0", "host:70000", "a:1,"):
        with pytest.raises(UsageError):
            rpc.parse(bad)


def test_a_model_on_a_machine_without_gpu_takes_the_cpu_path_in_an_rpc_build(model_path):
    """llama_supports_gpu_offload() is true with RPC compiled in; -ngl -1 still keeps every layer
    on the CPU here, so -fa auto is off and no batch-variant kernel is reported."""
    import llama_cpp as ll

    assert ll.llama_supports_gpu_offload()
    with LlamaModel(model_path(SMOL), name=SMOL, n_ctx=256) as model:
        assert model.placement == "cpu"
        assert model._flash_attn_type == ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        assert model.kernels == []


def test_rpc_server_stops_on_sigterm_and_sigint_with_exit_0_and_the_port_free():
    with rpc_server() as (proc, endpoint):
        port = int(endpoint.rpartition(":")[2])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    with rpc_server(port=port) as (proc, endpoint):  # the same port at once, after a client came and went
        rpc.check(endpoint)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0


def test_rpc_server_off_loopback_prints_llama_cpps_warning():
    port = free_port()
    proc = subprocess.Popen([SPECULATE, "rpc-server", "-H", "0.0.0.0", "-p", str(port), "-t", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        err = proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    assert "Never expose the RPC server to an open network!" in err and "0.0.0.0" in err


def test_rpc_server_rejects_an_unknown_device():
    proc = speculate("rpc-server", "-d", "NOPE0", "-p", str(free_port()))
    assert proc.returncode == 2 and "NOPE0" in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_an_rpc_server_not_there_exits_3_within_seconds_naming_it(model_path):
    endpoint = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    proc = speculate("-m", str(model_path(SMOL)), "--rpc", endpoint, "-p", "hi", "-n", "4", timeout=60)
    assert time.monotonic() - t0 < 15
    assert proc.returncode == 3, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and endpoint in proc.stderr
    assert "Traceback" not in proc.stderr and "core dumped" not in proc.stderr


def test_a_server_that_does_not_greet_exits_3_naming_it(model_path):
    with socket.socket() as listener:  # accepts, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        endpoint = "127.0.0.1:%d" % listener.getsockname()[1]
        proc = speculate("-m", str(model_path(SMOL)), "--rpc", endpoint, "-p", "hi", "-n", "4", timeout=60)
    assert proc.returncode == 3 and endpoint in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_a_server_of_another_protocol_version_exits_3_naming_it(model_path):

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        endpoint = "127.0.0.1:%d" % listener.getsockname()[1]

        def greet_as_version_6():
            conn, _ = listener.accept()
            with conn:
                conn.recv(1 + 8 + rpc.CAPS_SIZE, socket.MSG_WAITALL)
                conn.sendall((4 + rpc.CAPS_SIZE).to_bytes(8, "little") + bytes([6, 0, 0, 0]) + bytes(rpc.CAPS_SIZE))

        threading.Thread(target=greet_as_version_6, daemon=True).start()
        proc = speculate("-m", str(model_path(SMOL)), "--rpc", endpoint, "-p", "hi", "-n", "4", timeout=60)
    assert proc.returncode == 3 and endpoint in proc.stderr and "6.0.0" in proc.stderr, proc.stderr
    assert len(proc.stderr.splitlines()) == 1


def test_the_target_on_two_rpc_servers_gives_the_local_greedy_output(model_path, batch_invariant):
    """Greedy output with the target's layers split over two loopback RPC servers equals local
    target-only output, for n-gram drafting and for a local draft model."""
    smol = str(model_path(SMOL))
    common = ("-m", smol, "-p", PROMPT, "-n", "48", "--temp", "0", "-t", "1", "-c", "1024")
    local = speculate_json(*common, "--spec-type", "none")["text"]
    with rpc_server() as (a, first), rpc_server() as (b, second):
        servers = f"{first},{second}"
        logged = speculate(*common, "--rpc", servers, "--spec-type", "ngram-simple", "--json",
                           env={"SPECULATE_LLAMA_LOG": "1"})
        assert logged.returncode == 0, logged.stderr
        assert "assigned to device RPC0" in logged.stderr and "assigned to device RPC1" in logged.stderr
        assert "assigned to device CPU" not in logged.stderr.split("load_tensors: layer   0")[1]
        ngram = json.loads(logged.stdout)
        draft = speculate_json(*common, "--rpc", servers, "-md", smol, "--spec-type", "draft")
    assert ngram["text"] == local
    assert draft["text"] == local


def test_a_server_killed_mid_generation_ends_the_run_with_exit_1_and_the_text_so_far(model_path):
    with rpc_server() as (server, endpoint):
        proc = subprocess.Popen([SPECULATE, "-m", str(model_path(SMOL)), "--rpc", endpoint, "-p", PROMPT,
                                 "-n", "4000", "-c", "4096", "--temp", "0", "--ignore-eos", "-t", "1",
                                 "--spec-type", "none"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            first = proc.stdout.read(80)  # generation is under way
            assert len(first) == 80, proc.stderr.read().decode()
            server.kill()
            t0 = time.monotonic()
            rest, err = proc.communicate(timeout=30)
            assert time.monotonic() - t0 < 10
        finally:
            proc.kill()
            proc.wait()
    err = err.decode()
    assert proc.returncode == 1, err
    assert len(err.splitlines()) == 1 and endpoint in err, err
    assert "Traceback" not in err and "core dumped" not in err
    assert len(first + rest) >= 80


def test_rpc_flags_are_on_every_generating_command_and_doctor_reports_rpc(model_path):
    for command in ((), ("bench",), ("batch",), ("serve",)):
        text = speculate(*command, "--help", env={"COLUMNS": "200"}).stdout.decode()
        assert "--rpc" in text and "-dev" in text and "-devd" in text, command
    report = speculate_json("doctor", "-m", str(model_path(SMOL)))
    assert report["rpc"] is True and report["placement"] == "cpu" and report["gpu_offload"] is False


def test_a_device_that_is_not_there_is_a_usage_error(model_path):
    proc = speculate("-m", str(model_path(SMOL)), "-dev", "RPC7", "-p", "hi", "-n", "2")
    assert proc.returncode == 2 and "RPC7" in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_serve_ends_with_exit_1_and_one_line_when_its_rpc_server_dies(model_path):
    import urllib.request

    port = free_port()
    with rpc_server() as (server, endpoint):
        serve = subprocess.Popen([SPECULATE, "serve", "-m", str(model_path(SMOL)), "--rpc", endpoint, "-t", "1",
                                  "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                    break
                except OSError:
                    assert serve.poll() is None and time.monotonic() < deadline
                    time.sleep(0.5)
            body = json.dumps({"prompt": PROMPT, "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
                               "stream": True}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as response:
                assert response.read(200)  # streaming has begun
                server.kill()
                assert serve.wait(timeout=20) == 1
            err = serve.stderr.read()
        finally:
            serve.kill()
            serve.wait()
    lines = [line for line in err.splitlines() if line.startswith("speculate: error:")]
    assert len(lines) == 1 and endpoint in lines[0], err
    assert "Traceback" not in err and "core dumped" not in err


def test_a_server_gone_silent_blocks_the_run_until_sigterm_ends_it_with_130(model_path):
    """A server that greets and then never answers (a link gone silent): ggml waits in its RPC
    thread with no timeout, and the main thread on it inside llama.cpp, where Python's signal
    handlers never run. SIGTERM still ends the run, through rpc.py's watcher: one line, 130."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    endpoint = "127.0.0.1:%d" % listener.getsockname()[1]
    held = []

    def greet_then_fall_silent():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)
            conn.recv(1 + 8 + rpc.CAPS_SIZE, socket.MSG_WAITALL)
            conn.sendall((4 + rpc.CAPS_SIZE).to_bytes(8, "little") + bytes([rpc.PROTO_MAJOR, 0, 0, 0])
                         + bytes(rpc.CAPS_SIZE))

    threading.Thread(target=greet_then_fall_silent, daemon=True).start()
    proc = subprocess.Popen([SPECULATE, "-m", str(model_path(SMOL)), "--rpc", endpoint, "-p", "hi", "-n", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3)
        assert proc.poll() is None  # waiting inside ggml
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=rpc.GRACE + 10)
        assert time.monotonic() - t0 < rpc.GRACE + 5
    finally:
        proc.kill()
        proc.wait()
        listener.close()
        for conn in held:
            conn.close()
    assert proc.returncode == 130, err
    assert len(err.splitlines()) == 1 and "interrupted" in err and endpoint in err, err
    assert "Traceback" not in err and "core dumped" not in err
