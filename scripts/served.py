"""`speculate serve` on a free port for the benchmark scripts (bench_cache_ram.py, bench_fim.py,
bench_parallel.py): started with GGML_CPU_TILED_MM=0 (batch-invariant CPU kernels,
docs/exactness-and-builds.md) and no API key, waited for, asked, and stopped. `command` and `env`
start another server the same way (llama-server, which takes --port too), or with other kernels."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def speculate_executable() -> str:
    """The `speculate` command: on PATH, else beside this Python (a virtual environment's)."""
    return shutil.which("speculate") or str(Path(sys.executable).with_name("speculate"))


class Server:
    """`speculate serve` on a free port, until closed."""

    def __init__(self, flags: list[str], log: Path, command: list[str] | None = None,
                 env: dict[str, str] | None = None):
        """`command` (default: `speculate serve`) with --port and `flags`, in `env` (default: this
        process's, with GGML_CPU_TILED_MM=0 unless set), SPECULATE_API_KEY emptied in either."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        if command is None:
            command = [speculate_executable(), "serve"]
        env = {"GGML_CPU_TILED_MM": "0", **os.environ} if env is None else env
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([*command, "--port", str(self.port), *flags], stdout=out,
                                         stderr=subprocess.STDOUT, env={**env, "SPECULATE_API_KEY": ""})
        deadline = time.monotonic() + 1800  # the default pair may be pulled first
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"{' '.join(command[:2])} exited {self.proc.returncode}:\n"
                         f"{log.read_text(errors='replace')[-2000:]}")
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
