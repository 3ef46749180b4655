"""`speculate serve`: the models behind an OpenAI-compatible HTTP API (llama-server's role)."""

from __future__ import annotations

import csv
import functools
import json
import os
import socket
import sys
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Iterator, Optional

import typer

from speculative.decoding.settings import ModelSpec, SamplerSettings, SpecSettings
from speculative.drafters import registry
from speculative.engine.ram_cache import DEFAULT_MIB
from speculative.errors import UsageError

from . import options
from .progress import StatusLine

if TYPE_CHECKING:  # annotations only: the engine loads llama.cpp
    from speculative.engine.parallel import Parallel

N = "Server"

SLEEP_IDLE = typer.Option(
    -1, "--sleep-idle-seconds", rich_help_panel=N, metavar="SECONDS",
    help="Free the models once no request has needed them for this long, and load them again for the next "
         "that does (llama-server's sleep; /health, /props, /models, /slots and /metrics do not wake them). "
         "-1: never.")
CONTEXT_SHIFT = typer.Option(
    False, "--context-shift/--no-context-shift", rich_help_panel=N,
    help="At a full context, drop the older half of what follows a request's n_keep tokens and go on "
         "generating (llama-server's context shift; what is left is decoded again at its new positions, and "
         "the drafters start again from it). Without it a generation stops at the context's end.")
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
    help="Thinking budget in tokens: -1 unrestricted; 0: none (enable_thinking off); N: the thinking is ended "
         "after N tokens and the answer goes on.")
TEMPLATE_KWARGS = typer.Option(
    None, "--chat-template-kwargs", rich_help_panel=N, metavar="JSON",
    help="More variables for the chat template, a JSON object (e.g. '{\"enable_thinking\": false}'); a "
         "request's chat_template_kwargs add to them.")


def api_names(alias: Optional[str] = None, tags: Optional[str] = None, cont_batching: bool = False,
              no_ui: bool = False, no_mmproj: bool = False) -> tuple[list, list]:
    """-a's names and --tags' tags of the model in the API; llama-server's flags that ask for what
    speculate serve does anyway."""
    return _names(alias), _names(tags)


CORS_ORIGINS = typer.Option(
    None, "--cors-origins", rich_help_panel=N, metavar="ORIGINS", envvar="LLAMA_ARG_CORS_ORIGINS", show_envvar=False,
    help="Web pages that may use the server from a browser: their origins, comma-separated; * any; localhost "
         "those served by this machine (default: * with an API key, as llama-server; localhost without one).")
CORS_METHODS = typer.Option(
    "GET, POST, DELETE, OPTIONS", "--cors-methods", rich_help_panel=N, metavar="METHODS",
    envvar="LLAMA_ARG_CORS_METHODS", show_envvar=False, help="What a CORS preflight allows: methods.")
CORS_HEADERS = typer.Option(
    "*", "--cors-headers", rich_help_panel=N, metavar="HEADERS", envvar="LLAMA_ARG_CORS_HEADERS", show_envvar=False,
    help="What a CORS preflight allows: request headers (a browser's Authorization needs its name here, * does "
         "not cover it).")
CORS_CREDENTIALS = typer.Option(
    True, "--cors-credentials/--no-cors-credentials", rich_help_panel=N, envvar="LLAMA_ARG_CORS_CREDENTIALS",
    show_envvar=False, help="Whether a CORS preflight allows credentials; with --cors-origins *, any origin is "
                            "echoed back.")
HOST = typer.Option(
    "127.0.0.1", "--host", rich_help_panel=N, envvar="LLAMA_ARG_HOST", show_envvar=False,
    help="Addresses to listen on, comma-separated (127.0.0.1,::1), or UNIX socket paths ending in .sock. "
         "Anything but loopback needs an API key.")
PORT = typer.Option(8080, "--port", rich_help_panel=N, envvar="LLAMA_ARG_PORT", show_envvar=False,
                    help="Port to listen on (0: any free one, with one address).")
API_KEY = typer.Option(
    None, "--api-key", envvar="SPECULATE_API_KEY", show_envvar=True, rich_help_panel=N,
    help="Require the key (Authorization: Bearer KEY, or X-Api-Key: KEY) on every endpoint but /health. "
         "Prefer the environment variable: a command line is visible to every user of the machine.")


@dataclass(frozen=True)
class Access:
    """Where the server listens and who may use it: --host, --port, the API key, the --cors-* flags."""
    hosts: tuple["Address", ...]
    port: int
    api_key: str | None
    cors: object  # serving.access.Cors: the web stack is imported when the command runs (start-up time)
    gcp: object = None  # serving.gcp.Gcp: Vertex AI's prediction contract, when its environment asks for it

    @property
    def loopback(self) -> bool:
        return all(h.local for h in self.hosts)


def access_settings(host: str = "127.0.0.1", port: int = 8080, api_key: Optional[str] = None,
                    cors_origins: Optional[str] = None, cors_methods: str = "GET, POST, DELETE, OPTIONS",
                    cors_headers: str = "*", cors_credentials: bool = True) -> Access:
    """The listening and access flags, checked before anything loads; with Vertex AI's AIP_MODE=PREDICTION
    in the environment, its AIP_HTTP_PORT overrides --port, as in llama-server."""
    from speculative.serving.access import Cors
    from speculative.serving.gcp import Gcp

    hosts, key = tuple(listen_addresses(host)), api_key or None  # an empty SPECULATE_API_KEY is no key
    exposed = [h.host for h in hosts if not h.local]
    if exposed and key is None:
        raise UsageError(f"--host {exposed[0]} is reachable from other machines: set an API key "
                         "(SPECULATE_API_KEY or --api-key), or listen on 127.0.0.1")
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {port}")
    if port == 0 and sum(not h.unix for h in hosts) > 1:
        raise UsageError("--port 0 is not supported with several TCP addresses (each would get its own port)")
    for flag, value in (("--cors-origins", cors_origins or ""), ("--cors-methods", cors_methods),
                        ("--cors-headers", cors_headers)):
        if not value.isascii() or not value.isprintable():
            raise UsageError(f"{flag} must be printable ASCII (it goes into a response header), got {value!r}")
    cors = Cors(cors_origins, cors_methods, cors_headers, cors_credentials).for_key(key is not None)
    try:
        gcp = Gcp.from_environ()
    except ValueError as e:
        raise UsageError(str(e)) from None
    if gcp is not None and gcp.port != port:
        print(f"speculate serve: warning: Google Cloud Platform compat: overriding server port {port} with "
              f"AIP_HTTP_PORT {gcp.port}", file=sys.stderr)
        port = gcp.port
    return Access(hosts, port, key, cors, gcp)


ACCESS = options.Group("access", (
    ("host", str, HOST), ("port", int, PORT), ("api_key", Optional[str], API_KEY),
    ("cors_origins", Optional[str], CORS_ORIGINS), ("cors_methods", str, CORS_METHODS),
    ("cors_headers", str, CORS_HEADERS), ("cors_credentials", bool, CORS_CREDENTIALS),
), access_settings)

# llama-server's flags for the API's model names, and those that say what serve does anyway
LLAMA_SERVER = options.Group("names", (
    ("alias", Optional[str], ALIAS), ("tags", Optional[str], TAGS), ("cont_batching", bool, CONT_BATCHING),
    ("no_ui", bool, NO_UI), ("no_mmproj", bool, NO_MMPROJ),
), api_names)


def chat_settings(reasoning_format: str = "auto", reasoning: str = "auto", reasoning_budget: int = -1,
                  chat_template_kwargs: Optional[str] = None) -> tuple[str, dict, int]:
    """llama-server's chat flags: the default reasoning format, the template's variables
    (--chat-template-kwargs, with -rea and --reasoning-budget 0 as enable_thinking) and the
    reasoning budget, as it reads them."""
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
    return reasoning_format, kwargs, reasoning_budget


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
    branches=(int, options.DRAFT_BRANCHES)), options.POOL, options.SLOTS, LLAMA_SERVER, ACCESS, CHAT)
def serve_command(
    models: options.ModelOptions,
    sampling: SamplerSettings,
    spec: SpecSettings,
    pool: options.PoolOptions,
    slots: options.SlotOptions,
    names: tuple[list, list],
    chat: tuple[str, dict, int],
    access: Access,
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
    sleep_idle: int = SLEEP_IDLE,
    context_shift: bool = CONTEXT_SHIFT,
) -> None:
    """Serve the models over OpenAI's HTTP API (/v1/completions, /v1/chat/completions with tools and reasoning,
    /v1/models) and llama-server's endpoints (/completion, /infill, /tokenize, /detokenize, /apply-template,
    /props, /slots, /health, /metrics with --metrics), under llama-server's paths too: -np generations
    decoded together; the sampling flags, -n and --ignore-eos are requests' defaults. Ctrl-C or SIGTERM: exit 0."""
    from speculative.serving import app as server  # the web stack: imported by this command only (start-up time)
    from speculative.serving.generation import Defaults
    from speculative.serving.worker import Worker

    _check(max_waiting, timeout, cache_ram, sleep_idle)
    spec = replace(spec, context_shift=context_shift)
    slots = slots.for_spec(spec)
    target, draft = models.specs(models.uses_draft(spec), spec.branches, spec.longest_draft, *registry.heads(spec))
    status = StatusLine()  # while the models load and auto measures; then notices only
    load = functools.partial(_load, slots.apply(target), slots.apply(draft), spec, slots, status,
                             cache_ram_mib=cache_ram, **pool.engine_args())
    # listening before loading: a taken port fails at once, not after the models load
    with _listening(access.hosts, access.port) as socks, status:
        with Worker(load, spec, waiting=max_waiting, timeout=timeout, sleep_after=sleep_idle) as worker:
            status.clear()
            model_info = _model_info(worker.engine, target, draft, spec, *names)
            app = server.create_app(worker, model_info, access.api_key, loopback_only=access.loopback,
                                    metrics=metrics, build_info=build_info(), slots=slots_endpoint,
                                    defaults=Defaults(sampling, spec.n_predict, spec.ignore_eos, *chat, verbose=models.verbose),
                                    cors=access.cors, gcp=access.gcp)
            if access.cors.origins == "*" and access.api_key is None:  # llama-server's warning
                print("speculate serve: warning: no API key is set and --cors-origins * lets any web page use "
                      "this server", file=sys.stderr)
            print(_banner(target, draft, spec, slots.n_slots, [_url(s) for s in socks], access.api_key),
                  file=sys.stderr, flush=True)
            server.run(app, worker, socks)


def _load(target: ModelSpec, draft: ModelSpec | None, spec: SpecSettings, slots: options.SlotOptions,
          status: StatusLine, **engine_args) -> Parallel:
    """The models loaded and auto's costs known (measured now rather than in the first request),
    in the slots: at start, and again after each sleep."""
    from speculative.engine.engine import Engine  # loads llama.cpp: imported when a model runs (start-up time)
    from speculative.engine.parallel import Parallel

    engine = Engine(target, draft, notify=status.say, progress=status.update, **engine_args)
    try:
        engine.factory.make(spec)
        return Parallel(engine, slots.n_slots, **slots.parallel_args())
    except BaseException:
        engine.close()
        raise


def _check(max_waiting: int, timeout: float, cache_ram: int, sleep_idle: int) -> None:
    """The server's own flags, refused before anything loads."""
    if max_waiting < 0 or not timeout > 0:
        raise UsageError("--max-waiting must be >= 0 and --timeout > 0")
    if sleep_idle == 0 or sleep_idle < -1:  # llama.cpp's rule
        raise UsageError(f"--sleep-idle-seconds must be a number of seconds, or -1 (never), got {sleep_idle}")
    if cache_ram < -1:
        raise UsageError(f"--cache-ram must be a size in MiB, 0 (off) or -1 (no limit), got {cache_ram}")


def _banner(target: ModelSpec, draft: ModelSpec | None, spec: SpecSettings, n_slots: int, urls: list[str],
            api_key: str | None) -> str:
    """The line that says the server is up, and what it serves."""
    return (f"speculate serve: {target.name}" + (f" with draft {draft.name}" if draft else "")
            + f", --spec-type {','.join(spec.types)}, {n_slots} slot{'s' * (n_slots > 1)}, on "
            + ", ".join(f"{url}/v1" for url in urls) + (" (API key required)" if api_key else " (no API key)"))


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


@dataclass(frozen=True)
class Address:
    """One --host address: an IP address or name to listen on with --port, or a UNIX socket's path."""
    host: str

    @property
    def unix(self) -> bool:
        return self.host.endswith(".sock")

    @property
    def local(self) -> bool:
        """Only this machine can reach it (a UNIX socket, or loopback)."""
        from speculative.serving.access import is_loopback

        return self.unix or is_loopback(self.host)


def listen_addresses(value: str) -> list[Address]:
    """--host as llama.cpp reads it: comma-separated (a CSV row), each stripped, empty ones dropped."""
    hosts = [Address(h.strip()) for h in next(csv.reader([value]), []) if h.strip()]
    if not hosts:
        raise UsageError("--host requires at least one address")
    return hosts


@contextmanager
def _listening(hosts: list[Address], port: int) -> Iterator[list[socket.socket]]:
    """A socket bound to each address (several TCP ones: an IPv6 one takes IPv6 only, as in
    llama-server, so that :: and 0.0.0.0 go together), closed afterwards; a UNIX socket's file,
    which it made, removed."""
    socks: list[socket.socket] = []
    made: list[str] = []  # UNIX sockets' files (the sockets may be closed by then)
    try:
        several = sum(not h.unix for h in hosts) > 1
        for host in hosts:
            socks.append(_bind(host, port, several))
            made += [host.host] if host.unix else []
        yield socks
    finally:
        for sock in socks:
            sock.close()
        for path in made:
            with suppress(FileNotFoundError):
                os.unlink(path)


def _bind(address: Address, port: int, v6only: bool) -> socket.socket:
    if address.unix:
        family, where = socket.AF_UNIX, address.host
    else:
        family, where = socket.AF_INET6 if ":" in address.host else socket.AF_INET, (address.host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if family != socket.AF_UNIX:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and v6only:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(where)
    except OSError as e:
        sock.close()
        shown = address.host if address.unix else f"{_url_host(address.host)}:{port}"
        stale = address.unix and os.path.exists(address.host)
        raise UsageError(f"cannot listen on {shown}: {e.strerror or e}"
                         + " (a file is there: remove it if no server uses it)" * stale) from None
    return sock


def _url(sock: socket.socket) -> str:
    """Where a client reaches a listening socket."""
    if sock.family == socket.AF_UNIX:
        return f"unix://{sock.getsockname()}"
    host, port = sock.getsockname()[:2]
    return f"http://{_url_host(host)}:{port}"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
