"""The servers a scenario talks to: `speculate serve`, or llama-server of the pinned llama.cpp,
on a free port of loopback, waited for, asked and stopped (`Server`); llama-server itself built
once from the sdist scripts/test.sh keeps (`llama_server_binary`).

A `Server` starts `speculate serve` with GGML_CPU_TILED_MM=0 (batch-invariant CPU kernels,
docs/exactness-and-builds.md) and no API key; `command` and `env` start another server the same
way (llama-server, which takes --port too), or with other kernels.

llama-server is built Release, static, with no web UI (-DLLAMA_USE_PREBUILT_UI=OFF: nothing
downloaded), into .cache/llama-server/KEY/ (KEY: the sdist's sha256 and the CMake flags; for this
machine's CPU, GGML_NATIVE, and without AMX where the CPU has it): 10 to 15 minutes on 2 cores,
the first time only.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from scripts.bench.harness import ROOT, failed, speculate

LLAMA_VERSION = "0.3.36"
SDIST = ROOT / ".cache" / "sdist" / f"llama_cpp_python-{LLAMA_VERSION}.tar.gz"
SERVER_CACHE = ROOT / ".cache" / "llama-server"


def amx_off() -> list[str]:
    """On a CPU with AMX (Intel Xeon since Sapphire Rapids) the native build's AMX matmul crashes
    in the pinned llama.cpp (its issue 20824), where llama-server puts weights by default: left
    out of the build, as scripts/test.sh leaves it out of the binding's."""
    try:
        cpu = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    off = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    return [f"-DCMAKE_C_FLAGS={off}", f"-DCMAKE_CXX_FLAGS={off}"] if re.search(r"\bamx_tile\b", cpu) else []


# Release, one static binary, no web UI (LLAMA_USE_PREBUILT_UI=OFF: nothing downloaded), no HTTPS
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_SERVER=ON",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
               "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_OPENSSL=OFF", *amx_off()]
def llama_server_binary() -> Path:
    """llama-server from the sdist scripts/test.sh keeps, built once and cached under a key of its sha256."""
    if not SDIST.exists():
        sys.exit(f"{SDIST} missing: scripts/test.sh downloads it")
    digest = hashlib.sha256(SDIST.read_bytes())
    digest.update(" ".join(CMAKE_FLAGS).encode())
    binary = SERVER_CACHE / digest.hexdigest()[:16] / "llama-server"
    if binary.exists():
        return binary
    work = binary.parent.with_suffix(".build")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    print(f"building llama-server from {SDIST.name} in {work} (10 to 15 minutes on 2 cores) ...",
          file=sys.stderr, flush=True)
    started = time.monotonic()
    with tarfile.open(SDIST) as tar:
        tar.extractall(work, filter="data")
    source = work / f"llama_cpp_python-{LLAMA_VERSION}" / "vendor" / "llama.cpp"
    with open(work / "build.log", "wb") as log:
        for cmd in (["cmake", "-S", str(source), "-B", str(work / "build"), *CMAKE_FLAGS],
                    ["cmake", "--build", str(work / "build"), "--target", "llama-server", "-j", "2"]):
            if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode:
                sys.exit(f"llama-server build failed: {' '.join(cmd)}; see {work / 'build.log'}")
    binary.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(work / "build" / "bin" / "llama-server", binary)
    shutil.copy2(work / "build.log", binary.with_name("build.log"))
    shutil.rmtree(work)
    print(f"built {binary} in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return binary


def free_port() -> int:
    """A port of 127.0.0.1 nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server on a free port, until closed."""

    def __init__(self, flags: list[str], log: Path, command: list[str] | None = None,
                 env: dict[str, str] | None = None):
        """`command` (default: `speculate serve`) with --port and `flags`, in `env` (default: this
        process's, with GGML_CPU_TILED_MM=0 unless set), SPECULATE_API_KEY emptied in either."""
        self.port = free_port()
        if command is None:
            command = [speculate(), "serve"]
        env = {"GGML_CPU_TILED_MM": "0", **os.environ} if env is None else env
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([*command, "--port", str(self.port), *flags], stdout=out,
                                         stderr=subprocess.STDOUT, env={**env, "SPECULATE_API_KEY": ""})
        deadline = time.monotonic() + 1800  # the default pair may be pulled first
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                failed(command[:2], self.proc.returncode, log.read_text(errors="replace"))
            try:
                if self.post("/health", None)[0] == 200:
                    return
            except (OSError, ValueError):  # not listening yet, or not answering JSON yet
                pass
            time.sleep(0.5)  # llama-server answers 503 while it loads
        self.close()
        sys.exit(f"{' '.join(command[:2])} did not start")

    def post(self, path: str, body: dict | None) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=3600)
        try:
            conn.request("POST" if body is not None else "GET", path, body=json.dumps(body) if body else None,
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read() or b"{}")
        finally:
            conn.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=120)
