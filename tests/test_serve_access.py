"""`speculate serve`'s HTTP surface without a model: who may use it (the Host check, CORS and
the API key, as the pinned llama-server's server-http.cpp has them), llama-server's paths for
its endpoints, and the --host, --port and --cors-* flags. The app runs in this process on a
stand-in worker, called as uvicorn calls it (ASGI); tests/test_serve.py has the real model."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from speculative.cli.serve import listen_addresses
from speculative.serving.access import Cors
from speculative.serving.app import create_app
from speculative.serving.gcp import Gcp, camel_case
from tests.conftest import assert_refused, speculate_here

KEY = "sk-access-test"
# llama.cpp's tests/unit/test_security.py asks a preflight of /completions this way
PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "Authorization"}
CHAT = {"messages": [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]}


class StandInEngine:
    """What the routes without generation read of an engine: a chat template that joins the messages."""

    jinja = True

    def __init__(self):
        self.target = SimpleNamespace(name="stand-in", n_ctx=64, chat_template=lambda: "{{ messages }}",
                                      eog_tokens=lambda: [0])

    def chat_text(self, messages: list[dict], tools=None, extra=None) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def chat_tokens(self, messages: list[dict], tools=None, extra=None) -> list[int]:
        return list(self.chat_text(messages).encode())


def app(api_key: str | None = KEY, loopback_only: bool = True, cors: Cors = Cors(), gcp: Gcp | None = None):
    engine = StandInEngine()
    worker = SimpleNamespace(engine=engine, n_slots=1, sleeping=False, awake=lambda: engine)
    model = {"id": "stand-in", "aliases": [], "tags": [], "created": 0, "meta": {"spec_type": "none", "draft": None}}
    return create_app(worker, model, api_key, loopback_only, cors=cors, gcp=gcp)


def call(asgi, method: str, path: str, headers: dict | None = None, body: object = None,
         server: tuple = ("127.0.0.1", 8080), raw: bytes | None = None) -> tuple[int, dict[str, str], object]:
    """One request as uvicorn hands it over: status, headers as sent (names as spelt), JSON body.
    `raw`: the body's bytes, sent as JSON whatever they are."""
    if raw is None:
        raw = json.dumps(body).encode() if body is not None else b""
    sent = {"Host": "127.0.0.1:8080", **({"Content-Type": "application/json"} if raw else {}), **(headers or {})}
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in sent.items()], "server": server,
             "client": ("127.0.0.1", 40000)}
    messages = []

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message):
        messages.append(message)

    asyncio.run(asgi(scope, receive, send))
    start = messages[0]
    content = b"".join(m.get("body", b"") for m in messages[1:])
    return (start["status"], {k.decode(): v.decode() for k, v in start["headers"]},
            json.loads(content) if content else None)


# -- CORS --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/completions", "/v1/chat/completions", "/nowhere"])
def test_a_preflight_is_answered_on_any_path_without_the_key_as_llama_server_answers_it(path):
    status, headers, body = call(app(), "OPTIONS", path, {"Origin": "web.mydomain.fr", **PREFLIGHT})
    assert status == 200 and body is None
    # llama-server's defaults with an API key: any origin echoed back, with credentials
    assert headers["Access-Control-Allow-Origin"] == "web.mydomain.fr"
    assert headers["Access-Control-Allow-Credentials"] == "true"
    assert headers["Access-Control-Allow-Methods"] == "GET, POST, DELETE, OPTIONS"
    assert headers["Access-Control-Allow-Headers"] == "*"
    assert headers["Vary"] == "Origin"


def test_an_allowed_origin_may_read_every_answer_errors_included():
    asgi = app()
    for key, status in ((KEY, 200), ("wrong", 401)):
        got, headers, _ = call(asgi, "GET", "/v1/models", {"Origin": "https://app.example", "X-Api-Key": key})
        assert got == status and headers["Access-Control-Allow-Origin"] == "https://app.example"
    _, headers, _ = call(asgi, "GET", "/v1/models", {"X-Api-Key": KEY})  # no Origin: not a browser's request
    assert "Access-Control-Allow-Origin" not in headers


@pytest.mark.parametrize("origin", ["http://localhost", "http://localhost:8080", "http://127.0.0.1:3000",
                                    "http://[::1]", "http://[::1]:3000"])
def test_without_a_key_pages_served_by_this_machine_may_use_the_server(origin):
    for method in ("OPTIONS", "GET"):
        _, headers, _ = call(app(api_key=None), method, "/v1/models", {"Origin": origin, **PREFLIGHT})
        assert headers["Access-Control-Allow-Origin"] == origin


@pytest.mark.parametrize("origin", ["http://web.mydomain.fr", "http://evil.com", "http://notlocalhost",
                                    "http://localhost.evil.com", "null", "http://[::1"])
def test_without_a_key_no_other_page_may_read_an_answer(origin):
    """Any web page its user visits could use a keyless server if any origin were allowed."""
    for method in ("OPTIONS", "GET"):
        status, headers, _ = call(app(api_key=None), method, "/v1/models", {"Origin": origin, **PREFLIGHT})
        assert status == 200 and "Access-Control-Allow-Origin" not in headers


def test_cors_origins_localhost_keeps_to_this_machine_even_with_a_key():
    asgi = app(cors=Cors("localhost"))
    assert call(asgi, "OPTIONS", "/completions", {"Origin": "http://localhost:8080"})[1][
        "Access-Control-Allow-Origin"] == "http://localhost:8080"
    assert "Access-Control-Allow-Origin" not in call(asgi, "OPTIONS", "/completions", {"Origin": "http://evil.com"})[1]


def test_cors_origins_lists_the_origins_each_echoed_back_alone():
    asgi = app(cors=Cors("https://a.example, https://b.example"))
    for origin in ("https://a.example", "https://b.example"):
        assert call(asgi, "OPTIONS", "/v1/models", {"Origin": origin})[1]["Access-Control-Allow-Origin"] == origin
    assert "Access-Control-Allow-Origin" not in call(asgi, "OPTIONS", "/v1/models", {"Origin": "https://c.example"})[1]


def test_any_origin_without_credentials_is_a_star_and_the_other_flags_go_into_the_preflight():
    asgi = app(cors=Cors("*", "GET, POST", "Authorization, Content-Type", credentials=False))
    _, headers, _ = call(asgi, "OPTIONS", "/v1/models", {"Origin": "https://a.example"})
    assert headers["Access-Control-Allow-Origin"] == "*" and "Vary" not in headers
    assert headers["Access-Control-Allow-Credentials"] == "false"
    assert headers["Access-Control-Allow-Methods"] == "GET, POST"
    assert headers["Access-Control-Allow-Headers"] == "Authorization, Content-Type"


# -- the Host check and the key ------------------------------------------------------------


@pytest.mark.parametrize("method", ["OPTIONS", "GET"])
def test_a_foreign_host_is_refused_before_cors_on_a_loopback_server(method):
    """A page that rebinds its domain to 127.0.0.1 gets neither an answer nor a preflight."""
    status, headers, body = call(app(api_key=None), method, "/v1/models",
                                 {"Host": "evil.example:8080", "Origin": "http://evil.example:8080"})
    assert status == 400 and "localhost" in body["error"]["message"]
    assert "Access-Control-Allow-Origin" not in headers
    assert call(app(api_key=None, loopback_only=False), method, "/v1/models", {"Host": "evil.example"})[0] == 200


def test_a_unix_socket_takes_any_host():
    """No web page reaches a UNIX socket; a proxy in front of one passes its own Host on."""
    status, _, _ = call(app(api_key=None), "GET", "/v1/models", {"Host": "proxy.example"}, server=("/tmp/s.sock", None))
    assert status == 200


@pytest.mark.parametrize("headers", [{"Authorization": f"Bearer {KEY}"}, {"Authorization": KEY}, {"X-Api-Key": KEY},
                                     {"x-api-key": f"Bearer {KEY}"}])
def test_the_key_is_read_as_llama_server_reads_it(headers):
    assert call(app(), "GET", "/v1/models", headers)[0] == 200


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                                     {"Authorization": "Bearer x", "X-Api-Key": KEY}, {"X-Api-Key": KEY + "x"}])
@pytest.mark.parametrize("path, llama", [("/v1/models", False), ("/completions", True), ("/nowhere", False)])
def test_without_the_key_every_path_but_health_is_401(headers, path, llama):
    status, got, body = call(app(), "GET", path, headers)
    assert status == 401 and got["Www-Authenticate"] == "Bearer"
    assert body["error"]["type"] == "authentication_error" and (body["error"]["code"] == 401) == llama
    assert call(app(), "GET", "/health", headers)[:3:2] == (200, {"status": "ok"})


def test_header_names_go_out_as_llama_server_spells_them():
    """Clients that copy headers into a plain dict (requests' dict(response.headers)) compare
    names case-sensitively."""
    _, headers, _ = call(app(), "GET", "/v1/models", {"X-Api-Key": KEY})
    assert {"Content-Type", "Content-Length"} <= set(headers)


# -- llama-server's paths ------------------------------------------------------------------


def test_llama_servers_paths_without_v1_are_the_same_endpoints():
    asgi = app(api_key=None)
    assert call(asgi, "GET", "/models")[2] == call(asgi, "GET", "/v1/models")[2]
    for path in ("/chat/completions", "/v1/chat/completions", "/chat/completions/input_tokens",
                 "/v1/chat/completions/input_tokens", "/apply-template"):
        status, _, body = call(asgi, "POST", path, body={"messages": []})  # read as the chat endpoint reads it
        assert status == 400 and "messages" in body["error"]["message"], path


def test_apply_template_and_input_tokens_render_the_chat_as_the_chat_endpoint_does():
    asgi = app(api_key=None)
    prompt = StandInEngine().chat_text(CHAT["messages"])
    assert call(asgi, "POST", "/apply-template", body=CHAT)[2] == {"prompt": prompt}
    for path in ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"):
        assert call(asgi, "POST", path, body=CHAT)[2] == {"input_tokens": len(prompt.encode()),
                                                          "object": "response.input_tokens"}


def test_apply_template_errors_are_llama_servers_and_post_props_is_not_supported():
    asgi = app(api_key=None)
    status, _, body = call(asgi, "POST", "/apply-template", body={"messages": "hi"})
    assert status == 400 and body["error"]["code"] == 400 and body["error"]["type"] == "invalid_request_error"
    status, _, body = call(asgi, "POST", "/props", body={})
    assert status == 501 and body["error"]["type"] == "not_supported_error"


# -- Vertex AI's prediction contract (llama.cpp's test_compat_gcp.py has the real model) ------


@pytest.mark.parametrize("path, name", [("/v1/chat/completions", "chatCompletions"), ("/completion", "completion"),
                                        ("/chat/completions/input_tokens", "chatCompletionsInputTokens"),
                                        ("/apply-template", "applyTemplate"), ("/slots/:id_slot", "slots")])
def test_request_formats_are_llama_servers_camel_case_names_of_the_paths(path, name):
    assert camel_case(path) == name


def test_predict_runs_each_instance_on_the_endpoint_its_format_names_with_the_requests_key():
    asgi = app(gcp=Gcp(8080, "/predict", "/ready"))
    prompt = StandInEngine().chat_text(CHAT["messages"])
    instances = [{"@requestFormat": "applyTemplate", **CHAT},
                 {"@requestFormat": "/v1/chat/completions/input_tokens", **CHAT, "stream": True},
                 {"@requestFormat": "chatCompletionsInputTokens", "messages": []},  # the endpoint's own error
                 {"@requestFormat": "embeddings", **CHAT}, {"messages": []}, "text"]
    status, _, body = call(asgi, "POST", "/predict", {"Authorization": f"Bearer {KEY}"}, {"instances": instances})
    assert status == 200
    first, second, bad, *errors = body["predictions"]
    assert first == {"prompt": prompt}
    assert second == {"input_tokens": len(prompt.encode()), "object": "response.input_tokens"}
    assert bad["error"]["type"] == "invalid_request_error" and "messages" in bad["error"]["message"]
    assert [e["error"]["message"] for e in errors] == [
        "no handler registered for @requestFormat: embeddings", "each instance must include a string @requestFormat",
        "each instance must be a JSON object"]
    assert call(asgi, "POST", "/predict", body={"instances": instances})[0] == 401  # the key as anywhere
    assert call(asgi, "GET", "/ready", {"Authorization": f"Bearer {KEY}"})[2] == {"status": "ok"}


@pytest.mark.parametrize("body, message", [([], "request body must be a JSON object"),
                                           ({"instances": {}}, "an array field named instances"),
                                           ({"instances": [{}] * 129}, "exceeds maximum size of 128"),
                                           ({"instances": [float("nan")]}, "invalid JSON: NaN is not JSON")])
def test_a_bad_predict_body_is_llama_servers_400(body, message):
    """Read as every endpoint's body is (read_json), then checked as llama-server checks it."""
    status, _, answer = call(app(api_key=None, gcp=Gcp(8080)), "POST", "/predict", body=body)
    assert status == 400 and message in answer["error"]["message"] and answer["error"]["code"] == 400


def test_the_contract_is_read_from_the_environment_as_llama_server_reads_it():
    assert Gcp.from_environ({"AIP_HTTP_PORT": "9000"}) is None  # AIP_MODE not PREDICTION
    assert Gcp.from_environ({"AIP_MODE": "PREDICTION"}) == Gcp(8080, "/predict", "")
    assert Gcp.from_environ({"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "9000", "AIP_PREDICT_ROUTE": "v1/p",
                             "AIP_HEALTH_ROUTE": "/h"}) == Gcp(9000, "/v1/p", "/h")
    with pytest.raises(ValueError, match="AIP_HTTP_PORT=x"):
        Gcp.from_environ({"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "x"})


# -- the flags -----------------------------------------------------------------------------


@pytest.mark.parametrize("value, hosts", [("127.0.0.1", ["127.0.0.1"]), ("127.0.0.1,::1", ["127.0.0.1", "::1"]),
                                          (" 127.0.0.1 , ,::1,", ["127.0.0.1", "::1"]),
                                          ('"::1",/run/s.sock', ["::1", "/run/s.sock"])])
def test_host_is_read_as_llama_cpp_reads_it(value, hosts):
    assert [a.host for a in listen_addresses(value)] == hosts


def test_only_loopback_addresses_and_unix_sockets_are_local():
    assert [a.local for a in listen_addresses("127.0.0.1,::1,localhost,/tmp/a.sock,0.0.0.0,::")] == [
        True, True, True, True, False, False]


@pytest.mark.parametrize("args, message", [
    (("--host", " , "), "--host requires at least one address"),
    (("--host", "127.0.0.1,::1", "--port", "0"), "--port 0 is not supported with several TCP addresses"),
    (("--host", "127.0.0.1,0.0.0.0"), "--host 0.0.0.0 is reachable from other machines: set an API key"),
    (("--cors-origins", "https://a.example\r\nSet-Cookie: x"), "--cors-origins must be printable ASCII"),
    (("--cors-headers", "Authorization\n"), "--cors-headers must be printable ASCII"),
    (("--sleep-idle-seconds", "0"), "--sleep-idle-seconds must be a number of seconds, or -1 (never), got 0"),
])
def test_bad_listen_and_cors_flags_are_refused_before_anything_loads(args, message):
    assert_refused(speculate_here("serve", "-m", "/nonexistent/model.gguf", *args, env={"SPECULATE_API_KEY": ""}),
                   message)
