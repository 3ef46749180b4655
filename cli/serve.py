"""`speculate serve`: the models behind an OpenAI-compatible HTTP API (llama-server's role)."""

from __future__ import annotations

import asyncio
import copy
import signal
import socket
import sys
import time
from typing import List, Optional

import typer
import uvicorn

from speculative.engine import Engine
from speculative.errors import UsageError
from speculative.server import create_app, is_loopback
from speculative.serving import Worker

from . import options

N = "Server"
GRACE_SECONDS = 10  # on Ctrl-C or SIGTERM, how long the running generation may go on
LAST_STEP_SECONDS = 5  # then the time its last step and response may take before uvicorn cancels it


class _Uvicorn(uvicorn.Server):
    """uvicorn, which owns SIGINT and SIGTERM while it runs; on the first, waiting requests
    are refused at once and the running generation ends within the grace period."""

    def __init__(self, config: uvicorn.Config, worker: Worker):
        super().__init__(config)
        self.worker = worker

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:  # a signal handler may interrupt the loop holding the worker's lock
            asyncio.get_running_loop().call_soon_threadsafe(self.worker.drain, GRACE_SECONDS)
        super().handle_exit(sig, frame)

    def run_quietly(self, sock: socket.socket) -> None:
        """Run until a signal stops it. uvicorn raises that signal again once it has shut
        down, for the handler it found: in speculate's, it would become a KeyboardInterrupt
        inside the closing event loop. So the signals are ignored until uvicorn takes them,
        and speculate's handlers come back afterwards."""
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in handled}
        try:
            self.run(sockets=[sock])
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def serve_command(
    host: str = typer.Option("127.0.0.1", "--host", rich_help_panel=N,
                             help="Address to listen on. Anything but loopback needs an API key."),
    port: int = typer.Option(8080, "--port", rich_help_panel=N, help="Port to listen on (0: any free one)."),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", envvar="SPECULATE_API_KEY", show_envvar=True, rich_help_panel=N,
        help="Require 'Authorization: Bearer KEY' on every endpoint but /health. Prefer the environment "
             "variable: a command line is visible to every user of the machine."),
    parallel: int = typer.Option(
        8, "-np", "--parallel", rich_help_panel=N,
        help="How many requests may wait while one generates; more are refused with 503 and Retry-After."),
    timeout: float = typer.Option(
        600.0, "-to", "--timeout", rich_help_panel=N,
        help="Seconds a request may take, waiting included: a generation still running then ends "
             "with what it has (finish_reason length); one still waiting gets 503."),
    model: Optional[str] = options.MODEL,
    model_draft: Optional[str] = options.MODEL_DRAFT,
    ctx_size: int = options.CTX_SIZE,
    ctx_size_draft: Optional[int] = options.CTX_SIZE_DRAFT,
    n_gpu_layers: int = options.N_GPU_LAYERS,
    n_gpu_layers_draft: Optional[int] = options.N_GPU_LAYERS_DRAFT,
    threads: Optional[int] = options.THREADS,
    threads_draft: Optional[int] = options.THREADS_DRAFT,
    batch_size: int = options.BATCH_SIZE,
    flash_attn: str = options.FLASH_ATTN,
    lora: Optional[List[str]] = options.LORA,
    lora_scaled: Optional[List[str]] = options.LORA_SCALED,
    lora_draft: Optional[List[str]] = options.LORA_DRAFT,
    spec_type: Optional[str] = options.SPEC_TYPE,
    draft_max: Optional[int] = options.DRAFT_MAX,
    draft_min: int = options.DRAFT_MIN,
    draft_p_min: float = options.DRAFT_P_MIN,
    spec_accept: str = options.SPEC_ACCEPT,
    draft_branches: int = options.DRAFT_BRANCHES,
    draft_p_split: float = options.DRAFT_P_SPLIT,
    ngram_n: Optional[int] = options.NGRAM_N,
    ngram_m: Optional[int] = options.NGRAM_M,
    ngram_min_hits: Optional[int] = options.NGRAM_MIN_HITS,
    simple_n: Optional[int] = options.SIMPLE_N,
    simple_m: Optional[int] = options.SIMPLE_M,
    simple_hits: Optional[int] = options.SIMPLE_HITS,
    map_n: Optional[int] = options.MAP_N,
    map_m: Optional[int] = options.MAP_M,
    map_hits: Optional[int] = options.MAP_HITS,
) -> None:
    """Serve the models over an OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions
    (streamed or not), /v1/models and /health. One generation runs at a time; Ctrl-C or SIGTERM
    stops the server (exit 0)."""
    api_key = api_key or None  # an empty SPECULATE_API_KEY is no key
    if not is_loopback(host) and api_key is None:
        raise UsageError(f"--host {host} is reachable from other machines: set an API key "
                         "(SPECULATE_API_KEY or --api-key), or listen on 127.0.0.1")
    if not 0 <= port <= 65535 or parallel < 0 or not timeout > 0:
        raise UsageError("--port must be in [0, 65535], --parallel >= 0 and --timeout > 0")
    spec = options.spec_settings(
        spec_type, draft_max, draft_min, draft_p_min, spec_accept, branches=draft_branches, p_split=draft_p_split,
        ngram=(ngram_n, ngram_m, ngram_min_hits), simple=(simple_n, simple_m, simple_hits),
        map_k=(map_n, map_m, map_hits))
    use_draft = options.uses_draft_model(spec, options.draft_available(model, model_draft))
    target, draft = options.model_specs(
        model, model_draft, use_draft, ctx_size=ctx_size, ctx_size_draft=ctx_size_draft,
        n_gpu_layers=n_gpu_layers, n_gpu_layers_draft=n_gpu_layers_draft, threads=threads,
        threads_draft=threads_draft, batch_size=batch_size, flash_attn=flash_attn,
        lora=lora, lora_scaled=lora_scaled, lora_draft=lora_draft, branches=spec.branches)
    sock = _bind(host, port)  # before loading: a taken port fails at once, not after the models load
    with sock, Engine(target, draft, notify=lambda message: print(message, file=sys.stderr)) as engine:
        engine.make_drafter(spec)  # auto measures its costs now rather than in the first request
        model_info = {"id": target.name, "created": int(time.time()),
                      "meta": {"n_ctx": engine.target.n_ctx, "draft": draft.name if draft else None,
                               "spec_type": ",".join(spec.types)}}
        with Worker(engine, spec, waiting=parallel, timeout=timeout) as worker:
            app = create_app(worker, model_info, api_key, loopback_only=is_loopback(host))
            server = _Uvicorn(uvicorn.Config(app, log_config=_log_config(), server_header=False, lifespan="off",
                                             timeout_graceful_shutdown=GRACE_SECONDS + LAST_STEP_SECONDS), worker)
            where = sock.getsockname()
            print(f"speculate serve: {target.name}" + (f" with draft {draft.name}" if draft else "")
                  + f", --spec-type {','.join(spec.types)}, on http://{_url_host(host)}:{where[1]}/v1 "
                  + ("(API key required)" if api_key else "(no API key)"), file=sys.stderr, flush=True)
            server.run_quietly(sock)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _log_config() -> dict:
    """uvicorn's logging, with the per-request lines of speculate.serve in the same format.
    Neither logs headers, so the API key never reaches a log."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["loggers"]["speculate"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config
