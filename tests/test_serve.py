"""`speculate serve` on a real model: the official openai client, raw HTTP for what a
well-behaved client never sends, many clients at once, disconnects and signals.

One server (SmolLM2 as its own draft: greedy, every drafted token is accepted) serves the
module; the tests that need other flags start their own. Those of the queue, disconnects and
time hold a request where they need it (PROBE_SERVE), so none depends on this machine's speed.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import openai  # the test extra (pip install -e '.[test]'): without it this module must fail, not skip
import pytest

from speculative.serving.app import GRACE_SECONDS
from tests.conftest import SMOL, SPECULATE, probe_command, speculate, speculate_json
from tests.gguf_builder import write_tiny_llama
from tests.probe import HOLD_PROMPT, HOLD_STEP
from tests.tiny_model import write_model

pytestmark = pytest.mark.real

KEY = "sk-test-" + secrets.token_hex(12)
MIB = 1 << 20
SPEC = ("--spec-type", "draft", "--draft-max", "4", "-c", "2048")


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, key: str = KEY):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120)

    def request(self, method: str, path: str, body: object = None, headers: dict | None = None,
                key: str | None = KEY, raw: bytes | None = None) -> tuple[int, dict, object]:
        """One HTTP request: status, headers (lower-case names), and the JSON body."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        sent = {"Content-Type": "application/json"} if body is not None or raw is not None else {}
        if key is not None:
            sent["Authorization"] = f"Bearer {key}"
        sent.update(headers or {})
        data = raw if raw is not None else json.dumps(body).encode() if body is not None else None
        try:
            conn.request(method, path, body=data, headers=sent)
            resp = conn.getresponse()
            text = resp.read()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, json.loads(text) if text else None
        finally:
            conn.close()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


# A server whose requests a test can hold where it needs them (tests/probe.py's PROBE_SERVE), so
# that what it checks never depends on how fast this machine generates: a prompt starting with
# HOLD_STEP is held after its first piece, one starting with HOLD_PROMPT inside its prompt's decode.


def start_server(model_path, tmp_path: Path, *args: str, key: str | None = KEY, model: str | None = None,
                 env: dict[str, str] | None = None, probe: bool = False) -> Server:
    """`speculate serve -m MODEL ARGS` (with `probe`, under tests/probe.py's PROBE_SERVE), answering /health."""
    model = model or str(model_path(SMOL))
    port = _free_port()
    log = tmp_path / f"serve-{port}.log"
    env = {**os.environ, "SPECULATE_API_KEY": key or "", **({"PROBE_SERVE": "1"} if probe else {}), **(env or {})}
    command = probe_command("serve") if probe else [SPECULATE, "serve"]
    with open(log, "wb") as out:
        proc = subprocess.Popen([*command, "-m", model, "--port", str(port), *args],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, port, log)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"speculate serve exited {proc.returncode}: {server.log_text()[-3000:]}")
        try:
            if server.request("GET", "/health", key=None)[0] == 200:
                return server
        except OSError:
            time.sleep(0.2)
    proc.kill()
    pytest.fail(f"speculate serve did not answer /health: {server.log_text()[-3000:]}")


def stop_server(server: Server) -> int:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
    try:
        return server.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    # two slots with their own KV streams: a request's greedy answer is the one-shot command's
    s = start_server(model_path, tmp_path_factory.mktemp("serve"), "-md", str(model_path(SMOL)), *SPEC,
                     "-np", "2", "--no-kv-unified", "-c", "4096", "--max-waiting", "2")  # 2048 each
    yield s
    stop_server(s)


def cli_json(model_path, prompt: str, n: int, *args: str) -> dict:
    """The one-shot command's greedy answer, with the server's model and speculation flags."""
    smol = str(model_path(SMOL))
    return speculate_json("-m", smol, "-md", smol, *SPEC, "-p", prompt, "--no-escape", "-n", str(n),
                          "--temp", "0", *args)


def completion(server: Server, **body) -> dict:
    status, _, answer = server.request("POST", "/v1/completions", {"max_tokens": 16, "temperature": 0, **body})
    assert status == 200, answer
    return answer


def at_once(server: Server, prompts, max_tokens: int) -> dict[str, dict]:
    """A completion of each prompt, each from a client of its own, all at once: prompt -> answer."""
    answers: dict = {}
    clients = [threading.Thread(target=lambda p=p: answers.setdefault(p, completion(server, prompt=p,
                                                                                    max_tokens=max_tokens)))
               for p in prompts]
    for client in clients:
        client.start()
    for client in clients:
        client.join(timeout=300)
    return answers


def sse(server: Server, path: str, body: dict, read_all: bool = True) -> list[dict]:
    """The data events of a streamed answer, [DONE] included as the string '[DONE]'."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    events = []
    for line in resp:
        if line.startswith(b"data: "):
            data = line[6:].strip().decode()
            events.append(data if data == "[DONE]" else json.loads(data))
    conn.close()
    return events


# -- access ----------------------------------------------------------------------------


def test_health_is_open_and_every_other_endpoint_needs_the_key(server):
    status, _, answer = server.request("GET", "/health", key=None)
    assert status == 200 and answer == {"status": "ok"}
    for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "hi"}),
                               ("POST", "/v1/chat/completions", {"messages": []}), ("GET", "/nowhere", None)):
        for key in (None, "wrong", KEY[:-1], KEY + "x", ""):
            status, headers, answer = server.request(method, path, body, key=key)
            assert status == 401, (path, key, answer)
            assert answer["error"]["type"] == "authentication_error" and headers["www-authenticate"] == "Bearer"
    assert server.request("GET", "/v1/models")[0] == 200
    assert server.request("GET", "/nowhere")[0] == 404
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()


def test_models_names_the_target_and_its_draft(server, model_path):
    models = server.client().models.list().data
    name = model_path(SMOL).name  # given as a path: the file's name
    assert [m.id for m in models] == [name]
    assert models[0].meta == {"n_ctx": 2048, "draft": name, "spec_type": "draft"}


def test_a_foreign_host_header_is_refused_on_a_loopback_server(server):
    """A web page that rebinds its own domain to 127.0.0.1 sends its own name as Host."""
    status, _, answer = server.request("GET", "/v1/models", headers={"Host": f"evil.example:{server.port}"})
    assert status == 400 and "localhost" in answer["error"]["message"]
    for host in (f"localhost:{server.port}", "127.0.0.1", f"[::1]:{server.port}"):
        assert server.request("GET", "/v1/models", headers={"Host": host})[0] == 200, host


def test_llama_servers_paths_are_the_same_endpoints_and_a_preflight_needs_no_key(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    assert server.request("GET", "/models")[2]["data"][0]["id"] == server.client().models.list().data[0].id
    prompt = server.request("POST", "/apply-template", {"messages": messages})[2]["prompt"]
    n_tokens = server.request("POST", "/chat/completions/input_tokens", {"messages": messages})[2]["input_tokens"]
    status, _, answer = server.request("POST", "/chat/completions", {"messages": messages, "max_tokens": 1})
    assert status == 200 and answer["usage"]["prompt_tokens"] == n_tokens  # the prompt the chat runs
    assert "Name a colour." in prompt
    assert len(server.request("POST", "/tokenize", {"content": prompt, "add_special": True})[2]["tokens"]) == n_tokens
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("OPTIONS", "/chat/completions", headers={"Origin": "https://app.example",
                                                          "Access-Control-Request-Method": "POST"})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    headers = dict(resp.getheaders())  # names as sent: llama-server's spelling
    assert resp.status == 200 and headers["Access-Control-Allow-Origin"] == "https://app.example"  # a key is set
    assert headers["Access-Control-Allow-Methods"] == "GET, POST, DELETE, OPTIONS"


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, socket_path: Path):
        super().__init__("localhost", timeout=60)
        self.socket_path = str(socket_path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.socket_path)


def test_several_addresses_and_a_unix_socket_serve_alike(model_path, tmp_path):
    """--host as llama-server takes it: comma-separated, a UNIX socket among them (which takes any
    Host, as no web page reaches it), its file removed at exit."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("IPv6 loopback is unavailable")
    path = tmp_path / "serve.sock"
    server = start_server(model_path, tmp_path, "--spec-type", "none", "-t", "1", "--host", f"127.0.0.1,::1,{path}",
                          key=None)
    try:
        for conn, host in ((http.client.HTTPConnection("::1", server.port, timeout=60), f"[::1]:{server.port}"),
                           (UnixConnection(path), "proxy.example")):
            conn.request("POST", "/completion", body=json.dumps({"prompt": "hi", "n_predict": 2}),
                         headers={"Content-Type": "application/json", "Host": host})
            resp = conn.getresponse()
            assert resp.status == 200 and json.loads(resp.read())["tokens_predicted"] >= 1, host
            conn.close()
    finally:
        assert stop_server(server) == 0
    assert not path.exists()


# -- answers ---------------------------------------------------------------------------


def test_greedy_completion_is_the_one_shot_commands_output(server, model_path, batch_invariant):
    prompt = "The three primary colours are"
    # ignore_eos: all 24 tokens ("length") wherever this CPU's greedy text would reach EOS
    cli = cli_json(model_path, prompt, 24, "--ignore-eos")
    answer = server.client().completions.create(model="any", prompt=prompt, max_tokens=24, temperature=0,
                                                extra_body={"ignore_eos": True})
    assert answer.choices[0].text == cli["text"] and cli["text"].strip()
    assert answer.choices[0].finish_reason == cli["finish_reason"] == "length"
    assert answer.usage.prompt_tokens == cli["n_prompt"] and answer.usage.completion_tokens == 24
    timings = answer.model_extra["timings"]
    assert timings["draft_n"] == cli["n_drafted"] > 0
    assert timings["draft_n_accepted"] == cli["n_accept"] == timings["draft_n"]  # its own draft
    assert timings["draft_accept_rate"] == 1.0 and timings["predicted_n"] == 24
    assert timings["predicted_per_second"] > 0 and timings["prompt_n"] + timings["cache_n"] == cli["n_prompt"]


def test_streamed_chat_is_the_one_shot_chat_one_chunk_per_step(server, model_path, batch_invariant):
    question = "Name three colours."
    # ignore_eos: all 20 tokens ("length") however short this CPU's greedy answer is
    cli = cli_json(model_path, question, 20, "--chat", "--ignore-eos")
    stream = server.client().chat.completions.create(
        model="any", messages=[{"role": "user", "content": question}], max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    *chunks, last = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content for c in chunks[1:] if c.choices[0].delta.content]
    assert "".join(pieces) == cli["text"]
    # OpenAI's and llama-server's end: the finish, then the usage in a chunk of no choices, with the timings
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None
    assert last.choices == [] and last.usage.completion_tokens == 20
    timings = last.model_extra["timings"]
    steps = round(timings["predicted_n"] / timings["tokens_per_step"])
    assert steps == cli["n_steps"] and len(pieces) <= steps < 20  # whole steps, not single tokens
    assert len(pieces) >= steps - 1  # only a step that ends the answer may have no text of its own


def test_a_second_chat_turn_reuses_the_cached_conversation(server):
    """The caches keep the conversation so far: the next turn processes only what is new."""
    client = server.client()
    system = ("You are a patient assistant for a small bakery. You answer questions about bread, cakes, "
              "opening hours and prices, briefly and politely, in plain English.")
    turn = [{"role": "system", "content": system}, {"role": "user", "content": "What is sourdough?"}]
    first = client.chat.completions.create(model="any", messages=turn, max_tokens=12, temperature=0)
    turn += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And rye bread?"}]
    second = client.chat.completions.create(model="any", messages=turn, max_tokens=12, temperature=0)
    timings = second.model_extra["timings"]
    assert timings["cache_n"] >= first.usage.prompt_tokens - 1, timings  # the whole first turn, at least
    assert second.usage.prompt_tokens_details.cached_tokens == timings["cache_n"]
    assert timings["prompt_n"] == second.usage.prompt_tokens - timings["cache_n"] > 0
    other = client.chat.completions.create(model="any", max_tokens=4, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "Are you open on Sunday?"}])
    assert 30 <= other.model_extra["timings"]["cache_n"] < other.usage.prompt_tokens  # the system prompt


# -- --cache-ram: earlier conversations in host memory -----------------------------------

SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTIONS = {"A": ["What is a prime number?", "Give an example of one.", "Is 91 one of them?"],
             "B": ["Who wrote Hamlet?", "When was he born?", "Name another play of his."]}


def take_turns(server: Server, order: str, questions: dict[str, list[str]], max_tokens: int,
               **extra) -> list:
    """One OpenAI client per conversation; each letter of `order` is its client asking the
    conversation's next question, with the conversation so far (greedy): the answers in order."""
    clients = {name: server.client() for name in questions}
    history = {name: [{"role": "system", "content": SYSTEM}] for name in questions}
    answers = []
    for name in order:
        turn = sum(1 for m in history[name] if m["role"] == "user")
        history[name].append({"role": "user", "content": questions[name][turn]})
        answer = clients[name].chat.completions.create(model="any", messages=history[name], max_tokens=max_tokens,
                                                       temperature=0, extra_body=extra)
        history[name].append({"role": "assistant", "content": answer.choices[0].message.content})
        answers.append(answer)
    return answers


def cache_n(answer) -> int:
    return answer.model_extra["timings"]["cache_n"]


def test_two_clients_taking_turns_keep_their_conversations_with_cache_ram(server, model_path, tmp_path,
                                                                           batch_invariant):
    """The module's server has llama-server's default --cache-ram (8192 MiB): each turn restores
    its conversation so far (prompt and answer) from host memory, where with --cache-ram 0 the
    other client's turn left only the system prompt in the caches; the answers are the same."""
    cached = take_turns(server, "ABABAB", QUESTIONS, 24)
    plain_server = start_server(model_path, tmp_path, "-md", str(model_path(SMOL)), *SPEC, "--cache-ram", "0",
                                "-np", "1")  # one slot: each turn finds the other conversation there
    try:
        plain = take_turns(plain_server, "ABABAB", QUESTIONS, 24)
    finally:
        stop_server(plain_server)
    assert [a.choices[0].message.content for a in cached] == [a.choices[0].message.content for a in plain]
    template = cache_n(plain[1])  # the system prompt, which B's first turn shares with A's
    assert 0 < template < plain[0].usage.prompt_tokens
    assert [cache_n(a) for a in plain[1:]] == [template] * 5
    for before, now in zip(cached, cached[2:]):  # the same client's previous turn, and this one
        history = before.usage.prompt_tokens + before.usage.completion_tokens  # (+ its end of turn)
        assert history - 1 <= cache_n(now) <= history + 1 and cache_n(now) < now.usage.prompt_tokens
        assert now.usage.prompt_tokens_details.cached_tokens == cache_n(now)
    assert "cache-ram:" not in plain_server.log_text()


def test_cache_ram_evicts_the_least_recently_used_under_a_small_budget(model_path, tmp_path, batch_invariant):
    """--cache-ram 1 with a tiny model of 4 KiB per token: 1 MiB holds two conversations of
    about 100 tokens, not three. A second turn finds its conversation when it was used more
    recently than another, and answers as with no cache; a state larger than the budget is not
    kept; nothing fails."""
    model = str(write_model("llama", tmp_path / "tiny.gguf", n_embd=256, n_layer=8))
    words = "Tell me about the {} and its people."  # with the system prompt, 86 tokens
    questions = {name: [words.format(topic), "Why?", "And then?"]
                 for name, topic in (("A", "city of Rome"), ("B", "island of Crete"), ("C", "valley of Nile"))}
    questions["D"] = [" ".join(["a long question about everything"] * 20)]  # 517 tokens: 2 MiB
    order = "ABCABCDA"
    args = ("-t", "1", "--spec-type", "ngram-simple", "-c", "1024", "-np", "1")  # one slot, one cache
    answers, logs = {}, {}
    # --cache-ram's default comes from $LLAMA_ARG_CACHE_RAM, as llama-server's; the flag wins over it
    for budget, flag in (("1", ()), ("0", ("--cache-ram", "0"))):
        server = start_server(model_path, tmp_path, *args, *flag, model=model, env={"LLAMA_ARG_CACHE_RAM": "1"})
        try:
            answers[budget] = take_turns(server, order, questions, 8, ignore_eos=True)
        finally:
            assert stop_server(server) == 0
        logs[budget] = server.log_text()
        assert "Traceback" not in logs[budget] and "ERROR" not in logs[budget]
    assert "cache-ram:" not in logs["0"]
    cached, plain = answers["1"], answers["0"]
    assert [a.choices[0].message.content for a in cached] == [a.choices[0].message.content for a in plain]
    template = cache_n(plain[1])  # the system prompt (D's question starts otherwise: less)
    assert all(cache_n(a) <= template for a in plain[1:])
    a1, b1, c1, a2, b2, c2, d1, a3 = cached
    assert 0.3 < (a1.usage.prompt_tokens + 8) * 4096 / MIB < 0.4  # each first turn's state
    # A's second turn makes room for C's first by evicting B's, the least recently used
    assert cache_n(a2) >= a1.usage.prompt_tokens and cache_n(b2) == cache_n(plain[4]) == template
    assert cache_n(c2) >= c1.usage.prompt_tokens  # C was used more recently than A's second turn
    assert cache_n(a3) == cache_n(plain[7]) < template  # A's went for B's: what D's question shares
    # B's first turn, A's second, and the first turns A's and C's replaced (a random model's
    # answer written back into the conversation may tokenize otherwise: the old entry stays)
    assert logs["1"].count("the least recently used") >= 2, logs["1"]
    too_large = re.findall(r"a state of (\d+) tokens \(([\d.]+) MiB\) is larger than --cache-ram 1\.00 MiB; not kept",
                           logs["1"])
    assert [int(n) for n, _ in too_large] == [d1.usage.prompt_tokens + 7] and float(too_large[0][1]) > 2


def test_cache_ram_bad_values_are_usage_errors():
    for value in ("-2", "lots", "1.5"):
        for args, env in ((("--cache-ram", value), None), ((), {"LLAMA_ARG_CACHE_RAM": value})):
            proc = speculate("serve", *args, "-m", "/nonexistent.gguf", env=env)
            assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
            assert proc.stderr.startswith("speculate: error:") and "cache-ram" in proc.stderr


def test_cache_prompt_false_processes_the_whole_prompt_and_keeps_the_live_conversation(server):
    """llama-server's cache_prompt: false, with --cache-ram (the module's server has its default):
    nothing is kept or restored for the request, though a saved conversation starts like it,
    and the conversation the caches held is saved first, so a later request continuing it
    restores it."""
    def ask(prompt: str, **extra) -> dict:
        status, _, answer = server.request("POST", "/completion", {"prompt": prompt, "n_predict": 4,
                                                                    "temperature": 0, "ignore_eos": True, **extra})
        assert status == 200, answer
        return answer

    zebras = "Zebras live on the grasslands of Africa and eat grass all day. " * 3 + "Tell me about zebras."
    penguins = "Penguins live on the ice of Antarctica and eat fish all day. " * 3 + "Tell me about penguins."
    ask(zebras)
    first = ask(penguins)  # the zebras' conversation goes to the RAM cache
    whole = ask(zebras + " And their stripes?", cache_prompt=False)
    assert whole["timings"]["cache_n"] == 0 and whole["timings"]["prompt_n"] == whole["tokens_evaluated"]
    later = ask(penguins + " And their eggs?")  # the penguins' conversation, saved by the request before
    assert later["timings"]["cache_n"] >= first["tokens_evaluated"] - 1 > 40, later["timings"]


def test_draft_trees_serve_the_one_shot_commands_greedy_output(model_path, tmp_path, batch_invariant):
    """serve's --draft-branches is the one-shot command's -np (there -np is the request queue)."""
    smol = str(model_path(SMOL))
    tree = ("--spec-type", "draft", "--draft-max", "4", "-c", "2048", "--draft-p-split", "0.05")
    server = start_server(model_path, tmp_path, "-md", smol, *tree, "--draft-branches", "3")
    try:
        answer = completion(server, prompt="The capital of France is", max_tokens=24)
    finally:
        stop_server(server)
    cli = speculate_json("-m", smol, "-md", smol, *tree, "-np", "3", "-p", "The capital of France is",
                         "-n", "24", "--temp", "0")
    assert answer["choices"][0]["text"] == cli["text"] and cli["text"].strip()
    assert answer["timings"]["draft_n"] == cli["n_drafted"] > 0


def test_requests_at_once_each_get_the_one_shot_answer(server, model_path, batch_invariant):
    """The module's server has two slots with their own KV streams: two clients at once each get
    the one-shot command's greedy answer, and /props and /slots say there are two slots."""
    prompts = ("The capital of France is", "def fibonacci(n):")
    answers = at_once(server, prompts, max_tokens=24)
    for p in prompts:
        assert answers[p]["choices"][0]["text"] == cli_json(model_path, p, 24)["text"]
    status, _, props = server.request("GET", "/props")
    assert status == 200 and props["total_slots"] == 2 and props["endpoint_slots"] is True
    status, _, slots = server.request("GET", "/slots")
    assert status == 200 and [s["id"] for s in slots] == [0, 1] and all(s["n_ctx"] == 2048 for s in slots)
    assert all(s["speculative"] and not s["is_processing"] for s in slots)


def test_a_requests_own_speculation_overrides_the_servers(server):
    """speculative.* in a body: its type and draft lengths for this request only; the greedy
    answer stays the same; what cannot run here is a 400."""
    body = {"prompt": "List the planets of the solar system:", "max_tokens": 24}
    served = completion(server, **body)
    plain = completion(server, **body, **{"speculative.type": "none"})
    short = completion(server, **body, **{"speculative.n_max": 1})
    assert served["choices"][0]["text"] == plain["choices"][0]["text"] == short["choices"][0]["text"]
    assert served["timings"]["draft_n"] > 0 and plain["timings"]["draft_n"] == 0
    assert 0 < short["timings"]["draft_n"] <= short["timings"]["predicted_n"]  # one drafted token a step at most
    for extra, message in (({"speculative.type": "draft-mtp"}, "draft-mtp needs an MTP head"),
                           ({"speculative.type": "sideways"}, "unknown type sideways"),
                           ({"speculative.n_max": 0}, "speculative.n_max: must be an integer >= 1"),
                           ({"speculative.p_min": 2}, "speculative.p_min: must be a number in [0, 1]")):
        status, _, answer = server.request("POST", "/v1/completions", {**body, **extra})
        assert status == 400 and message in answer["error"]["message"], answer


def test_auto_asked_by_a_request_is_priced_from_the_book_or_refused(model_path, tmp_path):
    """With slots running, nothing can be calibrated (it would decode into their sequences): a
    request's own auto on a server started without it is served where the book of costs knows
    the model, and refused (400) where it does not."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(model_path(SMOL).parent)
    env = {"SPECULATE_HOME": str(home)}
    body = {"prompt": "Once upon a time", "max_tokens": 4, "speculative.type": "auto"}
    server = start_server(model_path, tmp_path, "-np", "2", "--spec-type", "none", "-c", "1024", env=env)
    try:
        status, _, answer = server.request("POST", "/v1/completions", body)
        assert status == 400 and "start with --spec-type auto" in answer["error"]["message"], answer
        assert completion(server, **{**body, "speculative.type": "ngram-simple"})["choices"][0]["text"]
    finally:
        stop_server(server)
    assert speculate("-m", str(model_path(SMOL)), "-p", "hi", "-n", "1", "-c", "1024", env=env).returncode == 0
    server = start_server(model_path, tmp_path, "-np", "2", "--spec-type", "none", "-c", "1024", env=env)
    try:
        assert completion(server, **body)["choices"][0]["text"]
    finally:
        stop_server(server)


def server_rss(server: Server) -> int:
    """The server process's resident memory, in bytes."""
    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024


def test_a_bounded_load_loses_nothing_and_its_memory_stays_flat(model_path, tmp_path, batch_invariant):
    """-np 2 with KV streams of their own, 8 clients (4 per slot) sending 200 requests between
    them: every request is answered, every greedy answer is what its prompt gets alone, and the
    server holds no more memory after the second 100 than after the first."""
    server = start_server(model_path, tmp_path, "--spec-type", "ngram-simple", "-t", "1", "-np", "2",
                          "--no-kv-unified", "-c", "1024", "--cache-ram", "0", key=None)
    prompts = [f"Item {i} of a list of fruits:" for i in range(5)]
    answers: dict[str, set] = {p: set() for p in prompts}
    lock = threading.Lock()

    def client(k: int, n: int) -> None:
        for j in range(n):
            prompt = prompts[(k + j) % len(prompts)]
            text = completion(server, prompt=prompt, max_tokens=8)["choices"][0]["text"]
            with lock:
                answers[prompt].add(text)

    def load() -> None:  # 100 requests
        clients = [threading.Thread(target=client, args=(k, 100 // 8 + (k < 100 % 8))) for k in range(8)]
        for c in clients:
            c.start()
        for c in clients:
            c.join(timeout=600)
        assert not any(c.is_alive() for c in clients)

    try:
        load()
        first = server_rss(server)
        load()
        second = server_rss(server)
        props = server.request("GET", "/props")[2]
    finally:
        assert stop_server(server) == 0
    assert props["total_slots"] == 2
    assert second <= first + 16 * 2**20, (first, second)
    smol = str(model_path(SMOL))
    for prompt, texts in answers.items():
        alone = speculate_json("-m", smol, "--spec-type", "ngram-simple", "-t", "1", "-p", prompt, "--no-escape",
                               "-n", "8", "--temp", "0")["text"]
        assert texts == {alone}, prompt
    assert "Traceback" not in server.log_text()


def during_a_long_prompt(model_path, tmp_path, budget: str) -> tuple[int, float, float]:
    """What a running stream gets while a long prompt goes in, on a two-slot server with this
    --prefill-budget: its pieces between the prompt's arrival (its stream's start) and its first
    generated text, its largest gap between pieces there, and that window's length (seconds)."""
    server = start_server(model_path, tmp_path, "--spec-type", "none", "-t", "1", "-np", "2", "--prefill-budget",
                          budget, key=None)
    try:
        conn, running = open_stream(server, {"prompt": "Count from one to a thousand:", "max_tokens": 2000,
                                             "ignore_eos": True, "temperature": 0})
        running.readline()  # its first piece: it generates
        arrivals: list[float] = []

        def read() -> None:
            try:
                for line in running:
                    if line.startswith(b"data: "):
                        arrivals.append(time.monotonic())
            except (OSError, ValueError, AttributeError):  # the test closed the connection under it
                pass

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        long_conn, long = open_stream(server, {"prompt": "word " * 600, "max_tokens": 2, "temperature": 0})
        accepted = time.monotonic()  # the response began: the prompt passed its checks and goes in now
        while not long.readline().startswith(b"data: "):  # its first piece: its prompt is in
            pass
        first = time.monotonic()
        long_conn.close()
        conn.close()
        times = [accepted, *(t for t in list(arrivals) if accepted <= t <= first), first]
        return len(times) - 2, max(b - a for a, b in zip(times, times[1:])), first - accepted
    finally:
        stop_server(server)


def test_a_long_prompt_goes_in_chunks_while_another_request_generates(model_path, tmp_path):
    """--prefill-budget 50: the 600-token prompt goes in about 50 ms chunks, one per step, and
    the running stream gets a piece at each; with 0 (whole -b chunks, as llama-server) it waits
    for the whole prompt: one gap of most of the prompt's time."""
    pieces, gap, window = during_a_long_prompt(model_path, tmp_path, "50")
    assert pieces >= 5 and gap < window / 2, (pieces, gap, window)
    pieces, gap, window = during_a_long_prompt(model_path, tmp_path, "0")
    assert gap >= window / 2, (pieces, gap, window)


def test_streamed_and_whole_completions_agree(server):
    # ignore_eos: all 20 tokens ("length") wherever this CPU's greedy code would reach EOS
    whole = completion(server, prompt="def add(a, b):", max_tokens=20, ignore_eos=True)
    events = sse(server, "/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 20, "temperature": 0,
                                             "ignore_eos": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 20
    assert all(c["choices"][0]["finish_reason"] is None and "usage" not in c for c in chunks[:-1])


def test_a_stop_string_across_a_chunk_boundary_never_leaks(server):
    body = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True}  # 40 tokens of chunks to choose from, wherever EOS would come here
    chunks = [e["choices"][0]["text"] for e in sse(server, "/v1/completions", body)[:-1]]
    text = "".join(chunks)
    ends = [sum(len(c) for c in chunks[:i + 1]) for i in range(len(chunks) - 1)]
    # a stop string made of the last 2 characters of a chunk and the first 2 of the next
    at = next(e for e in ends if e >= 2 and len(text) >= e + 2 and text.find(text[e - 2:e + 2]) == e - 2)
    stop = text[at - 2:at + 2]
    events = sse(server, "/v1/completions", {**body, "stop": ["\u0000never", stop]})
    streamed = [e["choices"][0]["text"] for e in events[:-1]]
    assert "".join(streamed) == text[:at - 2]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    whole = completion(server, **body, stop=stop)
    assert whole["choices"][0]["text"] == text[:at - 2] and whole["choices"][0]["finish_reason"] == "stop"


def test_omitted_fields_and_unknown_ones(server):
    """No temperature: llama.cpp's sampling defaults (seeded, it repeats); unknown fields are ignored."""
    body = {"prompt": "My favourite animal is", "max_tokens": 12, "seed": 42, "user": "me",
            "stream_options": {"include_usage": True}, "logit_bias": {}}
    status, _, a = server.request("POST", "/v1/completions", body)
    status_b, _, b = server.request("POST", "/v1/completions", body)
    assert status == status_b == 200
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


# -- bad requests -----------------------------------------------------------------------


@pytest.mark.parametrize("path, body, status, message", [
    ("/v1/completions", b"{not json", 400, "invalid JSON"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, "invalid JSON: NaN"),
    ("/v1/completions", b"[1, 2]", 400, "must be a JSON object"),
    ("/v1/completions", b'{"prompt": "\xc3\x28"}', 400, "invalid JSON: 'utf-8' codec"),
    ("/v1/completions", b"[" * 100_000, 400, "invalid JSON"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens: Input should be a valid integer"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5.0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", 1]}, 400, "stop.1"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**40}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi " * 3000}, 400, "the context holds 2048"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt: Field required"),
    ("/v1/completions", {"prompt": "hi", "n": 3}, 400, "need as many slots"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, 400,
     "top_logprobs requires logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"x": "y"}}, 400,
     "logit_bias"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "only text parts"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     400, "tools.0.function: Field required"),
])
def test_bad_requests_get_an_openai_error(server, path, body, status, message):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    got, _, answer = server.request("POST", path, raw=raw)
    assert got == status, answer
    error = answer["error"]
    # a prompt the context cannot hold: llama-server's type, and its n_prompt_tokens and n_ctx besides
    too_long = error["code"] == "context_length_exceeded"
    assert message in error["message"], error
    assert error["type"] == ("exceed_context_size_error" if too_long else "invalid_request_error"), error
    context = {"n_prompt_tokens", "n_ctx"} if too_long else set()
    assert set(error) == {"message", "type", "param", "code"} | context


def test_bodies_must_be_small_json(server):
    got, _, answer = server.request("POST", "/v1/completions", raw=b'{"prompt": "' + b"a" * (9 << 20) + b'"}')
    assert got == 413 and "larger than" in answer["error"]["message"]
    got, _, answer = server.request("POST", "/v1/completions", raw=b'{"prompt": "hi"}',
                                    headers={"Content-Type": "text/plain"})
    assert got == 415, answer
    assert server.request("GET", "/health", key=None)[0] == 200


def test_a_hostile_chat_template_is_a_400_and_the_server_stays_up(model_path, tmp_path):
    evil = write_tiny_llama(tmp_path / "evil.gguf", chat_template="{{ cycler.__init__.__globals__ }}")
    server = start_server(model_path, tmp_path, "--spec-type", "none", model=str(evil))
    try:
        status, _, answer = server.request("POST", "/v1/chat/completions",
                                           {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert status == 400 and "refused by the sandbox" in answer["error"]["message"], answer
        assert answer["error"]["param"] == "messages"
        # ignore_eos: the random tiny model's greedy pick may be EOS, and which it is depends on the CPU
        assert completion(server, prompt="hi", max_tokens=2, ignore_eos=True)["usage"]["completion_tokens"] == 2
    finally:
        stop_server(server)
    assert "Traceback" not in server.log_text()


# -- started as llama.cpp's server tests start llama-server --------------------------------


@pytest.fixture(scope="module")
def as_llama_tests(model_path, tmp_path_factory):
    """A server started with the flags llama.cpp's own server tests give llama-server
    (tools/server/tests/utils.py: --temp 0.8 --seed 42 --no-jinja unless a test asks for jinja, an
    alias, -n, -cb), on a context of 256 tokens."""
    s = start_server(model_path, tmp_path_factory.mktemp("as-llama-tests"), "--temp", "0.8", "--seed", "42",
                     "--no-jinja", "--alias", "x", "-n", "16", "-cb", "--spec-type", "none", "-c", "256", "-np", "1")
    yield s
    stop_server(s)


def test_llama_cpps_server_test_flags_mean_what_they_mean_to_llama_server(as_llama_tests, batch_invariant):
    client = as_llama_tests.client()
    assert [m.id for m in client.models.list().data] == ["x"]
    chat = [{"role": "user", "content": "Name a colour."}]
    # ignore_eos: all -n 16 tokens ("length") wherever this CPU's sampled text would reach EOS
    first, second = (client.chat.completions.create(model="any", messages=chat, extra_body={"ignore_eos": True})
                     for _ in range(2))
    for answer in (first, second):
        assert answer.model == "x" and answer.choices[0].finish_reason == "length"
        assert answer.usage.completion_tokens == 16  # -n: the default of max_tokens
    # sampled at --temp 0.8 with --seed 42: a request that gives neither draws the same
    assert first.choices[0].message.content == second.choices[0].message.content
    params = as_llama_tests.request("GET", "/props")[2]["default_generation_settings"]["params"]
    assert (params["temperature"], params["seed"], params["n_predict"]) == (0.8, 42, 16)
    # --no-jinja: llama.cpp's own chatml, without the system message SmolLM2's Jinja template adds
    chatml = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"
    tokens = as_llama_tests.request("POST", "/tokenize", {"content": chatml, "add_special": True})[2]["tokens"]
    assert first.usage.prompt_tokens == len(tokens)


def test_max_tokens_beyond_the_context_ends_at_its_end_with_length(as_llama_tests):
    """Clients send max_tokens 4096 whatever -c is: as llama-server, the answer is clamped to
    what the context leaves after the prompt and ends there, finish_reason length."""
    client = as_llama_tests.client()
    answer = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Count to a thousand."}],
                                            max_tokens=4096, extra_body={"ignore_eos": True})
    usage = answer.usage
    assert answer.choices[0].finish_reason == "length" and usage.prompt_tokens + usage.completion_tokens == 256
    chunks = list(client.completions.create(model="x", prompt="Once upon a time", max_tokens=4096, stream=True,
                                            extra_body={"ignore_eos": True}))
    usage = chunks[-1].usage
    assert chunks[-1].choices[0].finish_reason == "length" and usage.prompt_tokens + usage.completion_tokens == 256
    # a prompt that fills the context by itself is still refused, with llama-server's type and numbers
    # and OpenAI's code
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="x", prompt="word " * 300, max_tokens=4)
    assert e.value.code == "context_length_exceeded" and e.value.type == "exceed_context_size_error"
    assert e.value.body["n_ctx"] == 256 and e.value.body["n_prompt_tokens"] > 256


def test_verbose_answers_carry_llama_servers_object_with_the_prompt(as_llama_tests):
    """A request's `verbose` (by default serve's -v): the answer carries `__verbose`, the answer as
    llama-server's own /completion gives it, the rendered prompt included; streamed, on the
    first of the last chunks."""
    client = as_llama_tests.client()
    messages = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
    answer = client.chat.completions.create(model="x", messages=messages, max_tokens=2, extra_body={"verbose": True})
    verbose = answer.model_extra["__verbose"]
    assert "Book" in verbose["prompt"] and verbose["prompt"].endswith("What is the best book<|im_end|>\n"
                                                                      "<|im_start|>assistant\n")
    assert verbose["content"] == answer.choices[0].message.content and verbose["stop"] is True
    assert verbose["tokens_evaluated"] == answer.usage.prompt_tokens and verbose["tokens_predicted"] == 2
    assert verbose["generation_settings"]["n_predict"] == 2 and verbose["timings"]["predicted_n"] == 2
    assert "__verbose" not in client.chat.completions.create(model="x", messages=messages, max_tokens=2).model_extra
    chunks = [c.model_extra for c in client.chat.completions.create(
        model="x", messages=messages, max_tokens=2, stream=True, extra_body={"verbose": True})]
    marked = [i for i, c in enumerate(chunks) if "__verbose" in c]
    assert len(marked) == 1 and chunks[marked[0]]["__verbose"]["content"] == ""  # streamed: the text came in chunks
    assert "timings" in chunks[-1] and marked[0] >= len(chunks) - 2


def test_idle_models_sleep_and_the_next_request_that_needs_them_wakes_them(model_path, tmp_path):
    """--sleep-idle-seconds, as llama-server's: once no request has needed the models for that
    long they are freed (/props' is_sleeping says so); what only reads the server's state does not
    wake them; the next request that needs them loads them again, and answers as before."""
    server = start_server(model_path, tmp_path, "--spec-type", "none", "-np", "1", "--metrics",
                          "--sleep-idle-seconds", "1")

    def asleep() -> bool:
        return server.request("GET", "/props")[2]["is_sleeping"]

    def fall_asleep() -> None:
        deadline = time.monotonic() + 120  # a hang's guard: the server reports when it sleeps
        while not asleep():
            assert time.monotonic() < deadline, server.log_text()[-2000:]
            time.sleep(0.2)

    try:
        body = {"prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True}
        first = completion(server, **body)["choices"][0]["text"]
        fall_asleep()
        metrics(server)  # a scrape starts the speed window again (llama-server's buckets)
        before = metrics(server)
        for path in ("/health", "/v1/models", "/props", "/slots"):
            assert server.request("GET", path)[0] == 200, path
        assert metrics(server) == before and asleep()  # none of them woke the models
        assert completion(server, **body)["choices"][0]["text"] == first and not asleep()
        fall_asleep()
        status, _, tokens = server.request("POST", "/tokenize", {"content": "Hello"})
        assert status == 200 and tokens["tokens"] and not asleep()
        log = server.log_text()
        assert log.count("sleeping: no request for 1 s") == 2 and log.count("waking up") == 2
    finally:
        stop_server(server)


# -- load, disconnects, time -----------------------------------------------------------
# Each of these holds a request (PROBE_SERVE) where the test needs it: a queue seen full stays
# full, a disconnect lands mid-stream or mid-prompt, a deadline or the drain's grace comes
# while the request still runs, on any machine. What they check is what the server reports:
# its answers, its log lines, its /metrics gauges; wall-clock bounds only guard against a hang.

FINISH = re.compile(r"completion: (?:\d+ prompt tokens \(\d+ cached\), (\d+) generated .*"
                    r"|stopped during its prompt of (\d+) tokens), finish: (\w+)")


@pytest.fixture(scope="module")
def held(model_path, tmp_path_factory):
    """A server whose requests can be held (PROBE_SERVE): SmolLM2 alone, one slot, --max-waiting 2,
    /metrics."""
    s = start_server(model_path, tmp_path_factory.mktemp("held"), "--spec-type", "none", "-t", "1",
                     "-np", "1", "--max-waiting", "2", "--metrics", probe=True)
    yield s
    stop_server(s)


def open_stream(server: Server, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A streamed /v1/completions request, its response begun (the prompt passed its checks)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def metrics(server: Server) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in text.splitlines()
                                                  if line and not line.startswith("#"))}


def _wait_for_metrics(server: Server, expected: dict[str, float], seconds: float = 60) -> dict[str, float]:
    """Until /metrics reports these values."""
    t0 = time.monotonic()
    while True:
        now = metrics(server)
        if all(now[name] == value for name, value in expected.items()):
            return now
        assert time.monotonic() - t0 < seconds, (expected, now)
        time.sleep(0.05)


def finished(server: Server, start: int, n: int = 1, seconds: float = 60) -> list[tuple[int | None, int | None, str]]:
    """The first `n` requests' log lines after the log's first `start` characters, once there:
    (tokens generated, or None; the prompt's tokens if it was stopped during it, or None; the
    finish reason)."""
    t0 = time.monotonic()
    while len(found := FINISH.findall(server.log_text()[start:])) < n:
        assert time.monotonic() - t0 < seconds, server.log_text()[start:]
        time.sleep(0.05)
    return [(int(g) if g else None, int(p) if p else None, reason) for g, p, reason in found[:n]]


def test_a_full_queue_refuses_at_once_and_the_waiting_requests_run_after(held):
    """-np 1 --max-waiting 2: one request generates (held after its first piece), two wait (seen in
    /metrics), and every other one is refused at once with 503; the two run once the running
    one's client has gone."""
    start = len(held.log_text())
    refused_before = metrics(held)["speculate:requests_refused_total"]
    conn, running = open_stream(held, {"prompt": HOLD_STEP + "Count to 100:", "max_tokens": 64, "ignore_eos": True})
    assert running.readline().startswith(b"data: ")
    _wait_for(held, "probe: holding after the first piece", start)
    answers: list = [None, None]

    def wait(i: int) -> None:
        answers[i] = held.request("POST", "/v1/completions", {"prompt": f"Count to {i + 3}:", "max_tokens": 4,
                                                              "temperature": 0, "ignore_eos": True})

    waiting = [threading.Thread(target=wait, args=(i,)) for i in range(2)]
    for t in waiting:
        t.start()
    _wait_for_metrics(held, {"llamacpp:requests_processing": 1, "llamacpp:requests_deferred": 2})
    barrier = threading.Barrier(17)
    refused: list = [None] * 17

    def refuse(i: int) -> None:
        barrier.wait()
        refused[i] = held.request("POST", "/v1/completions", {"prompt": f"Count to {i}:", "max_tokens": 4})

    threads = [threading.Thread(target=refuse, args=(i,)) for i in range(17)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert None not in refused, "a request beyond the queue was not refused at once: it waits"
    for status, headers, answer in refused:
        assert status == 503 and headers["retry-after"] == "1", answer
        assert answer["error"]["type"] == "unavailable_error" and "every place in the queue" in answer["error"]["message"]
    now = metrics(held)
    assert now["speculate:requests_refused_total"] - refused_before == 17
    assert now["llamacpp:requests_processing"] == 1 and now["llamacpp:requests_deferred"] == 2  # still full
    conn.close()  # the running one's client goes: it stops, and the two waiting run
    for t in waiting:
        t.join(timeout=300)
    for status, _, answer in answers:
        assert status == 200 and answer["choices"][0]["finish_reason"] == "length", answer
        assert answer["usage"]["completion_tokens"] == 4
    (generated, _, reason), *rest = finished(held, start, 3)
    assert reason == "cancelled" and 1 <= generated < 64 and [r[2] for r in rest] == ["length", "length"]
    _wait_for_metrics(held, {"llamacpp:requests_processing": 0, "llamacpp:requests_deferred": 0})


def test_a_client_that_disconnects_mid_stream_stops_its_generation(held):
    start = len(held.log_text())
    conn, resp = open_stream(held, {"prompt": HOLD_STEP + "Write a very long story:", "max_tokens": 1500,
                                    "ignore_eos": True, "temperature": 0})
    assert resp.readline().startswith(b"data: ")  # generating: its first piece
    _wait_for(held, "probe: holding after the first piece", start)
    conn.close()
    [(generated, _, reason)] = finished(held, start)
    assert reason == "cancelled" and 1 <= generated < 1500  # stopped at the step after the close
    # ignore_eos: exactly 2 tokens, wherever this CPU's greedy text would reach EOS
    assert completion(held, prompt="Next", max_tokens=2, ignore_eos=True)["usage"]["completion_tokens"] == 2


def test_a_request_is_in_the_log_and_metrics_before_its_client_has_the_answer(held):
    """A script that reads the log or /metrics once its answer is in sees that request there
    (the tests' `finished(server, start)` counts on it: a line written after the answer could
    land past the next test's `start`). The probe says when an answer is about to be posted."""
    start = len(held.log_text())
    before = metrics(held)["llamacpp:tokens_predicted_total"]
    assert completion(held, prompt="Next", max_tokens=2, ignore_eos=True)["usage"]["completion_tokens"] == 2
    assert metrics(held)["llamacpp:tokens_predicted_total"] - before == 2
    log = held.log_text()[start:]  # the probe says "posting" before the answer goes: no wait
    line = FINISH.search(log)
    assert line and line.group(3) == "length" and line.start() < log.index("probe: posting a request's answer"), log


def test_a_client_that_disconnects_during_a_long_prompt_stops_its_processing(held):
    """llama.cpp's abort callback asks whether the request must stop: a client gone in the
    middle of a long prompt does not hold the models until the prompt is in. (The probe holds
    the prompt at its decode's first graph node until the request must stop, so the cancel
    lands inside llama.cpp however fast this machine processes prompts.)"""
    prompt = HOLD_PROMPT + "pear: " + " ".join(f"pear{i}" for i in range(400))
    start = len(held.log_text())
    conn, _ = open_stream(held, {"prompt": prompt, "max_tokens": 100})
    _wait_for(held, "probe: holding inside llama.cpp's prompt decode", start)
    closed = time.monotonic()
    conn.close()
    [(generated, n_prompt, reason)] = finished(held, start)
    assert reason == "cancelled" and generated is None and n_prompt > 400  # the prompt never got in
    assert time.monotonic() - closed < 60  # a guard against a hang
    assert "Traceback" not in held.log_text()[start:]
    # ignore_eos: exactly 2 tokens, wherever this CPU's greedy text would reach EOS
    assert completion(held, prompt="Next", max_tokens=2, ignore_eos=True)["usage"]["completion_tokens"] == 2


def test_the_key_never_reaches_the_log(server):
    """Neither the key of a request that ran nor a wrong one is logged (this test makes its own
    request: the module's server is another on each xdist worker)."""
    status, _, _ = server.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert status == 200
    server.request("GET", "/v1/models", key="sk-wrong-" + KEY[8:])
    log = server.log_text()
    assert KEY[8:] not in log and "POST /v1/completions" in log and "Traceback" not in log


def test_timeout_ends_a_generation_with_what_it_has_and_refuses_a_request_still_waiting(model_path, tmp_path):
    """--timeout 3: a request still waiting for the models then gets 503, and the running one,
    held until then, ends at its next step with what it has (finish_reason length)."""
    release = tmp_path / "release"
    server = start_server(model_path, tmp_path, "--spec-type", "none", "-t", "1", "-np", "1", "--timeout", "3", probe=True,
                          env={"PROBE_RELEASE": str(release)})
    try:
        answers: list = []
        running = threading.Thread(target=lambda: answers.append(server.request("POST", "/v1/completions", {
            "prompt": HOLD_STEP + "Write a very long story:", "max_tokens": 1500, "ignore_eos": True})))
        running.start()
        _wait_for(server, "probe: holding after the first piece")
        status, headers, waited = server.request("POST", "/v1/completions", {"prompt": "Me next", "max_tokens": 2})
        assert status == 503 and headers["retry-after"] == "1", waited
        assert "the models were not free within --timeout (3 s)" in waited["error"]["message"]
        release.touch()  # past its deadline by now: it ends at its next step
        running.join(timeout=120)
        assert answers, "the running request did not end at its next step, past its deadline"
        status, _, answer = answers[0]
        assert status == 200 and answer["choices"][0]["finish_reason"] == "length", answer
        assert 0 < answer["usage"]["completion_tokens"] < 1500
    finally:
        assert stop_server(server) == 0
    assert "Traceback" not in server.log_text()


def test_sigint_lets_the_running_answer_finish_and_exits_0(model_path, tmp_path):
    release = tmp_path / "release"
    server = start_server(model_path, tmp_path, "--spec-type", "none", "-t", "1", "-np", "1", key=None, probe=True,
                          env={"PROBE_RELEASE": str(release)})
    events: list = []
    reader = threading.Thread(target=lambda: events.extend(sse(server, "/v1/completions", {
        "prompt": HOLD_STEP + "Tell me a story:", "max_tokens": 16, "ignore_eos": True})))
    reader.start()
    _wait_for(server, "probe: holding after the first piece")  # it runs: SIGINT comes in the middle
    server.proc.send_signal(signal.SIGINT)
    _wait_for(server, f"shutting down: 0 waiting requests refused; the running one has {GRACE_SECONDS} s to finish")
    release.touch()
    reader.join(timeout=120)
    assert server.proc.wait(timeout=60) == 0, server.log_text()
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 16
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    log = server.log_text()
    assert "grace is over" not in log and "Traceback" not in log and "ERROR" not in log


def test_sigterm_refuses_waiting_requests_and_ends_the_running_one_within_the_grace(model_path, tmp_path):
    """The running request is held until it must stop: only the grace's end stops it."""
    server = start_server(model_path, tmp_path, "--spec-type", "none", "-t", "1", "-np", "1", "--metrics", key=None,
                          probe=True)
    events: list = []
    queued: list = []
    reader = threading.Thread(target=lambda: events.extend(sse(server, "/v1/completions", {
        "prompt": HOLD_STEP + "Tell me a story:", "max_tokens": 1500, "ignore_eos": True})))
    reader.start()
    _wait_for(server, "probe: holding after the first piece")
    waiting = threading.Thread(target=lambda: queued.append(
        server.request("POST", "/v1/completions", {"prompt": "Me next", "max_tokens": 2})))
    waiting.start()
    _wait_for_metrics(server, {"llamacpp:requests_processing": 1, "llamacpp:requests_deferred": 1})
    sent = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    waiting.join(timeout=60)
    assert queued[0][0] == 503 and "shutting down" in queued[0][2]["error"]["message"]
    assert server.proc.wait(timeout=120) == 0, server.log_text()
    assert time.monotonic() - sent > GRACE_SECONDS  # it ran on until the grace was over
    reader.join(timeout=60)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert 0 < events[-2]["usage"]["completion_tokens"] < 1500
    log = server.log_text()
    assert f"shutting down: 1 waiting request refused; the running one has {GRACE_SECONDS} s to finish" in log
    assert f"shutting down: the {GRACE_SECONDS} s grace is over; the running generation ends with what it has" in log
    assert "Traceback" not in log and "ERROR" not in log


def _wait_for(server: Server, text: str, start: int = 0, seconds: float = 60) -> None:
    """Until the log shows `text` after its first `start` characters."""
    t0 = time.monotonic()
    while text not in server.log_text()[start:]:
        assert time.monotonic() - t0 < seconds, server.log_text()
        time.sleep(0.05)


# -- the command line ---------------------------------------------------------------------


def test_a_non_loopback_host_needs_an_api_key():
    proc = speculate("serve", "--host", "0.0.0.0", env={"SPECULATE_API_KEY": ""})
    assert proc.returncode == 2
    assert proc.stderr.startswith("speculate: error: --host 0.0.0.0 is reachable from other machines")


def test_a_taken_port_fails_before_the_models_load(model_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proc = speculate("serve", "-m", str(model_path(SMOL)), "--port", str(taken.getsockname()[1]), timeout=60)
    assert proc.returncode == 2 and "cannot listen on 127.0.0.1:" in proc.stderr, proc.stderr
