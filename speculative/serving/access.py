"""Who may use `speculate serve`, checked before anything else runs (`Guard`, ASGI middleware),
as the pinned llama-server's pre-routing handler checks it (tools/server/server-http.cpp), with
speculate's Host check in front:

1. On a loopback-only server, a Host header naming another machine is refused (400): a web page
   that rebinds its own domain to 127.0.0.1 sends its own name, and gets nothing (a UNIX socket,
   which no web page reaches, takes any).
2. CORS (`Cors`, llama-server's --cors-origins, --cors-methods, --cors-headers,
   --cors-credentials): every answer to a request from an allowed origin carries
   Access-Control-Allow-Origin; a preflight (OPTIONS, any path) is answered at once, without the
   API key, which browsers never send on it.
3. The API key, if one is set, on every path but /health and /v1/health: `Authorization: Bearer
   KEY`, or `Authorization: KEY`, or `X-Api-Key: KEY` (Anthropic's clients), as llama-server reads it.

Header names go out capitalised as llama-server writes them (Content-Type, Process-Start-Time-Unix,
Access-Control-Allow-Origin): HTTP says they are case-insensitive, but clients that copy them into a
plain dict (requests' `dict(response.headers)`, which llama.cpp's own server tests read) do not.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from dataclasses import dataclass, replace
from typing import Callable
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from speculative.serving.generation import ApiError

OPEN_PATHS = ("/health", "/v1/health")  # no API key needed, as in llama-server
ANY_ORIGIN, LOCAL_ORIGINS = "*", "localhost"  # --cors-origins' two special values


@dataclass(frozen=True)
class Cors:
    """llama-server's CORS settings (common.h's defaults). `origins`: "*" (any origin: echoed
    back with credentials, else "*"), "localhost" (an origin on this machine, echoed back), or
    origins separated by commas (one of them echoed back: llama-server sends the setting as it is,
    which a browser takes for one origin only); None: see `for_key`."""
    origins: str | None = None
    methods: str = "GET, POST, DELETE, OPTIONS"
    headers: str = "*"
    credentials: bool = True

    def for_key(self, has_key: bool) -> "Cors":
        """The origins left unset: llama-server's "*" where an API key guards the server;
        "localhost" where none does, or any web page its user visits could use it."""
        if self.origins is not None:
            return self
        return replace(self, origins=ANY_ORIGIN if has_key else LOCAL_ORIGINS)

    def allowed(self, origin: str | None) -> str | None:
        """The Access-Control-Allow-Origin for a request from `origin`; None: none is sent."""
        if not origin:
            return None
        if self.origins == ANY_ORIGIN:
            return origin if self.credentials else ANY_ORIGIN
        if self.origins == LOCAL_ORIGINS:
            return origin if _origin_is_local(origin) else None
        return origin if origin in {o.strip() for o in self.origins.split(",")} else None

    def preflight(self) -> list[tuple[str, str]]:
        """What an OPTIONS request gets besides the origin."""
        return [("Access-Control-Allow-Credentials", "true" if self.credentials else "false"),
                ("Access-Control-Allow-Methods", self.methods), ("Access-Control-Allow-Headers", self.headers)]


def _origin_is_local(origin: str) -> bool:
    """llama-server's origin_is_localhost: the Origin's host is this machine, any port."""
    try:
        host = urlsplit(origin).hostname
    except ValueError:
        return False
    return host is not None and is_loopback(host)


class Guard:
    """ASGI middleware: the Host check, CORS and the API key, before anything else runs.
    `refuse(error, path)`: the response an error gets on that path (each API has its format)."""

    def __init__(self, app: ASGIApp, api_key: str | None, loopback_only: bool, cors: Cors,
                 refuse: Callable[[ApiError, str], ASGIApp]):
        self.app = app
        # Digests have one length, so comparing them reveals nothing about the key's.
        self.key_digest = _digest(api_key) if api_key else None
        self.loopback_only = loopback_only
        self.cors = cors.for_key(api_key is not None)
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        over_tcp = (scope.get("server") or ("", 0))[1] is not None  # a UNIX socket's has no port
        if self.loopback_only and over_tcp and not _is_local_host(headers.get("host")):
            error = ApiError(400, "this server answers requests for localhost only (Host header)")
            await self.refuse(error, scope["path"])(scope, receive, _spelled(send, []))
            return
        origin = self.cors.allowed(headers.get("origin"))
        echoed = origin is not None and origin != ANY_ORIGIN  # then caches must tell origins apart
        send = _spelled(send, [("Access-Control-Allow-Origin", origin)] * bool(origin) + [("Vary", "Origin")] * echoed)
        if scope["method"] == "OPTIONS":  # a preflight: browsers send no key with it
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/html"), (b"content-length", b"0"),
                                    *((k.encode(), v.encode("latin-1")) for k, v in self.cors.preflight())]})
            await send({"type": "http.response.body", "body": b""})
        elif self.key_digest and scope["path"] not in OPEN_PATHS and not hmac.compare_digest(
                _digest(_given_key(headers)), self.key_digest):
            error = ApiError(401, "Invalid API Key: send it as Authorization: Bearer KEY (or X-Api-Key: KEY)")
            await self.refuse(error, scope["path"])(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def _given_key(headers: Headers) -> str:
    """The key a request gives, read as llama-server reads it: Authorization, else X-Api-Key,
    with or without "Bearer "."""
    return (headers.get("authorization") or headers.get("x-api-key") or "").removeprefix("Bearer ")


def _spelled(send: Send, extra: list[tuple[str, str]]) -> Send:
    """`send`, with the response's header names capitalised (Content-Type) and `extra` added."""

    async def spelled(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [(_capitalised(name), value) for name, value in message.get("headers", [])]
            headers += [(name.encode(), value.encode("latin-1")) for name, value in extra]
            message = {**message, "headers": headers}
        await send(message)

    return spelled


def _capitalised(name: bytes) -> bytes:
    return b"-".join(part[:1].upper() + part[1:] for part in name.split(b"-"))


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def _is_local_host(host: str | None) -> bool:
    """Whether a Host header names this machine: localhost or a loopback address, any port."""
    if host is None:  # HTTP/1.0 clients may omit it; browsers never do
        return True
    return is_loopback(host[1:].split("]")[0] if host.startswith("[") else host.rsplit(":", 1)[0])


def is_loopback(host: str) -> bool:
    """Whether an address to listen on (or a Host header, or an Origin's host) is this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost: it could resolve anywhere
        return False
