"""`speculate serve`: the models behind an OpenAI-compatible HTTP API (llama-server's role)."""

from __future__ import annotations

import json
import socket
import sys
import time
from typing import Optional

import typer

from speculative.decoding.settings import ModelSpec, SamplerSettings, SpecSettings
from speculative.engine.ram_cache import DEFAULT_MIB
from speculative.errors import UsageError

from . import options
from .progress import StatusLine

N = "Server"

METRICS = typer.Option(False, "--metrics", rich_help_panel=N,
                       help="Serve GET /metrics (Prometheus text), as llama-server's --metrics does.")
ALIAS = typer.Option(
    None, "-a", "--alias", rich_help_panel=N, metavar="STRING",
    help="The model's names in the API, comma-separated: /v1/models and every answer give the first in "
         "sorted order as its id, as llama-server (default: the -m name).")
TAGS = typer.Option(None, "--tags", rich_help_panel=N, metavar="STRING",
                    help="Tags listed with the model by /v1/models, comma-separated (informational).")
CONT_BATCHING = typer.Option(
    False, "-cb", "--cont-batching", rich_help_panel=N,
    help="Accepted: the -np slots' requests are always decoded together, as they come (continuous batching).")
NO_UI = typer.Option(False, "--no-ui", "--no-webui", rich_help_panel=N,
                     help="Accepted: speculate serve has no web UI.")
NO_MMPROJ = typer.Option(False, "--no-mmproj", "--no-mmproj-auto", rich_help_panel=N,
                         help="Accepted: speculate loads no multimodal projector (text only).")
REASONING_FORMAT = typer.Option(
    "auto", "--reasoning-format", rich_help_panel=N, metavar="FORMAT",
    help="Where a thinking model's thoughts go: deepseek (or auto, the default): message.reasoning_content; "
         "deepseek-legacy: also left in the content; none: left in the content. A request's reasoning_format "
         "overrides it.")
REASONING = typer.Option(
    "auto", "-rea", "--reasoning", rich_help_panel=N, metavar="on|off|auto",
    help="Thinking on or off for templates that can switch it (their enable_thinking); auto: the template's "
         "default.")
REASONING_BUDGET = typer.Option(
    -1, "--reasoning-budget", rich_help_panel=N, metavar="N",
    help="Thinking budget: -1 unrestricted; 0: none (enable_thinking off).")
TEMPLATE_KWARGS = typer.Option(
    None, "--chat-template-kwargs", rich_help_panel=N, metavar="JSON",
    help="More variables for the chat template, a JSON object (e.g. '{\"enable_thinking\": false}'); a "
         "request's chat_template_kwargs add to them.")


def api_names(alias: Optional[str] = None, tags: Optional[str] = None, cont_batching: bool = False,
              no_ui: bool = False, no_mmproj: bool = False) -> tuple[list, list]:
    """-a's names and --tags' tags of the model in the API; llama-server's flags that ask for what
    speculate serve does anyway."""
    return _names(alias), _names(tags)


# llama-server's flags for the API's model names, and those that say what serve does anyway
LLAMA_SERVER = options.Group("names", (
    ("alias", Optional[str], ALIAS), ("tags", Optional[str], TAGS), ("cont_batching", bool, CONT_BATCHING),
    ("no_ui", bool, NO_UI), ("no_mmproj", bool, NO_MMPROJ),
), api_names)


def chat_settings(reasoning_format: str = "auto", reasoning: str = "auto", reasoning_budget: int = -1,
                  chat_template_kwargs: Optional[str] = None) -> tuple[str, dict]:
    """llama-server's chat flags: the default reasoning format and the template's variables
    (--chat-template-kwargs, with -rea and --reasoning-budget 0 as enable_thinking), as it reads them."""
    from speculative.chat.format import REASONING_FORMATS

    if reasoning_format not in REASONING_FORMATS:
        raise UsageError(f"--reasoning-format: one of {', '.join(REASONING_FORMATS)}, not {reasoning_format!r}")
    kwargs = _json_object(chat_template_kwargs, "--chat-template-kwargs") if chat_template_kwargs else {}
    switch = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False, "auto": None}
    if reasoning.lower() not in switch:
        raise UsageError(f"-rea/--reasoning: on, off or auto, not {reasoning!r}")
    if switch[reasoning.lower()] is not None:
        kwargs["enable_thinking"] = switch[reasoning.lower()]
    if reasoning_budget < -1:
        raise UsageError(f"--reasoning-budget: -1 (unrestricted) or more, not {reasoning_budget}")
    if reasoning_budget == 0:
        kwargs["enable_thinking"] = False
    elif reasoning_budget > 0:
        raise UsageError("--reasoning-budget N > 0: speculate does not cut thinking short yet; -1 (unrestricted) "
                         "or 0 (no thinking)")
    return reasoning_format, kwargs


def _json_object(text: str, flag: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise UsageError(f"{flag}: not JSON: {e}") from None
    if not isinstance(value, dict):
        raise UsageError(f"{flag}: must be a JSON object, like '{{\"enable_thinking\": false}}'")
    return value


CHAT = options.Group("chat", (
    ("reasoning_format", str, REASONING_FORMAT), ("reasoning", str, REASONING),
    ("reasoning_budget", int, REASONING_BUDGET), ("chat_template_kwargs", Optional[str], TEMPLATE_KWARGS),
), chat_settings)


@options.with_options(options.MODELS, options.SAMPLING, options.SPECULATION.but(
    branches=(int, options.DRAFT_BRANCHES)), options.POOL, options.SLOTS, LLAMA_SERVER, CHAT)
def serve_command(
    models: options.ModelOptions,
    sampling: SamplerSettings,
    spec: SpecSettings,
    pool: options.PoolOptions,
    slots: options.SlotOptions,
    names: tuple[list, list],
    chat: tuple[str, dict],
    host: str = typer.Option("127.0.0.1", "--host", rich_help_panel=N,
                             help="Address to listen on. Anything but loopback needs an API key."),
    port: int = typer.Option(8080, "--port", rich_help_panel=N, help="Port to listen on (0: any free one)."),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", envvar="SPECULATE_API_KEY", show_envvar=True, rich_help_panel=N,
        help="Require 'Authorization: Bearer KEY' on every endpoint but /health. Prefer the environment "
             "variable: a command line is visible to every user of the machine."),
    max_waiting: int = typer.Option(
        8, "--max-waiting", rich_help_panel=N, metavar="N",
        help="How many requests may wait while every slot (-np) generates; more are refused with 503 and "
             "Retry-After."),
    slots_endpoint: bool = typer.Option(
        True, "--slots/--no-slots", rich_help_panel=N, help="Serve GET /slots, what each slot holds and does."),
    timeout: float = typer.Option(
        600.0, "-to", "--timeout", rich_help_panel=N,
        help="Seconds a request may take, waiting included: a generation still running then ends "
             "with what it has (finish_reason length); one still waiting gets 503."),
    cache_ram: int = typer.Option(
        DEFAULT_MIB, "-cram", "--cache-ram", rich_help_panel=N, metavar="MiB", envvar="LLAMA_ARG_CACHE_RAM",
        help="Host memory for earlier conversations' caches (llama-server's prompt cache): a request that "
             "does not continue the cached one saves it there, and restores the saved one sharing the "
             "longest prefix with it; least recently used go first. 0: off; -1: no limit."),
    metrics: bool = METRICS,
) -> None:
    """Serve the models over OpenAI's HTTP API (/v1/completions, /v1/chat/completions with tools, /v1/models)
    and llama-server's endpoints (/completion, /infill, /tokenize, /props, /slots, /health, /metrics...): -np
    generations decoded together; the sampling flags, -n and --ignore-eos are requests' defaults. Ctrl-C: exit 0."""
    from speculative.serving import app as server  # the web stack: imported by this command only (start-up time)
    from speculative.engine.engine import Engine  # loads llama.cpp: imported when a model runs (start-up time)
    from speculative.engine.parallel import Parallel
    from speculative.serving.generation import Defaults
    from speculative.serving.worker import Worker

    api_key = api_key or None  # an empty SPECULATE_API_KEY is no key
    _check(server.is_loopback(host), host, port, api_key, max_waiting, timeout, cache_ram)
    slots = slots.for_spec(spec)
    target, draft = models.specs(models.uses_draft(spec), spec.branches, spec.longest_draft, spec.mtp, spec.features)
    sock = _bind(host, port)  # before loading: a taken port fails at once, not after the models load
    status = StatusLine()  # while the models load and auto measures; then notices only
    with sock, status, Engine(slots.apply(target), slots.apply(draft), notify=status.say, progress=status.update,
                              cache_ram_mib=cache_ram, **pool.engine_args()) as engine:
        engine.factory.make(spec)  # auto measures its costs now rather than in the first request
        status.clear()
        model_info = _model_info(engine, target, draft, spec, *names)
        parallel = Parallel(engine, slots.n_slots, **slots.parallel_args())
        with Worker(parallel, spec, waiting=max_waiting, timeout=timeout) as worker:
            app = server.create_app(worker, model_info, api_key, loopback_only=server.is_loopback(host),
                                    metrics=metrics, build_info=build_info(), slots=slots_endpoint,
                                    defaults=Defaults(sampling, spec.n_predict, spec.ignore_eos, *chat))
            print(_banner(target, draft, spec, slots.n_slots, f"{_url_host(host)}:{sock.getsockname()[1]}", api_key),
                  file=sys.stderr, flush=True)
            server.run(app, worker, sock)


def _check(loopback: bool, host: str, port: int, api_key: str | None, max_waiting: int, timeout: float,
           cache_ram: int) -> None:
    """The server's own flags, refused before anything loads."""
    if not loopback and api_key is None:
        raise UsageError(f"--host {host} is reachable from other machines: set an API key "
                         "(SPECULATE_API_KEY or --api-key), or listen on 127.0.0.1")
    if not 0 <= port <= 65535 or max_waiting < 0 or not timeout > 0:
        raise UsageError("--port must be in [0, 65535], --max-waiting >= 0 and --timeout > 0")
    if cache_ram < -1:
        raise UsageError(f"--cache-ram must be a size in MiB, 0 (off) or -1 (no limit), got {cache_ram}")


def _banner(target: ModelSpec, draft: ModelSpec | None, spec: SpecSettings, n_slots: int, where: str,
            api_key: str | None) -> str:
    """The line that says the server is up, and what it serves."""
    return (f"speculate serve: {target.name}" + (f" with draft {draft.name}" if draft else "")
            + f", --spec-type {','.join(spec.types)}, {n_slots} slot{'s' * (n_slots > 1)}, on http://{where}/v1 "
            + ("(API key required)" if api_key else "(no API key)"))


def _names(value: str | None) -> list[str]:
    """-a's and --tags' comma-separated names, as llama.cpp keeps them (a std::set): stripped, each once,
    sorted."""
    return sorted({name.strip() for name in (value or "").split(",")} - {""})


def _model_info(engine, target: ModelSpec, draft: ModelSpec | None, spec: SpecSettings, aliases: list[str],
                tags: list[str]) -> dict:
    """What /v1/models says of the model served (its id: the first alias, else its name), and what
    /props says besides."""
    return {"id": aliases[0] if aliases else target.name, "aliases": aliases, "tags": tags, "created": int(time.time()),
            "meta": {"n_ctx": engine.target.n_ctx, "draft": draft.name if draft else None,
                     "spec_type": ",".join(spec.types)},
            # for /props only
            "path": str(target.path), "bos_token": engine.target.special_text("bos"),
            "eos_token": engine.target.special_text("eos")}


def build_info() -> str:
    """What /props reports as the build, and `speculate --version`: speculate's version, and
    llama-cpp-python's with the llama.cpp it was built from."""
    from importlib.metadata import PackageNotFoundError, version

    from speculative.llamacpp.devices import llama_cpp_versions

    try:
        own = version("speculate")
    except PackageNotFoundError:
        own = "unknown"
    return f"speculate {own}, {llama_cpp_versions()}"


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
