"""Anthropic's Messages API through `speculate serve`, with Anthropic's own Python SDK (which
sends the key as X-Api-Key), on the default target (Qwen2.5-Coder 1.5B): a message, its stream
assembled as the SDK assembles it, a tool call and its result sent back, token counting, and
greedy answers the same as /v1/chat/completions' for the same conversation, with and without
speculation. tests/test_anthropic_api.py has the translation without a model."""

from __future__ import annotations

import anthropic
import pytest

from tests import test_serve_tools
from tests.test_serve import KEY

pytestmark = pytest.mark.real

qwen = test_serve_tools.qwen  # the default target, greedy, one slot (a server of this module's own)
ASK = [{"role": "user", "content": "Name three primary colours, one per line."}]
SYSTEM = "You are a terse assistant."
_WEATHER = test_serve_tools.WEATHER["function"]
WEATHER = {"name": _WEATHER["name"], "description": _WEATHER["description"], "input_schema": _WEATHER["parameters"]}
WEATHER_ASK = test_serve_tools.ASK
# an answer that copies the prompt: what auto's n-gram drafters draft
COPY = [{"role": "user", "content": "Repeat this code exactly, nothing else:\n\ndef add(a, b):\n    return a + b\n\n"
                                    "def sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n"}]


def client(server, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=300)


def create(server, max_tokens: int = 48, **body):
    return client(server).messages.create(model="any", max_tokens=max_tokens, **body)


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_a_message_with_its_usage_and_no_timings(qwen):
    raw = client(qwen).messages.with_raw_response.create(model="any", max_tokens=48, system=SYSTEM, messages=ASK)
    body = raw.http_response.json()
    assert "timings" not in body
    message = raw.parse()
    assert message.type == "message" and message.role == "assistant" and message.id
    assert [block.type for block in message.content] == ["text"] and text_of(message)
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens > 0 and usage.output_tokens > 0
    if message.stop_reason == "max_tokens":
        assert usage.output_tokens == 48


def test_the_stream_assembles_into_the_whole_greedy_answer(qwen):
    whole = create(qwen, system=SYSTEM, messages=ASK)
    with client(qwen).messages.stream(model="any", max_tokens=48, system=SYSTEM, messages=ASK) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == text_of(final) == text_of(whole)
    assert (final.stop_reason, final.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
    assert final.usage.output_tokens == whole.usage.output_tokens
    # the prompt in full either way; how much the cache held differs (the second run reuses the first)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert final.usage.cache_read_input_tokens > 0


def test_a_stop_sequence_ends_the_answer_and_is_named(qwen):
    whole = create(qwen, system=SYSTEM, messages=ASK)
    lines = text_of(whole).split("\n")
    if len(lines) < 2:
        pytest.skip("the answer has one line: nothing to stop at")
    stopped = create(qwen, system=SYSTEM, messages=ASK, stop_sequences=["\n"])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("end_turn", "\n")
    assert text_of(stopped) == lines[0]


def test_a_tool_call_and_its_result_round_trip(qwen):
    first = create(qwen, messages=WEATHER_ASK, tools=[WEATHER], tool_choice={"type": "any"})
    assert first.stop_reason == "tool_use"
    (call,) = [block for block in first.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.id
    assert set(call.input) == {"city", "unit"} and call.input["unit"] in ("celsius", "fahrenheit")
    history = [*WEATHER_ASK, {"role": "assistant", "content": [block.model_dump() for block in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": [{"type": "text", "text": "Sunny, 21 degrees celsius."}]}]}]
    second = create(qwen, messages=history, tools=[WEATHER], tool_choice={"type": "none"})
    assert second.stop_reason in ("end_turn", "max_tokens") and text_of(second)
    assert not [block for block in second.content if block.type == "tool_use"]
    # the template rendered the call and its result: the second prompt holds the first's and more
    counted = [client(qwen).messages.count_tokens(model="any", messages=m, tools=[WEATHER]).input_tokens
               for m in (WEATHER_ASK, history)]
    assert counted[1] > counted[0] + 10


def test_a_streamed_tool_call_assembles_into_the_whole_answers_call(qwen):
    body = dict(messages=WEATHER_ASK, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    whole = create(qwen, **body)
    with client(qwen).messages.stream(model="any", max_tokens=48, **body) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == whole.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in final.content] == \
        [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in whole.content]
    starts = [e.index for e in events if e.type == "content_block_start"]
    stops = [e.index for e in events if e.type == "content_block_stop"]
    assert starts == stops == list(range(len(final.content)))
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)


def test_count_tokens_is_the_prompt_the_answer_reads(qwen):
    counted = client(qwen).messages.count_tokens(model="any", system=SYSTEM, messages=ASK)
    assert counted.input_tokens > 0
    answer = create(qwen, system=SYSTEM, messages=ASK, max_tokens=1)
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == counted.input_tokens
    chat = qwen.client().chat.completions.create(model="any", max_tokens=1,
                                                 messages=[{"role": "system", "content": SYSTEM}, *ASK])
    assert chat.usage.prompt_tokens == counted.input_tokens


def test_greedy_text_is_the_chat_endpoints_with_and_without_speculation(qwen, batch_invariant):
    message = create(qwen, system=SYSTEM, messages=COPY)  # the server's auto
    messages = [{"role": "system", "content": SYSTEM}, *COPY]
    speculated = qwen.client().chat.completions.create(model="any", max_tokens=48, messages=messages)
    assert speculated.to_dict()["timings"]["draft_n"] > 0  # auto drafted on this conversation
    target_only = qwen.client().chat.completions.create(model="any", max_tokens=48, messages=messages,
                                                        extra_body={"speculative.type": "none"})
    assert target_only.to_dict()["timings"]["draft_n"] == 0
    assert text_of(message) == speculated.choices[0].message.content == target_only.choices[0].message.content
    assert message.usage.output_tokens == speculated.usage.completion_tokens


def test_bad_requests_are_refused_and_the_server_goes_on(qwen):
    with pytest.raises(anthropic.BadRequestError, match="not supported"):
        create(qwen, messages=[{"role": "user", "content": [{"type": "document", "source": {
            "type": "text", "media_type": "text/plain", "data": "x"}}]}])
    with pytest.raises(anthropic.InternalServerError, match="image input is not supported"):
        create(qwen, messages=[{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    with pytest.raises(anthropic.AuthenticationError):
        client(qwen, key="wrong").messages.count_tokens(model="any", messages=ASK)
    assert create(qwen, messages=ASK, max_tokens=2).usage.output_tokens > 0
