"""`speculate rpc-server`: ggml's own RPC server (llama.cpp's rpc-server) on this machine's devices."""

from __future__ import annotations

import ipaddress
import os
import signal
import sys
from pathlib import Path
from typing import Optional

import typer

from speculative.errors import GenerationError, UsageError

WARNING = """
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
WARNING: Host ('{host}') is != '127.0.0.1'
         Never expose the RPC server to an open network!
         This is an experimental feature and is not secure!
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
"""


def rpc_server_command(
    host: str = typer.Option("127.0.0.1", "-H", "--host", help="Host to bind to. The protocol is "
                             "unauthenticated: anything but loopback is for trusted networks only."),
    port: int = typer.Option(50052, "-p", "--port", help="Port to bind to."),
    threads: Optional[int] = typer.Option(None, "-t", "--threads",
                                          help="Threads for the CPU device (default: half the cores)."),
    device: Optional[str] = typer.Option(None, "-d", "--device", metavar="<dev1,dev2,...>",
                                         help="Devices to serve (default: the GPUs, else the CPU)."),
    cache: bool = typer.Option(False, "-c", "--cache", help="Keep large tensors the clients send in a "
                               "local file cache ($LLAMA_CACHE/rpc, else ~/.cache/llama.cpp/rpc)."),
) -> None:
    """Serve this machine's CPU or GPUs to llama.cpp RPC clients (`speculate --rpc HOST:PORT`), as
    llama.cpp's rpc-server does. Ctrl-C or SIGTERM stop it with exit 0, the port free at once."""
    if not 0 < port < 65536:
        raise UsageError(f"-p/--port must be 1..65535, got {port}")
    if threads is not None and threads < 1:
        raise UsageError(f"-t/--threads must be >= 1, got {threads}")
    from speculative.llamacpp import devices as ggml  # loads llama.cpp: imported by this command (start-up time)

    ggml.require_rpc()
    devices = _devices(device)
    if not _loopback(host):
        print(WARNING.format(host=host), file=sys.stderr)
    cache_dir = _cache_dir() if cache else None
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _stop)
    endpoint = f"{host}:{port}"
    print(f"speculate rpc-server: serving {', '.join(devices)} on {endpoint} (Ctrl-C or SIGTERM stops it)",
          file=sys.stderr, flush=True)
    server = ggml.serve_rpc(endpoint, devices, threads or max(1, (os.cpu_count() or 2) // 2), cache_dir)
    server.join()  # returns only when ggml could not serve; a signal ends the process in _stop
    raise GenerationError(f"the RPC server could not serve on {endpoint} (address not available, or port in use?)")


def _devices(value: Optional[str]) -> list[str]:
    """-d as llama.cpp's rpc-server reads it, or its default: the GPUs, else the CPU."""
    from speculative.llamacpp import devices as ggml

    if value is None:
        return ggml.offload_devices(remote=False) or ggml.cpu_devices()[:1]
    known = ggml.offload_devices(remote=False) + ggml.cpu_devices()
    names = [name for name in value.replace("/", ",").split(",") if name]
    for name in names:
        if name not in known:
            raise UsageError(f"-d/--device: unknown device {name!r} (devices: {', '.join(known)})")
    return names


def _cache_dir() -> str:
    """llama.cpp's rpc-server cache: $LLAMA_CACHE/rpc, else $XDG_CACHE_HOME or ~/.cache, /llama.cpp/rpc."""
    user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llama.cpp"
    path = Path(os.environ.get("LLAMA_CACHE") or user) / "rpc"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _stop(signum, frame) -> None:  # pragma: no cover - ends the process
    """Ctrl-C or SIGTERM: ggml's server call never returns; end the process (its sockets close)."""
    from speculative.llamacpp import devices as ggml

    ggml.flush_c_stdio()
    os._exit(0)
