"""serving/anthropic_api.py without a model: Anthropic's Messages bodies as the OpenAI chat bodies
the pinned llama-server converts them to (server_chat_convert_anthropic_to_oai), read by
openai_api.parse; Reply's answers and chunks as Anthropic's message and events (to_json_anthropic,
to_json_anthropic_stream); bad bodies refused with a 4xx (an image with llama-server's 500); and
the two routes on the app with a stand-in worker, X-Api-Key included. tests/test_serve_anthropic.py
has the real model and Anthropic's SDK."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from speculative.decoding.stats import Stats
from speculative.engine.stream import Final, Piece
from speculative.serving import openai_api
from speculative.serving.anthropic_api import Events, message, to_openai
from speculative.serving.generation import ApiError
from speculative.serving.openai_api import Reply
from tests.test_serve_access import KEY, StandInEngine, app, call

TEMPLATES = Path(__file__).resolve().parent / "data" / "templates"
QWEN25 = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
QWEN3 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
USER = {"role": "user", "content": "What's the weather?"}
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALLED = {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                           {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                            "input": {"city": "Paris"}}]}


# -- requests -------------------------------------------------------------------


def test_the_system_prompt_becomes_the_first_message_from_a_string_or_text_blocks():
    assert to_openai({"system": "Be brief.", "messages": [USER]})["messages"] == [
        {"role": "system", "content": "Be brief."}, USER]
    blocks = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief.", "cache_control": {"type": "ephemeral"}}]
    assert to_openai({"system": blocks, "messages": [USER]})["messages"][0] == {"role": "system", "content": "Be brief."}
    assert to_openai({"system": None, "messages": [USER]})["messages"] == [USER]


def test_claude_codes_billing_stamp_is_fixed_so_the_prompt_cache_reaches_past_it():
    stamped = "x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=a5145;You are Claude Code."
    system = to_openai({"system": stamped, "messages": []})["messages"][0]["content"]
    assert system == stamped.replace("cch=a5145;", "cch=fffff;")
    for other in ("cch=a5145; not a billing line", "x-anthropic-billing-header: cch=a51;"):  # left as they are
        assert to_openai({"system": other, "messages": []})["messages"][0]["content"] == other


def test_text_blocks_stay_text_parts_which_the_chat_endpoint_joins():
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": " the answer?"}]
    body = to_openai({"messages": [{"role": "user", "content": parts}]})
    assert body["messages"] == [{"role": "user", "content": parts}]
    assert openai_api.parse(body, True).messages == [{"role": "user", "content": "What is\n the answer?"}]


def test_tool_use_becomes_the_assistants_tool_calls_and_tool_result_a_tool_message():
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}]}
    messages = to_openai({"messages": [USER, CALLED, result]})["messages"]
    assert messages[1:] == [
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}],
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"}]
    only_calls = {"role": "assistant", "content": CALLED["content"][1:]}
    assert to_openai({"messages": [only_calls]})["messages"][0]["content"] == ""


def test_tool_results_in_blocks_or_none_and_with_text_are_split_as_llama_server_splits_them():
    results = {"role": "user", "content": [
        {"type": "text", "text": "Here are the results:"},
        {"type": "tool_result", "tool_use_id": "a", "content": [{"type": "text", "text": "Sun"},
                                                                 {"type": "text", "text": "ny"}]},
        {"type": "tool_result", "tool_use_id": "b", "is_error": True, "content": "City not found"},
        {"type": "tool_result", "tool_use_id": "c"}]}
    assert to_openai({"messages": [results]})["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Here are the results:"}]},  # the text first
        {"role": "tool", "tool_call_id": "a", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "City not found"},
        {"role": "tool", "tool_call_id": "c", "content": ""}]


def test_thinking_becomes_reasoning_content_and_redacted_thinking_is_dropped():
    thought = {"role": "assistant", "content": [{"type": "thinking", "thinking": "Paris first.", "signature": "x"},
                                                {"type": "redacted_thinking", "data": "opaque"},
                                                *CALLED["content"][1:]]}
    assistant = to_openai({"messages": [USER, thought]})["messages"][1]
    assert assistant["reasoning_content"] == "Paris first." and assistant["content"] == ""
    assert to_openai({"messages": [{"role": "assistant", "content": [{"type": "redacted_thinking"}]}]}) == {
        "messages": [], "max_tokens": 4096}
    assert to_openai({"messages": [{"role": "assistant"}]})["messages"] == []  # an assistant's without content


def test_the_rest_of_the_body_maps_to_openais_fields():
    body = to_openai({"messages": [USER], "max_tokens": 7, "stop_sequences": ["\n", "END"], "temperature": 0.5,
                      "top_p": 0.9, "top_k": 40, "stream": True, "metadata": {"user_id": "u"},
                      "thinking": {"type": "enabled", "budget_tokens": 50}, "tools": [WEATHER]})
    assert body == {"messages": [USER], "max_tokens": 7, "stop": ["\n", "END"], "temperature": 0.5, "top_p": 0.9,
                    "top_k": 40, "stream": True, "stream_options": {"include_usage": True},
                    "thinking_budget_tokens": 50,
                    "tools": [{"type": "function", "function": {"name": "get_weather",
                                                                "description": "The weather in a city",
                                                                "parameters": WEATHER["input_schema"]}}]}
    generation = openai_api.parse(body, True, template=QWEN25, no_messages=True)
    assert generation.stops == ("\n", "END") and generation.max_tokens == 7 and generation.reasoning_budget == 50
    assert (generation.sampling.temp, generation.sampling.top_k, generation.sampling.top_p) == (0.5, 40, 0.9)
    assert generation.tools[0]["function"]["parameters"] == WEATHER["input_schema"]
    assert to_openai({"messages": [], "thinking": {"type": "enabled"}})["thinking_budget_tokens"] == 10000
    assert "thinking_budget_tokens" not in to_openai({"messages": [], "thinking": {"type": "disabled"}})
    assert "stream_options" not in to_openai({"messages": [], "stream": False})


@pytest.mark.parametrize("choice, fields", [
    ({"type": "auto"}, {"tool_choice": "auto"}),
    ({"type": "any"}, {"tool_choice": "required"}),
    ({"type": "none"}, {"tool_choice": "none"}),
    ({"type": "tool", "name": "get_weather"}, {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    ({"type": "any", "disable_parallel_tool_use": True}, {"tool_choice": "required", "parallel_tool_calls": False}),
    ({"type": "auto", "disable_parallel_tool_use": False}, {"tool_choice": "auto"}),
])
def test_tool_choice_becomes_openais(choice, fields):
    body = to_openai({"messages": [USER], "tools": [WEATHER], "tool_choice": choice})
    assert {k: body[k] for k in ("tool_choice", "parallel_tool_calls") if k in body} == fields
    plan = openai_api.parse(body, True, template=QWEN25).plan  # a choice the chat endpoint honours
    assert (plan.grammar is None) == (choice["type"] == "none")


def test_no_messages_is_a_conversation_here_but_not_on_the_chat_endpoint():
    body = to_openai({"messages": []})
    assert openai_api.parse(body, True, no_messages=True).messages == []
    with pytest.raises(ApiError, match="messages"):
        openai_api.parse(body, True)


@pytest.mark.parametrize("body, status, message", [
    ([], 400, "must be a JSON object"),
    ({"max_tokens": 5}, 400, "'messages' is required"),
    ({"messages": "hi"}, 400, "Expected 'messages' to be an array"),
    ({"messages": ["hi"]}, 400, "messages.0: a message must be an object"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, 400, "messages.0.content.0: a content block must be an object"),
    ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, 400, 'type "document" are not supported'),
    ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, 400, "type null are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400, "content.0.text: must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]},
     500, "image input is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": [
        {"type": "text", "text": "File:"}, {"type": "image", "source": {}}]}]}]}, 500, "image input is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": 5}]}]}, 400,
     "content.0.content: must be a string or a list of blocks"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": "x"}]}]}, 400,
     "content.0.input: must be an object"),
    ({"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": ["x"]}]}]}, 400,
     "content.0.thinking: must be a string"),
    ({"system": 5, "messages": []}, 400, "system: must be a string or a list of text blocks"),
    ({"system": [{"type": "image"}], "messages": []}, 400, "system.0: only text blocks"),
    ({"messages": [], "tools": {"name": "f"}}, 400, "tools: must be a list"),
    ({"messages": [], "tools": ["f"]}, 400, "tools.0: a tool must be an object"),
    ({"messages": [], "tool_choice": "auto"}, 400, "tool_choice: must be an object"),
    ({"messages": [], "tool_choice": {"type": "tool"}}, 400, "tool_choice.name"),
    ({"messages": [], "tool_choice": {"type": "auto", "disable_parallel_tool_use": 1}}, 400, "must be a boolean"),
    ({"messages": [], "thinking": True}, 400, "thinking: must be an object"),
])
def test_a_body_that_cannot_be_read_is_refused_before_anything_runs(body, status, message):
    with pytest.raises(ApiError) as refused:
        to_openai(body)
    assert refused.value.status == status and message in refused.value.message


@pytest.mark.parametrize("body, message", [
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user"}]}, "must contain 'content'"),
    ({"messages": [USER], "max_tokens": "5"}, "max_tokens"),
    ({"messages": [USER], "tools": [{"description": "no name"}]}, "tools.0.function.name"),
    ({"messages": [USER, CALLED]}, "Cannot continue an assistant message that contains tool calls"),
    ({"messages": [USER], "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "other"}}, "other"),
])
def test_what_the_chat_endpoint_refuses_it_refuses_here_too(body, message):
    with pytest.raises(ApiError) as refused:
        openai_api.parse(to_openai(body), True, template=QWEN25, no_messages=True)
    assert refused.value.status == 400 and message in refused.value.message


# -- answers --------------------------------------------------------------------

STATS = Stats(n_prompt=20, n_cached=15, n_predict=7)
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def reply_of(body: dict, template: str) -> Reply:
    return Reply("model-x", openai_api.parse(to_openai(body), True, template=template, no_messages=True))


def test_a_whole_answer_is_a_message_without_timings():
    answer = message(reply_of({"messages": [USER]}, "").full(final("Sunny.", "stop")), "")
    assert answer["id"].startswith("chatcmpl-") and answer["model"] == "model-x"
    assert {k: v for k, v in answer.items() if k not in ("id", "model")} == {
        "type": "message", "role": "assistant", "content": [{"type": "text", "text": "Sunny."}],
        "stop_reason": "end_turn", "stop_sequence": None,
        "usage": {"cache_read_input_tokens": 15, "input_tokens": 5, "output_tokens": 7}}
    assert message(reply_of({"messages": [USER]}, "").full(final("Sun", "length")))["stop_reason"] == "max_tokens"
    stopped = message(reply_of({"messages": [USER]}, "").full(final("Sun", "stop")), "END")
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("end_turn", "END")
    assert message(reply_of({"messages": [USER]}, "").full(final("", "stop")))["content"] == []


def test_reasoning_and_tool_calls_become_thinking_and_tool_use_blocks_in_that_order():
    body = {"messages": [USER], "tools": [WEATHER]}
    answer = message(reply_of(body, QWEN25).full(final("Let me look.\n" + CALL_TEXT, "stop")))
    assert answer["stop_reason"] == "tool_use"
    text, call = answer["content"]
    assert text["type"] == "text" and text["text"].strip() == "Let me look."
    assert call["type"] == "tool_use" and call["name"] == "get_weather" and call["input"] == {"city": "Paris"}
    assert len(call["id"]) > 0
    thought = message(reply_of({"messages": [USER]}, QWEN3).full(final("<think>\nSun?\n</think>\n\nSunny.", "stop")))
    assert thought["content"] == [{"type": "thinking", "thinking": "Sun?", "signature": ""},
                                  {"type": "text", "text": "Sunny."}]


def test_a_calls_arguments_that_are_not_json_are_an_empty_input():
    answer = {"id": "x", "model": "m", "usage": {"prompt_tokens": 3, "completion_tokens": 1,
                                                 "prompt_tokens_details": {"cached_tokens": 0}},
              "choices": [{"finish_reason": "tool_calls", "message": {"content": None, "tool_calls": [
                  {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}}]}
    assert message(answer)["content"] == [{"type": "tool_use", "id": "c", "name": "f", "input": {}}]


def final(text: str, reason: str) -> Final:
    """A run's end as the worker gives it, with STATS."""
    return Final(reason, "", text, [], STATS, [])


def streamed(body: dict, template: str, pieces: list[str], finish: str = "stop", stop_word: str = "") -> list[dict]:
    """The events of an answer streamed in `pieces`, as the route makes them."""
    reply = reply_of({**body, "stream": True}, template)
    events = Events(STATS.n_prompt)
    out = events.chunk(reply.first_chunk())
    for piece in pieces:
        out += [e for chunk in reply.chunks(Piece(((piece, False),))) for e in events.chunk(chunk)]
    return out + events.end(reply.last_chunks(final("".join(pieces), finish)), stop_word)


def assembled(events: list[dict]) -> dict:
    """The message a client builds from the events (as Anthropic's SDK does), checking their order."""
    names = [e["event"] for e in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert all(e["data"]["type"] == e["event"] for e in events)
    whole = copy.deepcopy(events[0]["data"]["message"])
    arguments: dict[int, str] = {}
    stopped = set()
    for e in events[1:-2]:
        data = e["data"]
        assert data["index"] not in stopped  # nothing for a closed block
        if e["event"] == "content_block_start":
            assert data["index"] == len(whole["content"])  # blocks numbered in the order they open
            whole["content"].append(dict(data["content_block"]))
        elif e["event"] == "content_block_stop":
            stopped.add(data["index"])
        else:
            block, delta = whole["content"][data["index"]], data["delta"]
            field = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "signature",
                     "input_json_delta": "partial_json"}[delta["type"]]
            if field == "partial_json":
                arguments[data["index"]] = arguments.get(data["index"], "") + delta[field]
            elif field == "signature":
                block[field] = delta[field]
            else:
                block[field] += delta[field]
    assert stopped == set(range(len(whole["content"])))  # every block closed
    for index, text in arguments.items():
        whole["content"][index]["input"] = json.loads(text)
    whole.update(events[-2]["data"]["delta"])
    whole["usage"].update(events[-2]["data"]["usage"])
    return whole


@pytest.mark.parametrize("body, template, text", [
    ({"messages": [USER]}, "", "It is sunny in Paris today."),
    ({"messages": [USER], "tools": [WEATHER]}, QWEN25, "Let me look.\n" + CALL_TEXT),
    ({"messages": [USER], "tools": [WEATHER]}, QWEN25, CALL_TEXT + "\n" + CALL_TEXT.replace("Paris", "Rome")),
    ({"messages": [USER]}, QWEN3, "<think>\nIs it sunny?\n</think>\n\nIt is sunny."),
])
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_the_streamed_events_assemble_into_the_whole_answer(body, template, text, size):
    events = streamed(body, template, [text[i:i + size] for i in range(0, len(text), size)])
    whole = message(reply_of(body, template).full(final(text, "stop")))
    got = assembled(events)
    assert events[0]["data"]["message"]["usage"] == {"cache_read_input_tokens": 0, "input_tokens": 20,
                                                     "output_tokens": 0}
    for block in got["content"]:
        block.pop("id", None)
    for block in whole["content"]:
        block.pop("id", None)
    assert {**got, "id": None} == {**whole, "id": None}
    assert "timings" not in json.dumps(events)


def test_a_streamed_thinking_block_is_signed_before_it_closes_and_tool_blocks_follow_the_text():
    text = "<think>\nHm.\n</think>\n\nLet me look.\n" + CALL_TEXT
    events = streamed({"messages": [USER], "tools": [WEATHER]}, QWEN3, [text[i:i + 4] for i in range(0, len(text), 4)])
    starts = [(e["data"]["index"], e["data"]["content_block"]["type"]) for e in events
              if e["event"] == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text"), (2, "tool_use")]
    closing = [(e["event"], e["data"].get("index"), e["data"].get("delta", {}).get("type")) for e in events[-6:]]
    assert closing == [("content_block_delta", 0, "signature_delta"), ("content_block_stop", 0, None),
                       ("content_block_stop", 1, None), ("content_block_stop", 2, None),
                       ("message_delta", None, None), ("message_stop", None, None)]
    assert events[-2]["data"]["delta"]["stop_reason"] == "tool_use"


def test_a_stream_cut_short_or_stopped_by_a_sequence_says_so():
    events = streamed({"messages": [USER]}, "", ["Sun"], finish="length")
    assert events[-2]["data"]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    events = streamed({"messages": [USER], "stop_sequences": ["END"]}, "", ["Sun"], stop_word="END")
    assert events[-2]["data"]["delta"] == {"stop_reason": "end_turn", "stop_sequence": "END"}
    assert events[-2]["data"]["usage"] == {"cache_read_input_tokens": 15, "input_tokens": 5, "output_tokens": 7}


def test_a_calls_arguments_wait_for_its_name():
    events = Events(3)
    chunk = {"id": "x", "model": "m", "choices": [{"index": 0, "finish_reason": None, "delta": {}}]}

    def with_call(call: dict) -> dict:
        return {**chunk, "choices": [{"index": 0, "finish_reason": None, "delta": {"tool_calls": [call]}}]}

    assert [e["event"] for e in events.chunk(chunk)] == ["message_start"]
    assert events.chunk(with_call({"index": 0, "function": {"arguments": '{"a"'}})) == []
    started, delta = events.chunk(with_call({"index": 0, "id": "c", "function": {"name": "f", "arguments": ":1}"}}))
    assert started["data"]["content_block"] == {"type": "tool_use", "id": "c", "name": "f", "input": {}}
    assert delta["data"]["delta"] == {"type": "input_json_delta", "partial_json": '{"a":1}'}
    renamed = events.chunk(with_call({"index": 0, "id": "c", "function": {"name": "f", "arguments": ""}}))
    assert renamed == []  # one block per call


# -- the routes, on a stand-in worker (no generation) ------------------------------


def test_count_tokens_counts_the_prompt_the_chat_endpoint_would_render_with_anthropics_key_header():
    asgi = app()
    body = {"system": "Book", "messages": [{"role": "user", "content": [{"type": "text", "text": "What is the best book"}]}]}
    prompt = StandInEngine().chat_text([{"role": "system", "content": "Book"},
                                        {"role": "user", "content": "What is the best book"}])
    assert call(asgi, "POST", "/v1/messages/count_tokens", {"X-Api-Key": KEY}, body)[::2] == (
        200, {"input_tokens": len(prompt.encode())})
    status, headers, answer = call(asgi, "POST", "/v1/messages/count_tokens", {"x-api-key": "wrong"}, body)
    assert status == 401 and answer == {"error": {"code": 401, "message": answer["error"]["message"],
                                                  "type": "authentication_error"}}


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("raw, status, message", [
    (b'{"max_tokens": 5}', 400, "'messages' is required"),
    (b'{"messages": [{"role": "user", "content": [{"type": "audio"}]}]}', 400, '"audio" are not supported'),
    (b'{"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}', 500, "image input"),
    (b"{not json", 400, "invalid JSON"),
])
def test_errors_are_llama_servers_error_objects_and_the_server_goes_on(path, raw, status, message):
    asgi = app(api_key=None)
    got, _, answer = call(asgi, "POST", path, raw=raw)
    assert got == status and message in answer["error"]["message"]
    assert set(answer["error"]) == {"code", "message", "type"} and answer["error"]["code"] == status
    assert call(asgi, "POST", "/v1/messages/count_tokens", body={"messages": [USER]})[0] == 200
