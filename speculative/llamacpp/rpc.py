"""llama.cpp's RPC servers (ggml-rpc) as speculate reaches them: endpoints checked before ggml
sees them, and ggml's aborts turned into one line and an exit code.

ggml's RPC client aborts the process when a server is not there or stops answering
(GGML_ABORT in ggml-rpc.cpp), which would be a core dump and a backtrace. So every endpoint is
first connected to here, with a timeout, and greeted as ggml greets it (RPC_CMD_HELLO: the
server answers with its protocol version); what still goes wrong later (a server killed in the
middle of a generation) reaches ggml's abort hook, which ends the process with the text so far
flushed, one line naming the servers, and exit 1. A link that goes silent without a reset
blocks inside ggml's transport, which has no timeouts (see docs/rpc.md); Python's signal handlers
cannot run then (the main thread waits inside llama.cpp), so a watcher thread ends the process
when Ctrl-C or SIGTERM has not done so within GRACE seconds.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import sys
import threading
from typing import Sequence

from speculative.errors import ModelError, UsageError
from speculative.llamacpp import devices

PROTO_MAJOR, PROTO_MINOR = 7, 0  # RPC_PROTO_*_VERSION in ggml-rpc.h of the pinned llama.cpp
HELLO, CAPS_SIZE = 14, 24  # RPC_CMD_HELLO; rpc_msg_hello_req is conn_caps[24]
TIMEOUT = 5.0
GRACE = 5.0  # seconds a signal has to end the run the usual way before the watcher does


def parse(servers: str) -> list[str]:
    """--rpc HOST:PORT[,HOST:PORT...] as llama.cpp reads it (the host is what comes before the first ':')."""
    endpoints = [s.strip() for s in servers.split(",")]
    for endpoint in endpoints:
        host, _, port = endpoint.partition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"--rpc: expected HOST:PORT[,HOST:PORT...], got {endpoint!r}")
    return endpoints


def check(endpoint: str, timeout: float = TIMEOUT) -> None:
    """Connect to the server and exchange ggml's greeting; ModelError (exit 3) naming it if that fails."""
    host, _, port = endpoint.partition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            sock.sendall(struct.pack("<BQ", HELLO, CAPS_SIZE) + bytes(CAPS_SIZE))
            reply = _recv(sock, 8 + 4 + CAPS_SIZE, endpoint)
    except socket.timeout:
        raise ModelError(f"RPC server {endpoint}: no answer within {timeout:g} s (busy with another "
                         "client, or not an RPC server)") from None
    except OSError as e:
        raise ModelError(f"RPC server {endpoint}: cannot connect ({e.strerror or e})") from None
    size, major, minor, patch = struct.unpack("<QBBB", reply[:11])
    if size != 4 + CAPS_SIZE:
        raise ModelError(f"RPC server {endpoint}: not a ggml RPC server of this version (unexpected greeting)")
    if major != PROTO_MAJOR or minor > PROTO_MINOR:
        raise ModelError(f"RPC server {endpoint} speaks RPC protocol {major}.{minor}.{patch}, this llama.cpp "
                         f"{PROTO_MAJOR}.{PROTO_MINOR}: install the same llama-cpp-python on both machines")


def _recv(sock: socket.socket, n: int, endpoint: str) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ModelError(f"RPC server {endpoint}: closed the connection during the greeting")
        data += chunk
    return data


def connect(endpoints: Sequence[str]) -> list[str]:
    """Check every server, register their devices with ggml and hook ggml's aborts; the devices' names."""
    devices.require_rpc()
    for endpoint in endpoints:
        check(endpoint)
    devices.on_ggml_abort(lambda message: _aborted(endpoints, message))
    _watch_signals(endpoints)
    return devices.add_rpc_servers(endpoints)


def _aborted(endpoints: Sequence[str], message: str) -> None:  # pragma: no cover - ends the process
    """ggml is about to abort: flush the text so far, say which servers were in use, exit 1."""
    try:
        sys.stdout.flush()
    except Exception:
        pass
    text = " ".join(message.split())
    detail = text.partition(": ")[2] or text  # ggml's message follows "file:line: "
    os.write(2, f"speculate: error: llama.cpp stopped with RPC server(s) {', '.join(endpoints)} in use: "
                f"{detail}\n".encode(errors="replace"))
    os._exit(1)


def _watch_signals(endpoints: Sequence[str]) -> None:
    """Ctrl-C and SIGTERM, even while ggml waits on a silent server: Python's handlers write the
    signal to a wakeup pipe at once, but run only when the main thread is back in Python."""
    if threading.current_thread() is not threading.main_thread():
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write)
    if previous != -1:  # someone else's: leave it theirs
        signal.set_wakeup_fd(previous)
        os.close(read)
        os.close(write)
        return

    def watch() -> None:  # pragma: no cover - ends the process
        os.read(read, 1)
        threading.Event().wait(GRACE)  # the run ends the usual way (130, statistics) unless stuck
        try:
            sys.stdout.flush()
        except Exception:
            pass
        os.write(2, f"speculate: error: interrupted while waiting for RPC server(s) {', '.join(endpoints)}\n"
                    .encode(errors="replace"))
        os._exit(130)

    threading.Thread(target=watch, daemon=True, name="rpc-signals").start()
