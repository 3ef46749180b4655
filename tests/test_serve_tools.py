"""Tool calls and reasoning through `speculate serve`, with the official openai client, on the
default target (Qwen2.5-Coder 1.5B, whose template renders tools and whose calls are Hermes'
`<tool_call>` JSON): a round trip (call, tool result, answer), streamed calls assembled as a
client assembles them, the grammar holding every call to its tool's schema, greedy answers the
same with and without speculation, and the bad requests a client can send. Reasoning: a
template that opens the thinking block, so what the model writes is thinking until it closes it.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import QWEN
from tests.test_serve import start_server, stop_server

pytestmark = pytest.mark.real

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "The text of a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today? Use the tool."}]


@pytest.fixture(scope="module")
def qwen(model_path, tmp_path_factory):
    s = start_server(model_path, tmp_path_factory.mktemp("tools"), "-c", "4096", "-np", "1", "--temp", "0",
                     model=str(model_path(QWEN)))
    yield s
    stop_server(s)


def chat(server, **body):
    return server.client().chat.completions.create(model="any", max_tokens=96, **body)


def assert_fits_weather(call) -> dict:
    assert call.type == "function" and call.function.name == "get_weather"
    assert len(call.id) >= 8
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and isinstance(arguments["city"], str)
    assert arguments["unit"] in ("celsius", "fahrenheit")
    return arguments


def test_a_round_trip_call_result_answer(qwen):
    first = chat(qwen, messages=ASK, tools=[WEATHER, READ_FILE], tool_choice="required")
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert_fits_weather(call)
    assert not choice.message.content
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees celsius."}]
    second = chat(qwen, messages=history, tools=[WEATHER, READ_FILE], tool_choice="none")
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    # the template rendered the call and its result: the second prompt holds the first's and more
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10


def test_a_streamed_call_assembles_into_the_whole_answers_call(qwen):
    body = dict(messages=ASK, tools=[WEATHER], tool_choice="required")
    whole = chat(qwen, **body).choices[0]
    name, arguments, ids, finish, content = "", "", set(), None, ""
    for chunk in chat(qwen, stream=True, **body):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            assert call.index == 0
            ids.add(call.id) if call.id else None
            name += (call.function.name or "") if call.function else ""
            arguments += (call.function.arguments or "") if call.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert len(ids) == 1
    (call,) = whole.message.tool_calls
    assert (name, json.loads(arguments)) == (call.function.name, json.loads(call.function.arguments))


def test_a_named_function_is_the_one_called(qwen):
    choice = chat(qwen, messages=ASK, tools=[WEATHER, READ_FILE],
                  tool_choice={"type": "function", "function": {"name": "read_file"}}).choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "read_file" and set(json.loads(call.function.arguments)) == {"path"}


def test_greedy_calls_are_the_same_with_and_without_speculation(qwen, batch_invariant):
    body = dict(messages=ASK, tools=[WEATHER, READ_FILE], tool_choice="auto")
    target_only = chat(qwen, extra_body={"speculative.type": "none"}, **body)
    speculated = chat(qwen, **body)  # the server's auto
    assert speculated.to_dict()["timings"]["draft_n"] > 0  # the call's forced text at least was drafted
    one, other = target_only.choices[0].message, speculated.choices[0].message
    assert one.content == other.content  # the calls' ids are each answer's own
    assert [(c.function.name, c.function.arguments) for c in one.tool_calls or []] == \
        [(c.function.name, c.function.arguments) for c in other.tool_calls or []]


@pytest.mark.parametrize("body, message", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                             "properties": {"x": {"type": 7}}}}}]},
     "f"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tool_choice": "required"}, "required"),
    ({"tools": [WEATHER], "grammar": "root ::= \"x\""}, "Cannot use custom grammar constraints with tools."),
    ({"tools": [{"type": "function"}]}, "function"),
    ({"messages": [*ASK, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]},
     "Cannot have 2 or more assistant messages at the end of the list."),
    ({"messages": [{"role": "user"}]}, "All non-assistant messages must contain 'content'"),
])
def test_bad_tool_requests_are_400s_and_the_server_goes_on(qwen, body, message):
    status, _, answer = qwen.request("POST", "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **body})
    assert status == 400, answer
    assert message in answer["error"]["message"]
    assert qwen.request("GET", "/health", key=None)[0] == 200


THINKING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "<|im_start|>assistant\n<think>\n")


@pytest.fixture(scope="module")
def thinker(model_path, tmp_path_factory):
    """SmolLM2 through a template that opens the thinking block: all it writes is thinking."""
    where = tmp_path_factory.mktemp("think")
    (where / "think.jinja").write_text(THINKING)
    s = start_server(model_path, where, "--temp", "0", "--ignore-eos", "--chat-template-file",
                     str(where / "think.jinja"))
    yield s
    stop_server(s)


def test_thinking_goes_to_reasoning_content_unless_reasoning_format_none(thinker):
    body = {"messages": [{"role": "user", "content": "Why is the sky blue?"}], "max_tokens": 8}
    status, _, split = thinker.request("POST", "/v1/chat/completions", body)
    assert status == 200, split
    message = split["choices"][0]["message"]
    assert message["reasoning_content"] and not message["content"]
    status, _, plain = thinker.request("POST", "/v1/chat/completions", {**body, "reasoning_format": "none"})
    content = plain["choices"][0]["message"]["content"]  # the opened tag written back, as llama.cpp's none
    assert content.startswith("<think>") and content.endswith(message["reasoning_content"])
    assert "reasoning_content" not in plain["choices"][0]["message"]


def test_streamed_thinking_comes_as_reasoning_content_deltas(thinker):
    body = {"messages": [{"role": "user", "content": "Why is the sky blue?"}], "max_tokens": 8}
    whole = thinker.request("POST", "/v1/chat/completions", body)[2]["choices"][0]["message"]
    stream = thinker.client().chat.completions.create(model="any", stream=True, **body)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in stream)
    assert reasoning == whole["reasoning_content"]


def test_a_reasoning_budget_ends_the_thinking_and_the_answer_goes_on(thinker):
    body = {"messages": [{"role": "user", "content": "Why is the sky blue?"}], "max_tokens": 24}
    free = thinker.request("POST", "/v1/chat/completions", body)[2]["choices"][0]["message"]
    assert not free["content"]  # without a budget, 24 tokens of thinking (--ignore-eos)
    status, _, cut = thinker.request("POST", "/v1/chat/completions", {**body, "reasoning_budget_tokens": 6})
    assert status == 200, cut
    message, usage = cut["choices"][0]["message"], cut["usage"]
    # the same greedy thinking, cut short (checked after each step), then the answer after </think>
    assert free["reasoning_content"].startswith(message["reasoning_content"].rstrip())
    assert len(message["reasoning_content"]) < len(free["reasoning_content"])
    assert message["content"] and usage["completion_tokens"] == 24
    assert cut["choices"][0]["finish_reason"] == "length"
