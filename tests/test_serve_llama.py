"""llama-server's own endpoints of `speculate serve` on a real model with FIM tokens
(qwen2.5-coder-0.5b): the requests llama.vim and llama.vscode really send, greedy identity
with the one-shot command, streaming, the editors' limits, and the small endpoints.

The editors' request bodies are built from their source, copied below verbatim (Vimscript and
TypeScript) with where they come from; the Vimscript is read by a small parser, so the test
sends exactly the fields llama.vim does.
"""

from __future__ import annotations

import http.client
import json
import re
import time

import pytest

from tests.conftest import QWEN_DRAFT, SMOL, speculate_json, vendored
from tests.gguf_builder import write_chain_llama
from tests.test_llama_api import NEUTRAL_CASES
from tests.test_serve import KEY, Server, metrics, start_server, stop_server

pytestmark = pytest.mark.real

SPEC = ("--spec-type", "ngram-simple", "-c", "4096", "-t", "1")

# llama.vim as vendored in the pinned llama.cpp (llama_cpp_python-0.3.36/vendor/llama.cpp/
# examples/llama.vim): its default configuration and the body of llama#fim's request, verbatim.
VIM_CONFIG = r"""
let s:default_config = {
    \ 'endpoint':         'http://127.0.0.1:8012/infill',
    \ 'n_prefix':         256,
    \ 'n_suffix':         64,
    \ 'n_predict':        128,
    \ 't_max_prompt_ms':  500,
    \ 't_max_predict_ms': 3000,
    \ 'show_info':        2,
    \ 'auto_fim':         v:true,
    \ 'max_line_suffix':  8,
    \ 'ring_n_chunks':    64,
    \ 'ring_chunk_size':  64,
    \ 'ring_scope':       1024,
    \ 'ring_update_ms':   1000,
    \ }
"""
VIM_FIM_REQUEST = r"""
    let l:request = json_encode({
        \ 'input_prefix':     l:prefix,
        \ 'input_suffix':     l:suffix,
        \ 'input_extra':      l:extra_context,
        \ 'prompt':           l:prompt,
        \ 'n_predict':        g:llama_config.n_predict,
        \ 'n_indent':         l:indent,
        \ 'top_k':            40,
        \ 'top_p':            0.99,
        \ 'stream':           v:false,
        \ 'samplers':         ["top_k", "top_p", "infill"],
        \ 'cache_prompt':     v:true,
        \ 't_max_prompt_ms':  g:llama_config.t_max_prompt_ms,
        \ 't_max_predict_ms': g:llama_config.t_max_predict_ms
        \ })
"""
# s:ring_update's request (extra context sent ahead, "so that it is ready for the next FIM")
VIM_RING_REQUEST = r"""
    let l:request = json_encode({
        \ 'input_prefix':     "",
        \ 'input_suffix':     "",
        \ 'input_extra':      l:extra_context,
        \ 'prompt':           "",
        \ 'n_predict':        1,
        \ 'temperature':      0.0,
        \ 'stream':           v:false,
        \ 'samplers':         ["temperature"],
        \ 'cache_prompt':     v:true,
        \ 't_max_prompt_ms':  1,
        \ 't_max_predict_ms': 1
        \ })
"""


def vim_dict(source: str, local: dict, config: dict | None = None) -> dict:
    """The entries `\\ 'key': value` of a Vimscript dict literal, their values evaluated."""
    out = {}
    for key, value in re.findall(r"\\ '(\w+)':\s+(.+?),?\s*$", source, re.M):
        if value.startswith("l:"):
            out[key] = local[value[2:]]
        elif value.startswith("g:llama_config."):
            out[key] = config[value[len("g:llama_config."):]]
        elif value in ("v:true", "v:false"):
            out[key] = value == "v:true"
        else:
            out[key] = json.loads(value.replace("'", '"'))
    return out


def vim_fim_body(lines: list[str], y: int, x: int, chunks: list[dict]) -> dict:
    """llama#fim's request for a buffer of `lines`, the cursor on line y (1-based) at column x,
    with the ring buffer's `chunks`, computed as llama#fim computes it."""
    config = vim_dict(VIM_CONFIG, {})
    n_prefix, n_suffix = config["n_prefix"], config["n_suffix"]
    line_cur = lines[y - 1]
    local = {
        "prefix": "\n".join(lines[max(0, y - 1 - n_prefix):y - 1]) + "\n",
        "prompt": line_cur[:x],
        "suffix": line_cur[x:] + "\n" + "\n".join(lines[y:y + n_suffix]) + "\n",
        "extra_context": [{"text": c["str"], "time": c["time"], "filename": c["filename"]} for c in chunks],
        "indent": len(re.match(r"\s*", line_cur[:x]).group()),
    }
    return vim_dict(VIM_FIM_REQUEST, local, config)


def test_the_copied_vimscript_is_the_pinned_llama_vims():
    text = vendored("examples/llama.vim").decode()
    for block in (VIM_CONFIG, VIM_FIM_REQUEST, VIM_RING_REQUEST):
        assert block.strip("\n") in text


# llama.vscode v0.0.63 (github.com/ggml-org/llama.vscode, src/llama-server.ts,
# LlamaServer.createRequestPayload and defaultRequestParams), with its default settings
# (package.json: n_predict 128, t_max_prompt_ms 500, t_max_predict_ms 500,
# max_parallel_completions 3) and no LoRA or model name configured.
def vscode_body(input_prefix: str, input_suffix: str, chunks: list, prompt: str, nindent: int,
                no_predict: bool = False) -> dict:
    if no_predict:
        return {"id_slot": 0, "input_prefix": input_prefix, "input_suffix": input_suffix, "input_extra": chunks,
                "prompt": prompt, "n_predict": 0, "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 500,
                "t_max_predict_ms": 1}
    return {"id_slot": 0, "input_prefix": input_prefix, "input_suffix": input_suffix, "input_extra": chunks,
            "prompt": prompt, "n_predict": 128, "n_cmpl": 3,
            "top_k": 40, "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"],
            "cache_prompt": True, **({"n_indent": nindent} if nindent else {}),
            "t_max_prompt_ms": 500, "t_max_predict_ms": 500}


CODE = '''import math


def area(radius):
    """The area of a circle."""
    return math.pi * radius ** 2


def circumference(radius):
    """The circumference of a circle."""
    return 2 * math.pi * radius


def describe(radius):
    a = area(radius)
    c = circumference(radius)
    return f"r={radius}: area {a:.2f}, circumference {c:.2f}"
'''.split("\n")
CHUNKS = [{"str": "def volume(radius):\n    return 4 / 3 * math.pi * radius ** 3\n", "time": 1.0,
           "filename": "sphere.py"},
          {"str": "class Circle:\n    def __init__(self, radius):\n        self.radius = radius\n", "time": 2.0,
           "filename": "shapes.py"}]


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    s = start_server(model_path, tmp_path_factory.mktemp("serve-llama"), *SPEC, "--metrics",
                     model=str(model_path(QWEN_DRAFT)))
    yield s
    stop_server(s)


def post(server: Server, path: str, body: object, status: int = 200) -> object:
    got, _, answer = server.request("POST", path, body)
    assert got == status, answer
    return answer


def events(server: Server, path: str, body: dict) -> list[str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    lines = [line.decode().rstrip("\n") for line in resp if line.strip()]
    conn.close()
    return lines


def one_shot(model_path, prompt: str, n: int) -> dict:
    return speculate_json("-m", str(model_path(QWEN_DRAFT)), *SPEC, "-p", prompt, "--no-escape", "-n", str(n),
                          "--temp", "0", "--ignore-eos")


# -- the editors' requests ----------------------------------------------------------------


def test_llama_vims_fim_request(server):
    body = vim_fim_body(CODE, 16, len("    c = "), CHUNKS)
    assert set(body) == {"input_prefix", "input_suffix", "input_extra", "prompt", "n_predict", "n_indent", "top_k",
                         "top_p", "stream", "samplers", "cache_prompt", "t_max_prompt_ms", "t_max_predict_ms"}
    answer = post(server, "/infill", body)
    # what llama.vim reads of the answer
    assert isinstance(answer["content"], str) and isinstance(answer["tokens_cached"], int)
    assert answer["truncated"] is False and answer["generation_settings"]["n_ctx"] == 4096
    for key in ("prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms", "predicted_per_second"):
        assert isinstance(answer["timings"][key], (int, float)), key
    assert answer["generation_settings"]["samplers"] == ["top_k", "top_p", "infill"]
    assert 0 < answer["tokens_predicted"] <= 128 and answer["stop_type"] in ("eos", "limit")
    # the prompt holds the extra chunks, then the prefix, the prompt, the suffix
    prompt = answer["prompt"]
    at = [prompt.index(s) for s in (CHUNKS[0]["str"], CHUNKS[1]["str"], body["input_prefix"].strip(),
                                    body["input_suffix"].strip())]
    assert at == sorted(at)
    ring = vim_dict(VIM_RING_REQUEST, {"extra_context": body["input_extra"]})
    warm = post(server, "/infill", ring)
    assert warm["tokens_predicted"] == 1 and warm["stop_type"] == "limit"


def test_the_newer_llama_vims_request_with_response_fields(server):
    # github.com/ggml-org/llama.vim a1c8e6e, autoload/llama.vim, llama#fim's request (its
    # defaults: n_predict 128, stop_strings [], t_max_prompt_ms 500, t_max_predict_ms 1000)
    vim = vim_fim_body(CODE, 16, len("    c = "), CHUNKS)
    body = {"id_slot": 0, "input_prefix": vim["input_prefix"], "input_suffix": vim["input_suffix"],
            "input_extra": vim["input_extra"], "prompt": vim["prompt"], "n_predict": 128, "stop": [],
            "n_indent": vim["n_indent"], "top_k": 40, "top_p": 0.90, "samplers": ["top_k", "top_p", "infill"],
            "stream": False, "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000,
            "response_fields": ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
                                "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
                                "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated",
                                "tokens_cached"]}
    answer = post(server, "/infill", body)
    assert set(answer) == set(body["response_fields"])
    assert isinstance(answer["timings/prompt_n"], int) and isinstance(answer["content"], str)
    # its ring update: response_fields [""] asks for nothing
    warm = {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": vim["input_extra"], "prompt": "",
            "n_predict": 0, "temperature": 0.0, "samplers": [], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""]}
    assert post(server, "/infill", warm) == {}


def test_llama_vscodes_requests(server):
    lines, y, x = CODE, 16, len("    c = ")
    prefix = "\n".join(lines[:y - 1]) + "\n"
    suffix = lines[y - 1][x:] + "\n" + "\n".join(lines[y:]) + "\n"
    # llama.vscode's chunks (src/extra-context.ts): { text, time: Date.now(), filename }
    chunks = [{"text": c["str"], "time": 1733000000000, "filename": c["filename"]} for c in CHUNKS]
    answers = post(server, "/infill", vscode_body(prefix, suffix, chunks, lines[y - 1][:x], 4))
    # n_cmpl 3: a list of three answers, as llama-server sends (the plugin takes one answer or a list)
    assert [a["index"] for a in answers] == [0, 1, 2] and all(isinstance(a["content"], str) for a in answers)
    warm = post(server, "/infill", vscode_body("", "", chunks, "", 0, no_predict=True))
    # n_predict 0: one token, as llama-server, unless the one drawn (no samplers: a random draw) ends the answer
    assert warm["tokens_predicted"] == 1 or (warm["tokens_predicted"] == 0 and warm["stop_type"] == "eos"), warm


# -- identity with the one-shot command ----------------------------------------------------


def test_greedy_infill_is_the_one_shot_commands_output_on_its_prompt(server, model_path, batch_invariant):
    body = {"input_prefix": "def mean(values):\n", "input_suffix": "\n\nprint(mean([1, 2, 3]))\n",
            "prompt": "    ", "n_predict": 24, "temperature": 0, "ignore_eos": True,
            "input_extra": [{"filename": "util.py", "text": "def total(values):\n    return sum(values)\n"}]}
    answer = post(server, "/infill", body)
    cli = one_shot(model_path, answer["prompt"], 24)
    assert answer["tokens_evaluated"] == cli["n_prompt"]  # the prompt as text tokenizes back to the same tokens
    assert answer["content"] == cli["text"] and answer["tokens_predicted"] == 24
    assert answer["timings"]["draft_n"] == cli["n_drafted"]


def test_greedy_completion_is_the_one_shot_commands_output(server, model_path, batch_invariant):
    prompt = "def fibonacci(n):"
    cli = one_shot(model_path, prompt, 32)
    answer = post(server, "/completion", {"prompt": prompt, "n_predict": 32, "temperature": 0, "ignore_eos": True,
                                          "return_tokens": True})
    assert answer["content"] == cli["text"] and answer["tokens_predicted"] == 32 and len(answer["tokens"]) == 32
    assert answer["stop_type"] == "limit" and answer["tokens_evaluated"] == cli["n_prompt"]
    tokens = post(server, "/tokenize", {"content": prompt})["tokens"]
    as_tokens = post(server, "/completion", {"prompt": tokens, "n_predict": 32, "temperature": 0, "ignore_eos": True})
    assert as_tokens["content"] == cli["text"]
    assert post(server, "/detokenize", {"tokens": answer["tokens"]})["content"] == cli["text"]


def test_ngram_drafting_copies_from_the_suffix(server):
    """The FIM prompt holds the suffix, so the n-gram drafter drafts what the middle repeats of it."""
    line = "        subtotal += item.unit_price_in_cents * item.quantity_ordered_by_customer\n"
    body = {"input_prefix": "def order_total(items):\n    subtotal = 0\n    for item in items:\n",
            "input_suffix": "    return subtotal\n\n\ndef order_total_again(items):\n    subtotal = 0\n"
                            "    for item in items:\n" + line + "    return subtotal\n",
            "prompt": "        subtotal += item.unit", "n_predict": 24, "temperature": 0}
    answer = post(server, "/infill", body)
    assert line.strip() in answer["prompt"] and answer["tokens_evaluated"] > 40
    assert answer["timings"]["draft_n_accepted"] > 0, answer


# -- streaming, limits, small endpoints -----------------------------------------------------


def test_streamed_completion_is_the_whole_one_in_pieces_without_done(server):
    body = {"prompt": "def quicksort(arr):", "n_predict": 20, "temperature": 0, "ignore_eos": True}
    whole = post(server, "/completion", body)
    lines = events(server, "/completion", body)
    assert all(line.startswith("data: ") for line in lines) and "data: [DONE]" not in lines
    chunks = [json.loads(line[6:]) for line in lines]
    assert all(c["stop"] is False and c["tokens"] for c in chunks[:-1])
    assert "".join(c["content"] for c in chunks[:-1]) == whole["content"]
    assert sum(len(c["tokens"]) for c in chunks[:-1]) == 20
    last = chunks[-1]
    assert last["stop"] is True and last["content"] == "" and last["timings"]["predicted_n"] == 20


# The editors' line limits on a model whose text is forced, so that each limit must apply
# whatever this CPU's kernels do (a real model's lines are its own): write_chain_llama's tiny
# model, which after the prompt's "h" writes "\n i\n i\n i..." (a newline, a blank, "i").
CHAIN = {"h": "<0x0A>", "<0x0A>": "\u2581", "\u2581": "i", "i": "<0x0A>"}
CHAIN_PROMPT = [1, 6]  # <s> h
CHAIN_TEXT = "\n i" * 200


@pytest.fixture(scope="module")
def chain(model_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("chain")
    s = start_server(model_path, folder, "--spec-type", "none", "-t", "1", "-c", "1024",
                     model=str(write_chain_llama(folder / "chain.gguf", CHAIN)))
    yield s
    stop_server(s)


def test_context_shift_drops_older_tokens_and_the_answer_goes_on_past_the_context(model_path, tmp_path):
    """--context-shift, as llama-server's: at a full context of 64 tokens, what follows n_keep loses its
    older half and generation goes on, the drafters starting again from what is left; the chain
    model's next token depends on the last one only, so its 300 tokens are the chain's, drafted
    (its text repeats) or not, and the answer says it was truncated."""
    server = start_server(model_path, tmp_path, "--spec-type", "ngram-simple", "-t", "1", "-c", "64",
                          "--context-shift", model=str(write_chain_llama(tmp_path / "chain.gguf", CHAIN)))
    try:
        body = {"prompt": CHAIN_PROMPT, "n_predict": 300, "temperature": 0, "ignore_eos": True}
        for extra in ({}, {"n_keep": -1}, {"n_keep": 1, "n_discard": 8}, {"speculative.type": "none"}):
            answer = post(server, "/completion", {**body, **extra})
            assert answer["content"] == CHAIN_TEXT[:300] and answer["tokens_predicted"] == 300, extra
            assert answer["truncated"] is True and answer["stop_type"] == "limit", extra
            assert answer["generation_settings"]["n_keep"] == extra.get("n_keep", 0)
            drafted = answer["timings"].get("draft_n", 0)
            assert drafted == 0 if "speculative.type" in extra else drafted > 100, (extra, answer["timings"])
        within = post(server, "/completion", {**body, "n_predict": 20})
        assert within["truncated"] is False and within["content"] == CHAIN_TEXT[:20]  # no shift
    finally:
        stop_server(server)


def test_n_indent_ends_the_answer_at_a_line_indented_less(chain):
    """Lines of one blank: n_indent 1 lets them all through, n_indent 2 ends the answer where the
    first line after the first has its blank (kept) and then "i"."""
    body = {"prompt": CHAIN_PROMPT, "n_predict": 12, "temperature": 0, "ignore_eos": True}
    whole = post(chain, "/completion", body)
    assert whole["content"] == CHAIN_TEXT[:12] and whole["tokens_predicted"] == 12
    assert post(chain, "/completion", {**body, "n_indent": 1})["content"] == whole["content"]
    cut = post(chain, "/completion", {**body, "n_indent": 2})
    assert cut["content"] == "\n " and cut["stop_type"] == "limit" and cut["tokens_predicted"] == 3
    streamed = [json.loads(line[6:]) for line in events(chain, "/completion", {**body, "n_indent": 2})]
    assert "".join(c["content"] for c in streamed) == "\n " and streamed[-1]["stop_type"] == "limit"


def test_t_max_predict_ms_ends_the_answer_with_a_newline_once_the_time_is_up(chain):
    """1 ms: the answer ends with the first newline token after the time (when is this machine's
    business: the fake clock of test_llama_api checks which token), long before 600 tokens; an
    hour: all 600 tokens."""
    body = {"prompt": CHAIN_PROMPT, "n_predict": 600, "temperature": 0, "ignore_eos": True}
    timed = post(chain, "/completion", {**body, "t_max_predict_ms": 1})
    assert timed["stop_type"] == "limit" and timed["tokens_predicted"] < 600
    assert timed["content"].endswith("\n") and timed["content"] == CHAIN_TEXT[:timed["tokens_predicted"]]
    untimed = post(chain, "/completion", {**body, "t_max_predict_ms": 3_600_000})
    assert untimed["content"] == CHAIN_TEXT[:600] and untimed["stop_type"] == "limit"


def test_refused_fields_at_the_value_that_changes_nothing_change_nothing(chain):
    body = {"prompt": CHAIN_PROMPT, "n_predict": 6, "temperature": 0, "ignore_eos": True}
    plain = post(chain, "/completion", body)
    fields = {name: value for name, value in NEUTRAL_CASES}
    assert post(chain, "/completion", {**body, **fields})["content"] == plain["content"] == CHAIN_TEXT[:6]


def test_tokenize_detokenize_props_and_metrics(server):
    tokens = post(server, "/tokenize", {"content": "<|fim_prefix|>x = 1", "with_pieces": True})["tokens"]
    assert tokens[0]["piece"] == "<|fim_prefix|>" and "".join(t["piece"] for t in tokens) == "<|fim_prefix|>x = 1"
    plain = post(server, "/tokenize", {"content": "<|fim_prefix|>", "parse_special": False})["tokens"]
    assert len(plain) > 1  # as text, not the special token
    assert post(server, "/detokenize", {"tokens": [t["id"] for t in tokens]}) == {"content": "<|fim_prefix|>x = 1"}
    status, _, props = server.request("GET", "/props")
    assert status == 200 and props["total_slots"] == 4 and props["endpoint_metrics"] is True  # -np auto: 4
    assert props["endpoint_slots"] is True
    assert props["default_generation_settings"]["n_ctx"] == 4096 and props["model_path"].endswith(".gguf")
    assert props["chat_template"] and "llama-cpp-python" in props["build_info"]
    before = metrics(server)
    answer = post(server, "/completion", {"prompt": "x", "n_predict": 2, "temperature": 0, "ignore_eos": True})
    bias = answer["generation_settings"]["logit_bias"]  # llama-server's ignore_eos: -inf (null) on each EOG token
    assert bias and all(b["bias"] is None for b in bias)
    assert post(server, "/tokenize", {"content": "<|im_end|>"})["tokens"][0] in {b["token"] for b in bias}
    # a client that has its answer finds its slot idle (the answer goes out once the slot is free)
    assert not any(slot["is_processing"] for slot in server.request("GET", "/slots")[2])
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/plain")
    # spelt as llama-server sends it: llama.cpp's own tests look it up in a case-sensitive dict
    assert int(dict(resp.getheaders())["Process-Start-Time-Unix"]) <= time.time()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    for name in ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total", "llamacpp:requests_processing",
                 "llamacpp:requests_deferred", "llamacpp:spec_decode_num_draft_tokens_total",
                 "llamacpp:spec_decode_num_accepted_tokens_total", "speculate:requests_total",
                 "speculate:tokens_per_pass", "speculate:queue_length"):
        assert name in values, name
    assert int(values["speculate:requests_total"]) >= 1 and int(values["llamacpp:tokens_predicted_total"]) >= 2
    assert float(values["speculate:tokens_per_pass"]) >= 1.0
    # the target's decodes for this request alone: its prompt and steps, each decode one pass of it
    after = {name: float(value) for name, value in values.items()}
    grew = {name: after[name] - before[name] for name in ("llamacpp:n_decode_total", "speculate:target_passes_total")}
    assert grew["llamacpp:n_decode_total"] >= grew["speculate:target_passes_total"] >= 1
    assert float(values["llamacpp:n_busy_slots_per_decode"]) >= 1.0  # earlier tests' n_cmpl ran slots together
    assert int(values["llamacpp:requests_processing"]) == 0


@pytest.mark.parametrize("path, body, status, kind, message", [
    ("/completion", {"n_predict": 4}, 400, "invalid_request_error", '"prompt" is required'),
    ("/completion", {"prompt": "x", "n_predict": "4"}, 400, "invalid_request_error", "Field 'n_predict'"),
    ("/completion", {"prompt": [1, 10**9]}, 400, "invalid_request_error", "outside this model's vocabulary"),
    ("/completion", {"prompt": "hi " * 5000}, 400, "exceed_context_size_error", "the context holds 4096"),
    ("/completion", {"prompt": "x", "grammar": "root ::= x"}, 400, "invalid_request_error",
     "grammar: line 1, column 10: rule 'x' is used but never defined"),
    ("/completion", {"prompt": "x", "json_schema": {"properties": {"a": {"type": "nope"}}}}, 400,
     "invalid_request_error", "json schema at #/properties/a/type"),
    ("/infill", {"input_prefix": "a", "input_suffix": "b", "grammar": "root ::= ("}, 400, "invalid_request_error",
     "grammar: line 1, column 10"),
    ("/infill", {"input_suffix": ""}, 400, "invalid_request_error", '"input_prefix" is required'),
    ("/detokenize", {"tokens": [-1]}, 400, "invalid_request_error", "outside this model's vocabulary"),
    ("/tokenize", [1], 400, "invalid_request_error", "must be a JSON object"),
])
def test_bad_requests_get_llama_servers_error_object(server, path, body, status, kind, message):
    got, _, answer = server.request("POST", path, body)
    assert got == status, answer
    context = {"n_prompt_tokens", "n_ctx"} if kind == "exceed_context_size_error" else set()  # as llama-server's
    assert set(answer["error"]) == {"code", "message", "type"} | context and answer["error"]["code"] == status
    assert answer["error"]["type"] == kind and message in answer["error"]["message"], answer


def test_a_model_without_fim_tokens_gets_501_and_metrics_need_the_flag(model_path, tmp_path):
    server = start_server(model_path, tmp_path, "--spec-type", "none", "-t", "1", model=str(model_path(SMOL)))
    try:
        got, _, answer = server.request("POST", "/infill", {"input_prefix": "a", "input_suffix": "b"})
        assert got == 501 and answer["error"]["type"] == "not_supported_error", answer
        assert "Infill is not supported by this model" in answer["error"]["message"]
        got, _, answer = server.request("GET", "/metrics")
        assert got == 501 and "--metrics" in answer["error"]["message"]
        got, _, answer = server.request("POST", "/completion", {"prompt": "hi"}, key="wrong")
        assert got == 401 and answer["error"]["code"] == 401  # llama-server's error object on its paths
        assert server.request("GET", "/v1/health", key=None)[0] == 200
    finally:
        stop_server(server)
    assert "Traceback" not in server.log_text()


def test_a_request_cannot_ask_for_a_draft_model_the_server_has_not_loaded(chain):
    body = {"prompt": CHAIN_PROMPT, "n_predict": 2, "ignore_eos": True}
    answer = post(chain, "/completion", {**body, "speculative.type": "draft"}, status=400)
    assert answer["error"]["code"] == 400
    assert "speculative.type: draft needs a draft model, which this server has not loaded" in answer["error"]["message"]
    ngram = post(chain, "/completion", {**body, "speculative.type": ["ngram-simple"], "speculative.n_max": 3})
    assert ngram["tokens_predicted"] == 2
