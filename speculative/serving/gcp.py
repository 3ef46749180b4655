"""Google Cloud's Vertex AI prediction contract, as the pinned llama-server serves it
(tools/server/server-http.cpp, `register_gcp_compat`): with AIP_MODE=PREDICTION in the
environment the server listens on AIP_HTTP_PORT, answers AIP_HEALTH_ROUTE as /health, and
takes POST AIP_PREDICT_ROUTE (default /predict):

    {"instances": [{"@requestFormat": "chatCompletions", ...a request's body...}, ...]}

Each instance is the body of the POST endpoint its @requestFormat names, as a path
("/v1/chat/completions") or in camelCase ("chatCompletions": the path without /v1, its
separators dropped and the next letter capitalised). The instances run together, unstreamed,
and the answer is {"predictions": [each endpoint's JSON answer, or its error object]}."""

from __future__ import annotations

import asyncio
import json
import os
import re
from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from speculative.serving.generation import ApiError

MAX_INSTANCES = 128  # llama-server's


@dataclass(frozen=True)
class Gcp:
    port: int
    predict: str = "/predict"
    health: str = ""  # "": /health only

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> Gcp | None:
        """The contract's variables, or None when AIP_MODE is not PREDICTION; ValueError for a
        port that is not one."""
        if environ.get("AIP_MODE", "") != "PREDICTION":
            return None
        port = environ.get("AIP_HTTP_PORT") or "8080"
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"AIP_HTTP_PORT={port}: not a port number")
        return cls(int(port), _route(environ.get("AIP_PREDICT_ROUTE")) or "/predict",
                   _route(environ.get("AIP_HEALTH_ROUTE")))


def _route(value: str | None) -> str:
    """A route as llama-server reads one: a leading slash added when missing."""
    return "" if not value else value if value.startswith("/") else "/" + value


def camel_case(path: str) -> str:
    """llama-server's name of a path in @requestFormat: /v1/chat/completions -> chatCompletions."""
    name = path.removeprefix("/v1").removeprefix("/").split(":")[0]
    return re.sub(r"[/_-]+(.?)", lambda m: m.group(1).upper(), name)


def add_routes(app: FastAPI, gcp: Gcp, read_json: Callable[[Request], Awaitable[object]]) -> None:
    """The health alias and the predict route, dispatching to `app`'s own POST endpoints;
    `read_json`: the app's reader of a body (its type, size and JSON checked as every endpoint's)."""
    if gcp.health:
        health = next(r for r in app.routes if isinstance(r, Route) and r.path == "/health")
        app.add_api_route(gcp.health, health.endpoint, methods=["GET"])
    paths: dict[str, str] = {}
    for route in app.routes:
        if isinstance(route, Route) and "POST" in (route.methods or ()):
            paths.setdefault(camel_case(route.path), route.path)
            paths.setdefault(route.path, route.path)

    @app.post(gcp.predict)
    async def predict(request: Request) -> JSONResponse:
        try:
            instances = _instances(await read_json(request))
        except ApiError as e:  # llama-server's error object
            return JSONResponse(e.llama_body(), status_code=e.status)
        scope = request.scope
        asked = {"headers": [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"],
                 "client": scope.get("client"), "server": scope.get("server")}
        answers = await asyncio.gather(*(_instance(app, paths, asked, i) for i in instances))
        return JSONResponse({"predictions": answers})


def _instances(data: object) -> list:
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    instances = data.get("instances")
    if not isinstance(instances, list):
        raise ApiError(400, "request body must include an array field named instances")
    if len(instances) > MAX_INSTANCES:
        raise ApiError(400, f"instances array exceeds maximum size of {MAX_INSTANCES}")
    return instances


async def _instance(app: ASGIApp, paths: dict[str, str], asked: dict, instance: object) -> object:
    """One instance's answer: its endpoint's JSON, or an error object."""
    if not isinstance(instance, dict):
        return _error("each instance must be a JSON object")
    name = instance.get("@requestFormat")
    if not isinstance(name, str):
        return _error("each instance must include a string @requestFormat")
    if name not in paths:
        return _error(f"no handler registered for @requestFormat: {name}")
    body = {k: v for k, v in instance.items() if k != "@requestFormat"}
    if "stream" in body:  # the predict route does not stream
        body["stream"] = False
    payload = await _post(app, paths[name], asked, json.dumps(body).encode())
    try:
        return json.loads(payload) if payload else None
    except ValueError:
        return payload.decode("utf-8", errors="replace")


async def _post(app: ASGIApp, path: str, asked: dict, body: bytes) -> bytes:
    """POST `body` to `app`'s `path` in this process, with the predict request's headers, client
    and server (`asked`: the key and the origin are checked as they were): the answer's body."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             **asked, "headers": [*asked["headers"], (b"content-length", str(len(body)).encode())]}
    received = asyncio.Event()  # the body once, then a disconnect only when the answer is complete
    done = asyncio.Event()
    chunks = []

    async def receive() -> dict:
        if not received.is_set():
            received.set()
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    try:
        await app(scope, receive, send)
    finally:
        done.set()
    return b"".join(chunks)


def _error(message: str) -> dict:
    return {"error": ApiError(400, message).llama_body()["error"]}
