"""OpenAI's Responses API through `speculate serve`, with the official openai client, on the
default target (Qwen2.5-Coder 1.5B) at --temp 0: a response is the chat answer of the same
request, with speculation and without; its stream assembles into it (raw, and through the SDK's
stream helper), with llama-server's telemetry when asked; a function call and its output round
trip; token counting; bad requests as llama-server's 400s. Reasoning: SmolLM2 through a template
that opens the thinking block, as tests/test_serve_tools.py has it."""

from __future__ import annotations

import http.client
import json

import openai
import pytest

from tests import test_serve_tools
from tests.test_serve import KEY

pytestmark = pytest.mark.real

# the chat tests' tools, in Responses' flat shape
WEATHER, READ_FILE = ({"type": "function", **tool["function"]} for tool in (test_serve_tools.WEATHER,
                                                                             test_serve_tools.READ_FILE))
ASK = test_serve_tools.ASK[0]["content"]
POEM = [{"role": "system", "content": "You are a poet."}, {"role": "user", "content": "Write four lines about the sea."}]
qwen = test_serve_tools.qwen  # the default target, --temp 0, one slot
thinker = test_serve_tools.thinker  # SmolLM2 through a template that opens the thinking block


def respond(server, **body):
    return server.client().responses.create(model="any", **{"max_output_tokens": 48, **body})


def events_of(server, **body) -> list:
    """A streamed response's events, as the SDK reads them."""
    return list(server.client().responses.create(model="any", stream=True, **{"max_output_tokens": 48, **body}))


def sse(server, body: dict) -> list[tuple[str, dict]]:
    """A raw stream of POST /v1/responses: each event's name and data."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request("POST", "/v1/responses", body=json.dumps(body),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
        out = []
        for block in resp.read().decode().split("\n\n"):
            if block.strip():
                name, data = block.split("\n")
                out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
        return out
    finally:
        conn.close()


def test_a_response_is_the_chat_answer_of_the_same_request(qwen, batch_invariant):
    res = respond(qwen, instructions=POEM[0]["content"], input=POEM[1]["content"])
    assert res.id.startswith("resp_") and res.status == "completed" and res.object == "response"
    (message,) = res.output
    assert message.id.startswith("msg_") and message.type == "message" and res.output_text
    chat = qwen.client().chat.completions.create(model="any", messages=POEM, max_tokens=48)
    assert res.output_text == chat.choices[0].message.content
    assert (res.usage.input_tokens, res.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert res.usage.total_tokens == res.usage.input_tokens + res.usage.output_tokens
    again = respond(qwen, input=POEM)  # the same conversation as items: the cache holds its prompt
    assert again.output_text == res.output_text and again.usage.input_tokens_details.cached_tokens > 0
    assert respond(qwen, input=POEM, extra_body={"speculative.type": "none"}).output_text == res.output_text


def test_a_streamed_response_assembles_into_the_whole_one(qwen, batch_invariant):
    whole = respond(qwen, input=POEM)
    events = events_of(qwen, input=POEM)
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    completed = events[-1]
    assert completed.type == "response.completed" and completed.response.id == events[0].response.id
    (added,) = [e.item for e in events if e.type == "response.output_item.added"]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and {e.item_id for e in deltas} == {added.id} and added.id.startswith("msg_")
    assert "".join(e.delta for e in deltas) == completed.response.output_text == whole.output_text
    assert completed.response.usage.output_tokens == whole.usage.output_tokens
    timings = completed.timings  # beside the response, as llama-server's
    assert timings["predicted_n"] == whole.usage.output_tokens and {"draft_n", "draft_n_accepted"} <= set(timings)
    with qwen.client().responses.stream(model="any", input=POEM, max_output_tokens=48) as helper:
        text = "".join(e.delta for e in helper if e.type == "response.output_text.delta")
        assert text == helper.get_final_response().output_text == whole.output_text


def test_llama_servers_telemetry_progress_and_timings_per_token(qwen):
    """llama.cpp's test_responses_stream_with_llama_telemetry, on this server."""
    events = sse(qwen, {"input": "This is a test" * 10, "max_output_tokens": 8, "temperature": 0.8, "stream": True,
                        "timings_per_token": True, "return_progress": True})
    assert all(name == data["type"] for name, data in events)
    progress = [data for _, data in events if "prompt_progress" in data]
    assert progress and all(d["type"] == "response.in_progress" for d in progress)
    for d in progress:
        assert d["prompt_progress"]["total"] > 0 and d["prompt_progress"]["processed"] >= d["prompt_progress"]["cache"]
    assert progress[-1]["prompt_progress"]["processed"] == progress[-1]["prompt_progress"]["total"]
    timed = [d for _, d in events if "timings" in d]
    assert any(d["type"] == "response.output_text.delta" for d in timed)
    assert all({"prompt_per_second", "predicted_per_second"} <= set(d["timings"]) for d in timed)
    predicted = [d["timings"]["predicted_n"] for d in timed]
    assert predicted == sorted(predicted)  # the counts so far, growing
    completed = events[-1][1]
    assert completed["type"] == "response.completed" and "usage" in completed["response"] and "timings" in completed
    assert completed["timings"]["predicted_n"] == completed["response"]["usage"]["output_tokens"]


def test_a_function_call_and_its_output_round_trip(qwen):
    first = respond(qwen, input=ASK, tools=[WEATHER, READ_FILE], tool_choice="required")
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    history = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 degrees celsius."}]
    second = respond(qwen, input=history, tools=[WEATHER, READ_FILE], tool_choice="none")
    assert second.output_text and all(item.type == "message" for item in second.output)
    # the template rendered the call and its result: the second prompt holds the first's and more
    assert second.usage.input_tokens > first.usage.input_tokens + 10
    named = respond(qwen, input=ASK, tools=[WEATHER, READ_FILE], tool_choice={"type": "function", "name": "read_file"})
    assert [(item.type, item.name) for item in named.output] == [("function_call", "read_file")]


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_greedy_calls_are_the_same_with_and_without_speculation(qwen, batch_invariant, choice):
    body = dict(input=ASK, tools=[WEATHER, READ_FILE], tool_choice=choice, max_output_tokens=96)
    target_only = events_of(qwen, extra_body={"speculative.type": "none"}, **body)[-1]
    speculated = events_of(qwen, **body)[-1]  # the server's auto
    assert target_only.timings["draft_n"] == 0
    one, other = target_only.response, speculated.response
    assert one.output_text == other.output_text  # the calls' ids are each answer's own
    assert [(i.name, i.arguments) for i in one.output if i.type == "function_call"] == \
        [(i.name, i.arguments) for i in other.output if i.type == "function_call"]
    if choice == "required":  # the call's forced text at least was drafted
        assert speculated.timings["draft_n"] > 0
        assert [i.type for i in other.output] == ["function_call"]


def test_input_tokens_count_the_prompt_a_response_would_read(qwen):
    counted = qwen.client().responses.input_tokens.count(model="any", input=POEM[1]["content"],
                                                         instructions=POEM[0]["content"])
    assert counted.object == "response.input_tokens"
    assert counted.input_tokens == respond(qwen, input=POEM, max_output_tokens=1).usage.input_tokens
    status, _, body = qwen.request("POST", "/responses/input_tokens", {"input": "Hello world"})  # test_sleep's
    assert status == 200 and body["input_tokens"] > 0
    assert body["input_tokens"] == qwen.client().responses.input_tokens.count(input="Hello world").input_tokens


@pytest.mark.parametrize("body, message", [
    ({"input": "x", "previous_response_id": "resp_123"}, "llama.cpp does not support 'previous_response_id'."),
    ({"input": [{"type": "computer_call", "id": "x"}]}, "Cannot determine type of 'item'"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio", "data": ""}]}]},
     "'type' must be one of 'input_text', 'input_image', or 'input_file'"),
    ({"input": "x", "stream": True, "tool_choice": "required"}, "required"),
])
def test_bad_requests_are_llama_servers_400s_and_the_server_goes_on(qwen, body, message):
    status, _, answer = qwen.request("POST", "/v1/responses", body)
    assert status == 400 and answer["error"]["code"] == 400 and answer["error"]["type"] == "invalid_request_error"
    assert message in answer["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        qwen.client().responses.create(model="any", **body)
    status, _, answer = qwen.request("POST", "/v1/responses", raw=b'{"input": ')
    assert status == 400 and answer["error"]["code"] == 400
    assert qwen.request("GET", "/health", key=None)[0] == 200


def test_thinking_is_a_reasoning_item_streamed_as_reasoning_deltas(thinker):
    body = dict(input="Why is the sky blue?", max_output_tokens=8)
    (whole,) = thinker.client().responses.create(model="any", **body).output
    assert whole.type == "reasoning" and whole.id.startswith("rs_")
    events = list(thinker.client().responses.create(model="any", stream=True, **body))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    (done,) = events[-1].response.output
    assert deltas == done.content[0].text == whole.content[0].text and deltas
