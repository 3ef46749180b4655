"""llama.cpp's RPC backend: `speculate rpc-server`, the target's layers on RPC servers with
--rpc, exactness over loopback, and the faults (a server not there, a server killed mid-generation).

No outcome here depends on how fast the machine is: each test waits for something the programs
report (a line on stderr, a server's greeting, the first text on stdout, a command arriving at
a fake server the test holds silent) before it acts, and the wall-clock limits are only guards
against a hang (HANG)."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import threading
import time
from contextlib import contextmanager

import pytest

from speculative.decoding.settings import ModelSpec
from speculative.errors import ModelError, UsageError
from speculative.llamacpp import devices as ggml, rpc
from speculative.llamacpp.devices import DEV_CPU, DEV_GPU, rpc_available
from speculative.llamacpp.model import LlamaModel
from tests.conftest import SMOL, SPECULATE, speculate, speculate_here, speculate_json

real = pytest.mark.real
PROMPT = "def fibonacci(n):\n    # return the n-th Fibonacci number\n"
HANG = 300  # seconds, several times the slowest run here: only a guard against a hang, never measured


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lines:
    """A child's stderr (text), read line by line in a thread: a test waits for the line the
    child writes when it is ready, and still gets all it wrote."""

    def __init__(self, stream):
        self._lines: list[str] = []
        self._changed = threading.Condition()
        self._ended = False
        self._reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._reader.start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._changed:
                self._lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def wait_for(self, prefix: str, timeout: float = HANG) -> str:
        """The first line starting with prefix, once the child has written it."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = next((line for line in self._lines if line.startswith(prefix)), None)
                if found is not None:
                    return found
                if self._ended:
                    pytest.fail(f"the process ended without writing {prefix!r}: {''.join(self._lines)[-3000:]}")
                if not self._changed.wait(deadline - time.monotonic()):
                    pytest.fail(f"no {prefix!r} within {timeout} s (hung?): {''.join(self._lines)[-3000:]}")

    def text(self) -> str:
        """All of it, once the child has closed its stderr (call after it ended)."""
        self._reader.join(HANG)
        with self._changed:
            return "".join(self._lines)


def wait_for_greeting(proc: subprocess.Popen, endpoint: str, err: Lines) -> None:
    """ggml's server thread listens a moment after rpc-server said it serves (it reports nothing
    itself): connect until the server answers ggml's greeting."""
    deadline = time.monotonic() + HANG
    while True:
        try:
            rpc.check(endpoint)
            return
        except ModelError:
            if proc.poll() is not None:
                pytest.fail(f"rpc-server ended with {proc.returncode}: {err.text()}")
            if time.monotonic() > deadline:
                pytest.fail(f"rpc-server did not answer on {endpoint} within {HANG} s (hung?)")
            time.sleep(0.05)


@contextmanager
def rpc_server(*args: str, port: int | None = None):
    """A `speculate rpc-server` on this machine, ready: it said it serves (its signal handlers are
    in place) and answered ggml's greeting on loopback. Yields (process, endpoint, its stderr)."""
    port = port or free_port()
    proc = subprocess.Popen([SPECULATE, "rpc-server", "-p", str(port), "-t", "1", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    endpoint = f"127.0.0.1:{port}"
    err = Lines(proc.stderr)
    try:
        err.wait_for("speculate rpc-server: serving")
        wait_for_greeting(proc, endpoint, err)
        yield proc, endpoint, err
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def model_loads(log: str) -> list[dict[str, set[str]]]:
    """llama.cpp's load log (SPECULATE_LLAMA_LOG=1), one entry per model in load order (the
    target first): the devices its layers were assigned to, and those holding its weights
    ("CPU_Mapped", "RPC0[127.0.0.1:PORT]", ...)."""
    loads = log.split("llama_model_loader: loaded meta data")[1:]
    return [{"layers": set(re.findall(r"load_tensors: layer +\d+ assigned to device ([^,\s]+)", load)),
             "weights": set(re.findall(r"load_tensors: +(\S+) model buffer size", load))} for load in loads]


def servers_holding(weights: set[str]) -> set[str]:
    """The RPC servers among model_loads' weight buffers ("RPC0[127.0.0.1:PORT]": PORT's first device)."""
    return {name.partition("[")[2].rstrip("]") for name in weights if name.startswith("RPC")}


@pytest.fixture(scope="module", autouse=True)
def rpc_build():
    if not rpc_available():
        pytest.fail("llama.cpp was built without RPC: build it as scripts/test.sh does (-DGGML_RPC=ON)")


# -- in-process: no model, no server ------------------------------------------------------------

def test_rpc_endpoints_are_read_as_llama_cpp_reads_them():
    assert rpc.parse("127.0.0.1:50052,gpu-box:1") == ["127.0.0.1:50052", "gpu-box:1"]
    for bad in ("127.0.0.1", "host:port", ":50052", "host:0", "host:70000", "a:1,"):
        with pytest.raises(UsageError):
            rpc.parse(bad)


def test_an_rpc_server_not_there_is_reported_at_once_as_refused():
    """Nothing listens: the connection is refused, which the check reports as such, without
    waiting for its timeout (a minute here: the report, not a clock, tells which happened)."""
    endpoint = f"127.0.0.1:{free_port()}"
    with pytest.raises(ModelError, match="cannot connect") as refused:
        rpc.check(endpoint, timeout=60)
    assert endpoint in str(refused.value)


class _LibWithoutRpc:
    """libggml as a build without RPC shows it: its registry has no "RPC" backend."""

    def __init__(self, lib):
        self._lib = lib

    def ggml_backend_reg_by_name(self, name: bytes):
        return None if name == b"RPC" else self._lib.ggml_backend_reg_by_name(name)

    def __getattr__(self, name: str):
        return getattr(self._lib, name)


@pytest.fixture
def build_without_rpc(monkeypatch):
    lib = ggml._lib()
    monkeypatch.setattr(ggml, "_lib", lambda: _LibWithoutRpc(lib))
    assert not rpc_available()


@pytest.mark.parametrize("command", ["--rpc", "rpc-server"])
def test_a_build_without_rpc_exits_3_with_one_line(build_without_rpc, tmp_path, command):
    """Refused before anything else: no server is connected to (the endpoint has none, which
    would be another error), and rpc-server neither serves nor says it does."""
    port = str(free_port())
    args = (("-m", str(tmp_path / "never-loaded.gguf"), "--rpc", f"127.0.0.1:{port}", "-p", "hi", "-n", "2")
            if command == "--rpc" else ("rpc-server", "-p", port))
    proc = speculate_here(*args)
    code, err = proc.returncode, proc.stderr
    assert code == 3, err
    assert err.startswith("speculate: error: this llama.cpp build has no RPC support") and err.count("\n") == 1, err


@pytest.fixture
def devices(monkeypatch):
    """ggml's device registry as the test sets it (name -> (type, an RPC server's)), this machine's
    CPU to begin with; connecting --rpc's servers adds a device RPC0, RPC1, ... for each."""
    registry = {"CPU": (DEV_CPU, False)}
    monkeypatch.setattr(ggml, "_devices", lambda: dict(registry))

    def connect(endpoints):
        names = [f"RPC{i}" for i in range(len(endpoints))]
        registry.update({name: (DEV_GPU, True) for name in names})
        return names

    monkeypatch.setattr(rpc, "connect", connect)
    return registry


DEVICE_CHOICES = {  # (this machine's GPUs, the flags) -> (target's devices, draft's); None: llama.cpp's choice
    "cpu-only": ((), {}, (None, None)),
    "gpu-default": (("CUDA0",), {}, (None, None)),
    "dev-devd-follows": (("CUDA0",), {"device": "CUDA0"}, (("CUDA0",), ("CUDA0",))),
    "dev-devd-none": (("CUDA0",), {"device": "CUDA0", "device_draft": "none"}, (("CUDA0",), ())),
    # with --rpc the target's layers go to the servers' devices, the draft stays here:
    "rpc-draft-on-cpu": ((), {"rpc": "a:1,b:2"}, (("RPC0", "RPC1"), ())),
    "rpc-draft-on-gpu": (("CUDA0",), {"rpc": "a:1,b:2"}, (("RPC0", "RPC1"), ("CUDA0",))),
    "rpc-dev-none": (("CUDA0",), {"rpc": "a:1", "device": "none"}, ((), ("CUDA0",))),
    "rpc-dev-gpu": (("CUDA0",), {"rpc": "a:1", "device": "CUDA0"}, (("CUDA0",), ("CUDA0",))),
    "rpc-dev-devd": ((), {"rpc": "a:1,b:2", "device": "RPC1", "device_draft": "RPC0"}, (("RPC1",), ("RPC0",))),
    "rpc-devd-none": ((), {"rpc": "a:1", "device_draft": "none"}, (("RPC0",), ())),
}


@pytest.mark.parametrize("gpus, flags, expected", DEVICE_CHOICES.values(), ids=DEVICE_CHOICES.keys())
def test_each_model_gets_the_devices_llama_cpp_would_give_it(devices, tmp_path, gpus, flags, expected):
    from speculative.cli.options import ModelOptions
    from tests.gguf_builder import write_tiny_llama

    devices.update({name: (DEV_GPU, False) for name in gpus})
    target, draft = write_tiny_llama(tmp_path / "target.gguf"), write_tiny_llama(tmp_path / "draft.gguf")
    specs = ModelOptions(model=str(target), model_draft=str(draft), **flags).specs(use_draft=True)
    assert (specs[0].devices, specs[1].devices) == expected


def test_an_rpc_device_without_rpc_is_a_usage_error(devices):
    from speculative.cli.options import ModelOptions

    with pytest.raises(UsageError, match="RPC0"):
        ModelOptions(device_draft="RPC0").specs(use_draft=True)


# -- real: llama.cpp, its RPC server, real models -----------------------------------------------

@real
def test_a_model_on_a_machine_without_gpu_takes_the_cpu_path_in_an_rpc_build(model_path):
    """llama_supports_gpu_offload() is true with RPC compiled in; -ngl -1 still keeps every layer
    on the CPU here, so -fa auto is off and no batch-variant kernel is reported."""
    import llama_cpp as ll

    assert ll.llama_supports_gpu_offload()
    with LlamaModel(ModelSpec(model_path(SMOL), name=SMOL, n_ctx=256)) as model:
        assert model.placement == "cpu"
        assert model._flash_attn_type == ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        assert model.kernels == []


@real
def test_rpc_server_stops_on_sigterm_and_sigint_with_exit_0_and_the_port_free():
    with rpc_server() as (proc, endpoint, _):
        port = int(endpoint.rpartition(":")[2])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=HANG) == 0
    with rpc_server(port=port) as (proc, endpoint, _):  # the same port at once, after a client came and went
        rpc.check(endpoint)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=HANG) == 0


@real
def test_rpc_server_off_loopback_prints_llama_cpps_warning():
    with rpc_server("-H", "0.0.0.0") as (proc, _, err):  # all addresses: loopback's too
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=HANG) == 0
        text = err.text()
    assert "Never expose the RPC server to an open network!" in text and "0.0.0.0" in text


@real
def test_rpc_server_rejects_an_unknown_device():
    proc = speculate("rpc-server", "-d", "NOPE0", "-p", str(free_port()))
    assert proc.returncode == 2 and "NOPE0" in proc.stderr and len(proc.stderr.splitlines()) == 1


@real
def test_an_rpc_server_not_there_exits_3_naming_it(model_path):
    """Reported as refused (test_an_rpc_server_not_there_is_reported_at_once_as_refused: without
    waiting), before ggml, which would abort, is given the endpoint."""
    endpoint = f"127.0.0.1:{free_port()}"
    proc = speculate("-m", str(model_path(SMOL)), "--rpc", endpoint, "-p", "hi", "-n", "4", timeout=HANG)
    assert proc.returncode == 3, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and endpoint in proc.stderr and "cannot connect" in proc.stderr
    assert "Traceback" not in proc.stderr and "core dumped" not in proc.stderr


@real
def test_a_server_that_does_not_greet_exits_3_naming_it(model_path):
    with socket.socket() as listener:  # accepts (the kernel does), never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        endpoint = "127.0.0.1:%d" % listener.getsockname()[1]
        proc = speculate("-m", str(model_path(SMOL)), "--rpc", endpoint, "-p", "hi", "-n", "4",
                         timeout=rpc.TIMEOUT + HANG)
    assert proc.returncode == 3 and endpoint in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert f"no answer within {rpc.TIMEOUT:g} s" in proc.stderr


@real
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
        proc = speculate("-m", str(model_path(SMOL)), "--rpc", endpoint, "-p", "hi", "-n", "4", timeout=HANG)
    assert proc.returncode == 3 and endpoint in proc.stderr and "6.0.0" in proc.stderr, proc.stderr
    assert len(proc.stderr.splitlines()) == 1


@real
def test_the_target_on_two_rpc_servers_gives_the_local_greedy_output(model_path, batch_invariant):
    """Greedy output with the target's layers split over two loopback RPC servers equals local
    target-only output, for n-gram drafting and for a local draft model. The draft model (the
    target itself, so that greedy drafts are accepted) drafts and is accepted, and by default
    its layers and weights stay on this machine's CPU while the target's are on the servers."""
    smol = str(model_path(SMOL))
    common = ("-m", smol, "-p", PROMPT, "-n", "48", "--temp", "0", "-t", "1", "-c", "1024")
    local = speculate_json(*common, "--spec-type", "none")["text"]
    with rpc_server() as (_, first, _), rpc_server() as (_, second, _):
        servers = f"{first},{second}"
        ngram = speculate_json(*common, "--rpc", servers, "--spec-type", "ngram-simple")
        logged = speculate(*common, "--rpc", servers, "-md", smol, "--spec-type", "draft", "--json",
                           env={"SPECULATE_LLAMA_LOG": "1"})
    assert logged.returncode == 0, logged.stderr[-3000:]
    draft = json.loads(logged.stdout)
    assert ngram["text"] == local
    assert draft["text"] == local
    assert draft["n_drafted"] > 0 and 0 < draft["n_accept"] <= draft["n_drafted"], draft
    target_load, draft_load = model_loads(logged.stderr)
    assert target_load["layers"] == {"RPC0", "RPC1"}, target_load
    assert servers_holding(target_load["weights"]) == {first, second}, target_load
    assert draft_load["layers"] == {"CPU"}, draft_load
    assert all(name.startswith("CPU") for name in draft_load["weights"]), draft_load


@real
def test_dev_and_devd_put_each_model_where_they_say(model_path):
    """-dev none keeps the target on the CPU, -devd RPC0 sends the draft to the server: what
    llama.cpp itself loads where, by its log."""
    smol = str(model_path(SMOL))
    with rpc_server() as (_, endpoint, _):
        logged = speculate("-m", smol, "-md", smol, "--rpc", endpoint, "-dev", "none", "-devd", "RPC0",
                           "--spec-type", "draft", "-p", "hi", "-n", "4", "--temp", "0", "-t", "1", "-c", "512",
                           env={"SPECULATE_LLAMA_LOG": "1"})
    assert logged.returncode == 0, logged.stderr[-3000:]
    target_load, draft_load = model_loads(logged.stderr)
    assert target_load["layers"] == {"CPU"}, target_load
    assert all(name.startswith("CPU") for name in target_load["weights"]), target_load
    assert draft_load["layers"] == {"RPC0"} and servers_holding(draft_load["weights"]) == {endpoint}, draft_load


@real
def test_a_server_killed_mid_generation_ends_the_run_with_exit_1_and_the_text_so_far(model_path):
    """The server is killed once the first text is out, with thousands of tokens to go, each a
    round trip to it: the run cannot have ended on its own, and ends with ggml's abort, hooked."""
    with rpc_server() as (server, endpoint, _):
        proc = subprocess.Popen([SPECULATE, "-m", str(model_path(SMOL)), "--rpc", endpoint, "-p", PROMPT,
                                 "-n", "4000", "-c", "4096", "--temp", "0", "--ignore-eos", "-t", "1",
                                 "--spec-type", "none"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            first = proc.stdout.read(80)  # generation is under way
            assert len(first) == 80, proc.stderr.read().decode()
            server.kill()
            rest, err = proc.communicate(timeout=HANG)
        finally:
            proc.kill()
            proc.wait()
    err = err.decode()
    assert proc.returncode == 1, err
    assert len(err.splitlines()) == 1 and endpoint in err and "llama.cpp stopped with RPC server" in err, err
    assert "Traceback" not in err and "core dumped" not in err
    assert len(first + rest) >= 80


@real
def test_rpc_flags_are_on_every_generating_command_and_doctor_reports_rpc(model_path):
    for command in ((), ("bench",), ("batch",), ("serve",)):
        text = speculate(*command, "--help-all", env={"COLUMNS": "200"}).stdout.decode()
        assert "--rpc" in text and "-dev" in text and "-devd" in text, command
    report = speculate_json("doctor", "-m", str(model_path(SMOL)))
    assert report["rpc"] is True and report["placement"] == "cpu" and report["gpu_offload"] is False


@real
def test_a_device_that_is_not_there_is_a_usage_error(model_path):
    proc = speculate("-m", str(model_path(SMOL)), "-dev", "RPC7", "-p", "hi", "-n", "2")
    assert proc.returncode == 2 and "RPC7" in proc.stderr and len(proc.stderr.splitlines()) == 1


def wait_for_health(port: int, serve: subprocess.Popen) -> None:
    """uvicorn listens a moment after serve's line (it reports nothing): ask until it answers."""
    import urllib.request

    deadline = time.monotonic() + HANG
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=HANG)
            return
        except OSError:
            assert serve.poll() is None and time.monotonic() < deadline, f"serve ended with {serve.returncode}"
            time.sleep(0.05)


@real
def test_serve_ends_with_exit_1_and_one_line_when_its_rpc_server_dies(model_path):
    import urllib.request

    port = free_port()
    with rpc_server() as (server, endpoint, _):
        serve = subprocess.Popen([SPECULATE, "serve", "-m", str(model_path(SMOL)), "--rpc", endpoint, "-t", "1",
                                  "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        err = Lines(serve.stderr)
        try:
            err.wait_for("speculate serve:")  # the models loaded and calibrated, the app about to run
            wait_for_health(port, serve)
            body = json.dumps({"prompt": PROMPT, "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
                               "stream": True}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=HANG) as response:
                assert response.read(200)  # streaming has begun, thousands of tokens to go
                server.kill()
                assert serve.wait(timeout=HANG) == 1
            text = err.text()
        finally:
            serve.kill()
            serve.wait()
    lines = [line for line in text.splitlines() if line.startswith("speculate: error:")]
    assert len(lines) == 1 and endpoint in lines[0] and "llama.cpp stopped with RPC server" in lines[0], text
    assert "Traceback" not in text and "core dumped" not in text


@real
def test_a_server_gone_silent_blocks_the_run_until_sigterm_ends_it_with_130(model_path):
    """A server that greets and then never answers (a link gone silent): ggml waits in its RPC
    thread with no timeout, and the main thread on it inside llama.cpp, where Python's signal
    handlers never run. SIGTERM, sent once ggml is waiting for an answer, still ends the run
    through rpc.py's watcher, after its grace: one line, 130."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    endpoint = "127.0.0.1:%d" % listener.getsockname()[1]
    held = []
    waiting = threading.Event()  # ggml sent a command after the greeting: it waits for an answer

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
            if conn.recv(1):  # rpc.check's connection closes after the greeting; ggml's sends on
                waiting.set()

    threading.Thread(target=greet_then_fall_silent, daemon=True).start()
    proc = subprocess.Popen([SPECULATE, "-m", str(model_path(SMOL)), "--rpc", endpoint, "-p", "hi", "-n", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + HANG
        while not waiting.wait(0.1):
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, f"ggml sent nothing after the greeting within {HANG} s"
        assert proc.poll() is None  # waiting inside ggml
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=rpc.GRACE + HANG)
        took = time.monotonic() - signalled
    finally:
        proc.kill()
        proc.wait()
        listener.close()
        for conn in held:
            conn.close()
    assert proc.returncode == 130, err
    assert len(err.splitlines()) == 1 and "interrupted while waiting for RPC server" in err and endpoint in err, err
    assert "Traceback" not in err and "core dumped" not in err
    assert took >= rpc.GRACE  # the watcher gave the run its grace to end the usual way first
