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
Anthropic's, as llama-server serves them (anthropic_api.py): POST /v1/messages (with "stream":
true, Anthropic's named events) and POST /v1/messages/count_tokens.

What a request must get past, in order (access.Guard, then `read_json`): a Host header naming
this machine when the server listens on loopback only (a web page that rebinds its own domain
to 127.0.0.1 cannot use it); CORS (a preflight is answered there, and only an allowed origin
may read an answer); the API key, if one is set, on every path but /health (Authorization, or
X-Api-Key as Anthropic's clients send it); a JSON body (Content-Type application/json, which a
web page cannot send cross-origin without a CORS preflight) of at most MAX_BODY bytes. Errors
are OpenAI error objects, and llama-server's on its own endpoints, on Anthropic's and on the Responses API's (as
llama-server gives them there).
"""

from __future__ import annotations

import asyncio
import copy
import functools
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
from speculative.serving import anthropic_api, llama_api, openai_api, responses_api
from speculative.serving.access import OPEN_PATHS, Cors, Guard
from speculative.serving.gcp import Gcp
from speculative.serving.gcp import add_routes as gcp_routes
from speculative.serving.generation import ApiError, Busy, Defaults, Generation
from speculative.serving.openai_api import Reply
from speculative.serving.worker import Failed, Job, Progress, Started, Worker, chat_prompt, request_tokens

MAX_BODY = 8 << 20        # bytes: a full 128k-token context as JSON-escaped text fits
RETRY_AFTER_SECONDS = 1   # what a refused client is told to wait
RESPONSES_PATHS = ("/v1/responses", "/responses", "/v1/responses/input_tokens", "/responses/input_tokens")
# llama-server's own endpoints, and Anthropic's and the Responses API's as it serves them: their errors are
# llama-server's error objects
LLAMA_PATHS = ("/completion", "/completions", "/infill", "/tokenize", "/detokenize", "/apply-template", "/props",
               "/metrics", "/slots", "/v1/messages", "/v1/messages/count_tokens", *OPEN_PATHS, *RESPONSES_PATHS)


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
    _add_anthropic_routes(app, worker, model, defaults)
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
        return await _llama_generate(request, worker, model, llama_api.completion_prompts, defaults)

    @app.post("/infill")
    async def infill(request: Request):
        return await _llama_generate(request, worker, model, lambda vocab, data: [llama_api.infill_prompt(vocab, data)],
                                     defaults)

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
        generation = openai_api.parse(await read_json(request), True, defaults, _jinja_template(engine), engine.target)
        return {"prompt": await asyncio.to_thread(chat_prompt, engine, generation, engine.chat_text)}

    @app.post("/v1/chat/completions/input_tokens")
    @app.post("/chat/completions/input_tokens")
    async def input_tokens(request: Request) -> dict:
        engine = await awake(worker)
        return await _count_tokens(engine, await read_json(request), defaults)


async def _count_tokens(engine: Engine, chat: object, defaults: Defaults) -> dict:
    """A chat body's prompt length in tokens, as llama-server's input_tokens endpoints give it."""
    generation = openai_api.parse(chat, True, defaults, _jinja_template(engine), engine.target)
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


def _add_anthropic_routes(app: FastAPI, worker: Worker, model: dict, defaults: Defaults) -> None:
    """Anthropic's Messages API (anthropic_api.py): a request read as /v1/chat/completions reads
    the OpenAI body it becomes, the answer written back in Anthropic's shapes."""

    @app.post("/v1/messages")
    async def messages(request: Request):
        engine = await awake(worker)
        generation = _anthropic_generation(await read_json(request), defaults, engine)
        reply = Reply(model["id"], generation)
        n_prompt = 0

        def started(i: int, first: Started) -> None:
            nonlocal n_prompt
            n_prompt = len(first.prompt)
            reply.started(first.prompt_tail)

        return await _answer(request, worker, [generation],
                             lambda finals: anthropic_api.message(reply.full(finals[0]), finals[0].stop_word),
                             lambda jobs: _anthropic_events(jobs[0], reply, anthropic_api.Events(n_prompt)), started)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict:
        engine = await awake(worker)
        generation = _anthropic_generation(await read_json(request), defaults, engine)
        return {"input_tokens": len(await asyncio.to_thread(request_tokens, engine, generation))}


def _anthropic_generation(body: object, defaults: Defaults, engine: Engine) -> Generation:
    """An Anthropic body, as its OpenAI chat body is read (with no messages too, as llama-server)."""
    return openai_api.parse(anthropic_api.to_openai(body), True, defaults, _jinja_template(engine), engine.target,
                            no_messages=True)


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
    """/v1/completions or /v1/chat/completions: each prompt's n choices, a Reply each."""
    engine = await awake(worker)
    generations = openai_api.parse_all(await read_json(request), chat, defaults,
                                       _jinja_template(engine) if chat else "", engine.target)
    per_choice = [g for g in generations for _ in range(g.n)]
    replies: list[Reply] = []
    for g in per_choice:
        replies.append(Reply(model["id"], g, len(replies), replies[0] if replies else None, engine.target.token_bytes))
    prompts: list[tuple[int, ...]] = [()] * len(replies)

    def started(i: int, first: Started) -> None:
        prompts[i] = first.prompt
        replies[i].started(first.prompt_tail)

    def verbose(i: int, final: Final) -> dict | None:
        """llama-server's __verbose object, when the request asks for it."""
        if not per_choice[i].verbose:
            return None
        return llama_api.verbose(model["id"], per_choice[i], prompts[i], engine.target, model["meta"]["spec_type"],
                                 final)

    def whole(finals: list[Final]) -> dict:
        return openai_api.combined([replies[i].full(f, verbose(i, f)) for i, f in enumerate(finals)], finals,
                                   generations[0].n)

    return await _answer(request, worker, generations, whole,
                         lambda jobs: _openai_events(jobs, replies, verbose, generations[0].n), started)


async def _respond(request: Request, worker: Worker, model: dict, defaults: Defaults):
    """A Responses request, run as the chat request it becomes; the chat answer, or its chunks,
    made a Response or its events."""
    engine = await awake(worker)
    chat = responses_api.to_chat(await read_json(request))  # return_progress, timings_per_token passed on
    # the usage comes in the stream's last chunk, for response.completed
    generation = replace(openai_api.parse(chat, True, defaults, _jinja_template(engine), engine.target),
                         include_usage=True)
    reply = Reply(model["id"], generation)

    def started(i: int, first: Started) -> None:
        reply.started(first.prompt_tail)

    return await _answer(request, worker, [generation],
                         lambda finals: responses_api.response(reply.full(finals[0])),
                         lambda jobs: _response_events(jobs[0], reply, responses_api.Events(model["id"])),
                         started)


async def _llama_generate(request: Request, worker: Worker, model: dict, prompts_of, defaults: Defaults):
    """/completion or /infill: `prompts_of(vocab, body)` gives each prompt's tokens; each prompt's
    n_cmpl answers, a Reply each (several: a list of answers, or streamed, each chunk its index)."""
    vocab = (await awake(worker)).target
    data = await read_json(request)
    prompts = await asyncio.to_thread(prompts_of, vocab, data)
    parsed = [llama_api.parse(data, tokens, model["meta"]["spec_type"], defaults, vocab.eog_tokens(), vocab)
              for tokens in prompts]
    replies = [llama_api.Reply(model["id"], options, tokens, functools.partial(llama_api.text_of, vocab, tokens),
                               vocab.n_ctx, vocab.token_bytes, i * generation.n + j)
               for i, (tokens, (generation, options)) in enumerate(zip(prompts, parsed)) for j in range(generation.n)]

    def whole(finals: list[Final]):
        answers = [reply.final(final) for reply, final in zip(replies, finals)]
        return answers[0] if len(answers) == 1 else answers

    return await _answer(request, worker, [generation for generation, _ in parsed], whole,
                         lambda jobs: _llama_events(jobs, replies))


async def _answer(request: Request, worker: Worker, generations: list[Generation], whole, events, started=None):
    """Run a request's generations, each choice a job: `whole(finals)` is the answer, or with
    "stream": true `events(jobs)` the server-sent events; `started(i, Started)` is told when
    choice i's prompt has passed its checks."""
    jobs: list[Job] = []
    stream = None  # once it exists, it owns the jobs
    watcher = asyncio.create_task(_cancel_on_disconnect(request, jobs))
    try:
        for generation in generations:  # all or none: a refused one cancels those queued
            jobs += worker.submit(generation)
        for i, job in enumerate(jobs):
            try:  # waiting for the models, then the prompt's checks
                first = await asyncio.wait_for(job.next(), timeout=max(job.deadline - time.monotonic(), 0))
            except asyncio.TimeoutError:
                raise Busy(f"the models were not free within --timeout ({worker.timeout:g} s)") from None
            if isinstance(first, Failed):
                raise _error(first)
            if started is not None:
                started(i, first)
        if generations[0].stream:
            stream = EventStream(jobs, events(jobs))
            return stream
        return JSONResponse(whole([await _final(job) for job in jobs]))
    finally:
        watcher.cancel()  # a streaming response watches for the client itself
        if stream is None:
            for job in jobs:
                job.cancel()  # finished already, or its request failed or was abandoned


async def _final(job: Job) -> Final:
    """A job's Final, which carries the whole text (ApiError if it failed)."""
    while not isinstance(output := await job.next(), Final):
        if isinstance(output, Failed):
            raise _error(output)
    return output


async def _outputs(jobs: list[Job]):
    """Every job's outputs after Started, (choice, output) as they come, each job's in order,
    until each has ended (Final or Failed)."""
    waiting = {asyncio.ensure_future(job.next()): i for i, job in enumerate(jobs)}
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=waiting.get):
                i = waiting.pop(future)
                output = future.result()
                yield i, output
                if not isinstance(output, (Final, Failed)):
                    waiting[asyncio.ensure_future(jobs[i].next())] = i
    finally:
        for future in waiting:
            future.cancel()


class EventStream(StreamingResponse):
    """Server-sent events. However the response ends (the client may have gone before the
    first byte), the generations stop with it."""

    def __init__(self, jobs: list[Job], events):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.jobs = jobs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for job in self.jobs:
                job.cancel()


async def _chunked(jobs: list[Job], replies: list):
    """Each choice's outputs as they come, with its index: a progress report or a piece as the
    chunks its reply makes of it (a list), its Final or Failed as it is."""
    async for i, output in _outputs(jobs):
        if isinstance(output, Progress):
            yield i, [replies[i].progress(output)]
        elif isinstance(output, Piece):
            yield i, replies[i].chunks(output)
        else:
            yield i, output


async def _openai_events(jobs: list[Job], replies: list[Reply], verbose, n: int):
    """OpenAI's stream: each choice's chunks as they come (prompt_progress chunks too, when asked),
    its last ones with its usage and timings (and `verbose(i, final)`: llama-server's __verbose
    object, or None); with several choices and include_usage, the usage of all at the end; then
    [DONE]."""
    for reply in replies:
        if (first := reply.first_chunk()) is not None:
            yield _event(first)
    finals: list[Final] = []
    async for i, output in _chunked(jobs, replies):
        if isinstance(output, list):
            for chunk in output:
                yield _event(chunk)
        elif isinstance(output, Final):
            finals.append(output)
            for chunk in replies[i].last_chunks(output, verbose(i, output), include_usage=len(jobs) == 1):
                yield _event(chunk)
        elif isinstance(output, Failed):  # the status line has gone: the error is an event
            yield _event(_error(output).body())
            return
    if len(jobs) > 1 and replies[0].include_usage:
        yield _event(replies[0].usage_chunk(openai_api.total_stats(finals, n)))
    yield "data: [DONE]\n\n"


async def _response_events(job: Job, reply: Reply, events: responses_api.Events):
    """The Responses stream, from the chat chunks of each piece: its opening, the prompt's progress
    (return_progress) in response.in_progress events, each step's events (with timings_per_token,
    the timings so far that the reply put on its last chunk, on the last), the end; no [DONE]."""
    for event in events.opening(None):
        yield _named_event(event)
    while True:
        output = await job.next()
        if isinstance(output, Progress):
            for event in events.progress(output.json()):
                yield _named_event(event)
        elif isinstance(output, Piece):
            chunks = reply.chunks(output)
            for event in events.chunks(chunks, chunks[-1].get("timings") if chunks else None):
                yield _named_event(event)
        elif isinstance(output, Final):
            for event in events.end(reply.last_chunks(output)):
                yield _named_event(event)
            return
        elif isinstance(output, Failed):  # as llama-server's: the error as an unnamed event
            yield _event(_error(output).llama_body())
            return


async def _llama_events(jobs: list[Job], replies: list[llama_api.Reply]):
    """llama-server's stream: each answer's chunks as they come (each with its index; per step
    here, per token there, and with n_probs per token here too), then its final result; no
    [DONE]."""
    async for i, output in _chunked(jobs, replies):
        if isinstance(output, list):
            for chunk in output:
                yield _event(chunk)
        elif isinstance(output, Final):
            yield _event(replies[i].final(output))
        elif isinstance(output, Failed):
            yield _event(_error(output).llama_body())
            return


async def _anthropic_events(job: Job, reply: Reply, events: anthropic_api.Events):
    """Anthropic's stream: the OpenAI chunks of `reply` as Anthropic's named events; an error
    after the first byte as an `error` event holding llama-server's error object."""
    yield _named(events.chunk(reply.first_chunk()))  # message_start
    while True:
        output = await job.next()
        if isinstance(output, Piece):
            if text := _named([e for chunk in reply.chunks(output) for e in events.chunk(chunk)]):
                yield text
        elif isinstance(output, Final):
            yield _named(events.end(reply.last_chunks(output), output.stop_word))
            return
        elif isinstance(output, Failed):
            yield _named([{"event": "error", "data": _error(output).llama_body()["error"]}])
            return


def _named(events: list[dict]) -> str:
    """Server-sent events with names ({"event": NAME, "data": OBJECT} each), as Anthropic's API sends them."""
    return "".join(_named_event(e["data"], e["event"]) for e in events)


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _named_event(obj: dict, name: str | None = None) -> str:
    """A server-sent event with a name (event: NAME, then data: JSON), by default its type (the
    Responses API's)."""
    return f"event: {name or obj['type']}\n{_event(obj)}"


def _error(failed: Failed) -> ApiError:
    """What the client is told: an ApiError as it is, anything else as a bare 500 (the log has the rest)."""
    return failed.error if isinstance(failed.error, ApiError) else ApiError(500, "generation failed")


async def _cancel_on_disconnect(request: Request, jobs: list[Job]) -> None:
    """Cancel the jobs when the client disconnects (while they wait, or before a whole answer)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for job in jobs:
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
