"""The HTTP side of `speculate serve`: an OpenAI-compatible API and llama-server's own
endpoints, on FastAPI, run by uvicorn, under the paths the pinned llama-server serves them
(tools/server/server.cpp's route table).

OpenAI's: GET /v1/models (and /models), POST /v1/completions, POST /v1/chat/completions (and
/chat/completions) (with "stream": true, server-sent events: one chunk per step, then `data:
[DONE]`), POST /v1/chat/completions/input_tokens (and /chat/completions/input_tokens); its
Responses API as llama-server serves it (responses_api.py): POST /v1/responses (and /responses)
(streamed: Responses' named events, no [DONE]), POST /v1/responses/input_tokens (and
/responses/input_tokens).
llama-server's (llama_api.py): POST /completion (and /completions), POST /infill, POST
/tokenize, POST /detokenize, POST /apply-template, GET /props, GET /slots (unless --no-slots),
GET /metrics (with --metrics), GET /health and /v1/health.

What a request must get past, in order (access.Guard, then `read_json`): a Host header naming
this machine when the server listens on loopback only (a web page that rebinds its own
domain to 127.0.0.1 cannot use it); CORS (a preflight is answered there, and only an allowed
origin may read an answer); the API key, if one is set, on every path but /health; a JSON body
(Content-Type application/json, which a web page cannot send cross-origin without a CORS
preflight) of at most MAX_BODY bytes. Errors are OpenAI error objects, and llama-server's on
its own endpoints and the Responses API's (which llama-server answers with those).
"""

from __future__ import annotations

import asyncio
import copy
import json
import signal
import socket
import time
from dataclasses import replace

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from speculative.engine.engine import Engine
from speculative.engine.stream import Final, Piece
from speculative.serving import llama_api, openai_api, responses_api
from speculative.serving.access import OPEN_PATHS, Cors, Guard
from speculative.serving.gcp import Gcp
from speculative.serving.gcp import add_routes as gcp_routes
from speculative.serving.generation import ApiError, Busy, Defaults, Generation
from speculative.serving.openai_api import Reply
from speculative.serving.worker import Failed, Job, Started, Worker, chat_prompt, request_tokens

MAX_BODY = 8 << 20        # bytes: a full 128k-token context as JSON-escaped text fits
RETRY_AFTER_SECONDS = 1   # what a refused client is told to wait
RESPONSES_PATHS = ("/v1/responses", "/responses", "/v1/responses/input_tokens", "/responses/input_tokens")
# llama-server's own endpoints, and the Responses API's: their errors are llama-server's error objects
LLAMA_PATHS = ("/completion", "/completions", "/infill", "/tokenize", "/detokenize", "/apply-template", "/props",
               "/metrics", "/slots", *OPEN_PATHS, *RESPONSES_PATHS)


def create_app(worker: Worker, model: dict, api_key: str | None, loopback_only: bool,
               metrics: bool = False, build_info: str = "", slots: bool = True,
               defaults: Defaults = Defaults(), cors: Cors = Cors(), gcp: Gcp | None = None) -> FastAPI:
    """`model`: what /v1/models says about the one model served (`id` is its name, or -a's; `path`,
    `bos_token` and `eos_token` for /props). `metrics`: serve /metrics (llama-server's --metrics);
    `slots`: serve /slots (llama-server's --slots); `defaults`: what a request gets for a field it
    leaves out (the server's sampling flags, -n, --ignore-eos); `cors`: the --cors-* flags; `gcp`: Vertex
    AI's prediction routes (gcp.py)."""
    app = FastAPI(title="speculate", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, api_key=api_key, loopback_only=loopback_only, cors=cors,
                       refuse=lambda e, path: error_response(e, path in LLAMA_PATHS))
    _add_error_handlers(app)
    _add_llama_routes(app, worker, model, metrics, build_info, slots, defaults)
    _add_openai_routes(app, worker, model, defaults)
    _add_template_routes(app, worker, defaults)
    _add_responses_routes(app, worker, model, defaults)
    if gcp is not None:
        gcp_routes(app, gcp, read_json)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as an error object: llama-server's on its own paths, OpenAI's elsewhere."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return error_response(e, request.url.path in LLAMA_PATHS)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:  # unknown path, wrong method
        return error_response(ApiError(e.status_code, str(e.detail)), request.url.path in LLAMA_PATHS)

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception) -> JSONResponse:
        return error_response(ApiError(500, f"internal error: {type(e).__name__}"), request.url.path in LLAMA_PATHS)


def _add_llama_routes(app: FastAPI, worker: Worker, model: dict, metrics: bool, build_info: str,
                      slots: bool, defaults: Defaults) -> None:
    """llama-server's own endpoints (llama_api.py), /health among them."""
    # what /props says, read once: it holds while the models sleep too
    facts = llama_api.props(worker.engine.target, model, worker.engine.target.chat_template() or "", build_info,
                            metrics, worker.n_slots, slots, defaults)

    @app.get("/health")
    @app.get("/v1/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.post("/completion")
    @app.post("/completions")
    async def completion(request: Request):
        return await _llama_generate(request, worker, model, llama_api.completion_prompt, defaults)

    @app.post("/infill")
    async def infill(request: Request):
        return await _llama_generate(request, worker, model, llama_api.infill_prompt, defaults)

    @app.post("/tokenize")  # read-only: tokenizing beside a generation is safe (llama-server does it too)
    async def tokenize(request: Request) -> dict:
        return await asyncio.to_thread(llama_api.tokenize, (await awake(worker)).target, await read_json(request))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        return await asyncio.to_thread(llama_api.detokenize, (await awake(worker)).target, await read_json(request))

    @app.get("/props")
    async def props() -> dict:
        return {**facts, "is_sleeping": worker.sleeping}

    @app.post("/props")
    async def change_props() -> dict:
        raise ApiError(501, "This server does not support changing global properties")

    @app.get("/slots")
    async def slot_list() -> list:
        if not slots:
            raise ApiError(501, "This server does not support slots endpoint. Start it with `--slots`")
        speculative = model["meta"]["spec_type"] != "none"
        return [{**slot, "speculative": speculative} for slot in worker.slots()]

    @app.get("/metrics")
    async def prometheus() -> Response:
        if not metrics:
            raise ApiError(501, "This server does not support metrics endpoint. Start it with `--metrics`")
        return Response(llama_api.prometheus(*worker.metrics()), media_type="text/plain; version=0.0.4",
                        headers={"Process-Start-Time-Unix": str(int(worker.started_at))})


def _add_openai_routes(app: FastAPI, worker: Worker, model: dict, defaults: Defaults) -> None:
    """OpenAI's /v1 endpoints (openai_api.py)."""
    listed = {k: v for k, v in model.items() if k in ("id", "aliases", "tags", "created", "meta")}

    @app.get("/v1/models")
    @app.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"object": "model", "owned_by": "speculate", **listed}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, worker, model, defaults, chat=False)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, worker, model, defaults, chat=True)


def _add_template_routes(app: FastAPI, worker: Worker, defaults: Defaults) -> None:
    """A chat request's prompt without generating: llama-server's /apply-template (the text) and
    /chat/completions/input_tokens (its length in tokens), as /v1/chat/completions reads and renders it."""

    @app.post("/apply-template")
    async def apply_template(request: Request) -> dict:
        engine = await awake(worker)
        generation = openai_api.parse(await read_json(request), True, defaults, _jinja_template(engine))
        return {"prompt": await asyncio.to_thread(chat_prompt, engine, generation, engine.chat_text)}

    @app.post("/v1/chat/completions/input_tokens")
    @app.post("/chat/completions/input_tokens")
    async def input_tokens(request: Request) -> dict:
        engine = await awake(worker)
        return await _count_tokens(engine, await read_json(request), defaults)


async def _count_tokens(engine: Engine, chat: object, defaults: Defaults) -> dict:
    """A chat body's prompt length in tokens, as llama-server's input_tokens endpoints give it."""
    generation = openai_api.parse(chat, True, defaults, _jinja_template(engine))
    tokens = await asyncio.to_thread(request_tokens, engine, generation)
    return {"input_tokens": len(tokens), "object": "response.input_tokens"}


def _add_responses_routes(app: FastAPI, worker: Worker, model: dict, defaults: Defaults) -> None:
    """OpenAI's Responses API as llama-server serves it (responses_api.py): a chat request underneath."""

    @app.post("/v1/responses")
    @app.post("/responses")
    async def responses(request: Request):
        return await _respond(request, worker, model, defaults)

    @app.post("/v1/responses/input_tokens")
    @app.post("/responses/input_tokens")
    async def response_input_tokens(request: Request) -> dict:
        engine = await awake(worker)
        return await _count_tokens(engine, responses_api.to_chat(await read_json(request)), defaults)


def error_response(e: ApiError, llama: bool = False) -> JSONResponse:
    """`llama`: as llama-server's own endpoints give errors, else as OpenAI's API."""
    headers = {}
    if isinstance(e, Busy):
        headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
    elif e.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(e.llama_body() if llama else e.body(), status_code=e.status, headers=headers)


async def awake(worker: Worker) -> Engine:
    """The engine, its models loaded again first if they sleep (--sleep-idle-seconds)."""
    return await asyncio.to_thread(worker.awake)


def _jinja_template(engine: Engine) -> str:
    """The target's Jinja chat template, for a chat request's tools and reasoning ('' with --no-jinja)."""
    return (engine.target.chat_template() or "") if engine.jinja else ""


async def _generate(request: Request, worker: Worker, model: dict, defaults: Defaults, chat: bool):
    engine = await awake(worker)
    generation = openai_api.parse(await read_json(request), chat, defaults, _jinja_template(engine) if chat else "")
    reply = Reply(model["id"], generation)
    prompt: tuple[int, ...] = ()

    def started(first: Started) -> None:
        nonlocal prompt
        prompt = first.prompt
        reply.started(first.prompt_tail)

    def verbose(final: Final) -> dict | None:
        """llama-server's __verbose object, when the request asks for it."""
        if not generation.verbose:
            return None
        return llama_api.verbose(model["id"], generation, prompt, engine.target, model["meta"]["spec_type"], final)

    return await _answer(request, worker, generation,
                         lambda final: reply.full(final.text, final.reason, final.stats, verbose(final)),
                         lambda job: _openai_events(job, reply, verbose), started)


async def _respond(request: Request, worker: Worker, model: dict, defaults: Defaults):
    """A Responses request, run as the chat request it becomes; the chat answer, or its chunks,
    made a Response or its events."""
    engine = await awake(worker)
    body = await read_json(request)
    chat = responses_api.to_chat(body)
    progress, per_token = responses_api.telemetry(body)
    # the usage comes in the stream's last chunk, for response.completed
    generation = replace(openai_api.parse(chat, True, defaults, _jinja_template(engine)), include_usage=True)
    reply = Reply(model["id"], generation)
    n_prompt = 0

    def started(first: Started) -> None:
        nonlocal n_prompt
        n_prompt = len(first.prompt)
        reply.started(first.prompt_tail)

    def events(job: Job):
        opening = responses_api.prompt_progress(n_prompt, 0, 0, 0) if progress else None
        return _response_events(job, reply, responses_api.Events(model["id"]), opening, per_token)

    return await _answer(request, worker, generation,
                         lambda final: responses_api.response(reply.full(final.text, final.reason, final.stats)),
                         events, started)


async def _llama_generate(request: Request, worker: Worker, model: dict, prompt_of, defaults: Defaults):
    """/completion or /infill: `prompt_of(vocab, body)` gives the prompt's tokens."""
    vocab = (await awake(worker)).target
    data = await read_json(request)
    tokens = await asyncio.to_thread(prompt_of, vocab, data)
    generation, options = llama_api.parse(data, tokens, model["meta"]["spec_type"], defaults, vocab.eog_tokens())
    reply = llama_api.Reply(model["id"], options, tokens, lambda: llama_api.text_of(vocab, tokens), vocab.n_ctx)
    return await _answer(request, worker, generation, reply.final, lambda job: _llama_events(job, reply))


async def _answer(request: Request, worker: Worker, generation: Generation, whole, events, started=None):
    """Run a generation: `whole(final)` is the answer, or with "stream": true `events(job)`
    the server-sent events; `started(Started)` is told when the prompt has passed its checks."""
    job = worker.submit(generation)
    watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
    stream = None  # once it exists, it owns the job
    try:
        try:  # waiting for the models, then the prompt's checks
            first = await asyncio.wait_for(job.next(), timeout=max(job.deadline - time.monotonic(), 0))
        except asyncio.TimeoutError:
            raise Busy(f"the models were not free within --timeout ({worker.timeout:g} s)") from None
        if isinstance(first, Failed):
            raise _error(first)
        if started is not None:
            started(first)
        if generation.stream:
            stream = EventStream(job, events(job))
            return stream
        while not isinstance(output := await job.next(), Final):  # Final carries the whole text
            if isinstance(output, Failed):
                raise _error(output)
        return JSONResponse(whole(output))
    finally:
        watcher.cancel()  # a streaming response watches for the client itself
        if stream is None:
            job.cancel()  # finished already, or its request failed or was abandoned


class EventStream(StreamingResponse):
    """Server-sent events. However the response ends (the client may have gone before the
    first byte), the generation stops with it."""

    def __init__(self, job: Job, events):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()



async def _openai_events(job: Job, reply: Reply, verbose):
    """OpenAI's stream: a chunk per piece, the last ones with usage and timings (and
    `verbose(final)`: llama-server's __verbose object, or None), then [DONE]."""
    if (first := reply.first_chunk()) is not None:
        yield _event(first)
    while True:
        output = await job.next()
        if isinstance(output, Piece):
            for chunk in reply.chunks(output.text):
                yield _event(chunk)
        elif isinstance(output, Final):
            for chunk in reply.last_chunks(output.reason, output.stats, verbose(output)):
                yield _event(chunk)
            yield "data: [DONE]\n\n"
            return
        elif isinstance(output, Failed):  # the status line has gone: the error is an event
            yield _event(_error(output).body())
            return


async def _response_events(job: Job, reply: Reply, events: responses_api.Events, progress: dict | None,
                           per_token: bool):
    """The Responses stream, from the chat chunks of each piece: its opening (with `progress`, the
    prompt's as generation begins, and the prompt's whole once its first piece shows what the cache
    held), each step's events (with `per_token`, the timings so far on the last), the end; no [DONE]."""
    for event in events.opening(progress):
        yield _named_event(event)
    stats = None
    while True:
        output = await job.next()
        if isinstance(output, Piece):
            out = []
            if progress is not None and stats is None and output.stats is not None:
                done = output.stats
                out += events.progress(responses_api.prompt_progress(
                    done.n_prompt, done.n_cached, done.n_prompt, 1000 * done.t_encode))
            stats = output.stats or stats
            timings = openai_api.timings(stats) if per_token and stats is not None else None
            out += events.chunks(reply.chunks(output.text), timings)
            for event in out:
                yield _named_event(event)
        elif isinstance(output, Final):
            for event in events.end(reply.last_chunks(output.reason, output.stats)):
                yield _named_event(event)
            return
        elif isinstance(output, Failed):  # as llama-server's: the error as an unnamed event
            yield _event(_error(output).llama_body())
            return


async def _llama_events(job: Job, reply: llama_api.Reply):
    """llama-server's stream: a chunk per piece (per step here, per token there), then the
    final result; no [DONE]."""
    while True:
        output = await job.next()
        if isinstance(output, Piece):
            yield _event(reply.chunk(output))
        elif isinstance(output, Final):
            yield _event(reply.final(output))
            return
        elif isinstance(output, Failed):
            yield _event(_error(output).llama_body())
            return


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _named_event(obj: dict) -> str:
    """A server-sent event named by its type (the Responses API's)."""
    return f"event: {obj['type']}\n{_event(obj)}"


def _error(failed: Failed) -> ApiError:
    """What the client is told: an ApiError as it is, anything else as a bare 500 (the log has the rest)."""
    return failed.error if isinstance(failed.error, ApiError) else ApiError(500, "generation failed")


async def _cancel_on_disconnect(request: Request, job: Job) -> None:
    """Cancel the job when the client disconnects (while it waits, or before a whole answer)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel()


async def read_json(request: Request) -> object:
    """The body as JSON: application/json, at most MAX_BODY bytes, no NaN or Infinity."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise ApiError(415, "the body must be JSON, sent as Content-Type: application/json")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY:
        raise ApiError(413, f"the body is larger than {MAX_BODY} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise ApiError(413, f"the body is larger than {MAX_BODY} bytes")
    try:
        return json.loads(body, parse_constant=_not_json)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ApiError(400, f"invalid JSON: {e}") from None


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


# -- running it -----------------------------------------------------------------

GRACE_SECONDS = 10  # on Ctrl-C or SIGTERM, how long the running generation may go on
LAST_STEP_SECONDS = 5  # then the time its last step and response may take before uvicorn cancels it


def run(app: FastAPI, worker: Worker, socks: list[socket.socket]) -> None:
    """Serve `app` on the listening sockets until Ctrl-C or SIGTERM (see _Uvicorn)."""
    config = uvicorn.Config(app, log_config=_log_config(), server_header=False, lifespan="off",
                            timeout_graceful_shutdown=GRACE_SECONDS + LAST_STEP_SECONDS)
    _Uvicorn(config, worker).run_quietly(socks)


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

    def run_quietly(self, socks: list[socket.socket]) -> None:
        """Run until a signal stops it. uvicorn raises that signal again once it has shut
        down, for the handler it found: in speculate's, it would become a KeyboardInterrupt
        inside the closing event loop. So the signals are ignored until uvicorn takes them,
        and speculate's handlers come back afterwards."""
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in handled}
        try:
            self.run(sockets=socks)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def _log_config() -> dict:
    """uvicorn's logging, with the per-request lines of speculate.serve in the same format.
    Neither logs headers, so the API key never reaches a log."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["loggers"]["speculate"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config
