"""OpenAI's Responses API without a model (responses_api.py): a Responses body made the chat body
llama-server's converter makes of it, then read by the chat endpoint's parser; a chat answer
(openai_api.Reply's, from the answer's text pushed in pieces) made a Response and its stream of
events, which a client assembles into that Response; bad bodies as llama-server's 400s, over
HTTP on the stand-in server of test_serve_access. tests/test_serve_responses.py has the model."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from speculative.decoding.stats import Stats
from speculative.engine.stream import Final, Piece
from speculative.serving import openai_api, responses_api
from speculative.serving.generation import ApiError
from speculative.serving.openai_api import Reply
from speculative.serving.worker import Progress
from tests.test_serve_access import StandInEngine, app, call

TOOLS = (Path(__file__).parent / "data" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
THINKING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "<|im_start|>assistant\n<think>\n")
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def parsed(body: dict, template: str = TOOLS):
    """A Responses body as the chat endpoint reads it."""
    return openai_api.parse(responses_api.to_chat(body), True, template=template)


# -- requests ---------------------------------------------------------------------------


def test_a_string_input_with_instructions_is_a_system_and_a_user_message():
    body = {"input": "What is 2+2?", "instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0.5,
            "top_p": 0.9, "model": "any", "stream": True}
    chat = responses_api.to_chat(body)
    assert chat["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert chat["max_tokens"] == 7 and not {"input", "instructions", "max_output_tokens"} & set(chat)
    generation = openai_api.parse(chat, True)
    assert generation.max_tokens == 7 and generation.stream
    assert (generation.sampling.temp, generation.sampling.top_p) == (0.5, 0.9)


def test_message_items_become_chat_messages_with_text_parts():
    body = {"input": [{"role": "developer", "content": "Answer in French."},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"},
                                                                      {"type": "input_text", "text": "there"}]},
                      {"type": "message", "role": "assistant", "status": "completed", "id": "msg_1",
                       "content": [{"type": "output_text", "text": "Bonjour", "annotations": []}]},
                      {"role": "user", "content": "Again"}]}
    messages = parsed(body).messages
    assert [(m["role"], m["content"]) for m in messages] == [
        ("system", "Answer in French."), ("user", "Hello\nthere"), ("assistant", "Bonjour"), ("user", "Again")]


def test_a_function_call_and_its_output_round_trip_into_the_chat_history():
    body = {"input": [{"role": "user", "content": "Weather in Paris?"},
                      {"type": "function_call", "call_id": "call_abc", "name": "get_weather",
                       "arguments": '{"city": "Paris"}', "id": "fc_abc", "status": "completed"},
                      {"type": "function_call_output", "call_id": "call_abc", "output": "Sunny, 21 C"}],
            "tools": [WEATHER]}
    user, assistant, tool = parsed(body).messages
    assert assistant["role"] == "assistant" and not assistant["content"]
    (call_,) = assistant["tool_calls"]
    assert call_["id"] == "call_abc" and call_["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert tool == {"role": "tool", "content": "Sunny, 21 C", "tool_call_id": "call_abc"}
    parts = responses_api.to_chat({"input": [{"type": "function_call_output", "call_id": "c", "output": [
        {"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}]})["messages"][0]
    assert parts["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]


def test_an_assistants_items_merge_into_one_message():
    body = {"input": [{"role": "user", "content": "Hi"},
                      {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
                      {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me."}]},
                      {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                      {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c1", "output": "x"}]}
    messages = responses_api.to_chat(body)["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assistant = messages[1]
    assert assistant["reasoning_content"] == "hmm" and assistant["content"] == [{"text": "Let me.", "type": "text"}]
    assert [c["id"] for c in assistant["tool_calls"]] == ["c1", "c2"]


def test_flat_function_tools_and_a_named_choice_take_the_chat_shape():
    strict_off = {**WEATHER, "name": "read_file", "strict": False}
    chat = responses_api.to_chat({"input": "x", "tools": [WEATHER, {"type": "web_search"}, strict_off],
                                  "tool_choice": {"type": "function", "name": "read_file"},
                                  "reasoning": {"effort": "low"}})
    assert chat["tools"] == [{"type": "function", "function": {**{k: v for k, v in WEATHER.items() if k != "type"},
                                                               "strict": True}},
                             {"type": "function", "function": {**{k: v for k, v in strict_off.items() if k != "type"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "read_file"}}
    assert chat["reasoning_effort"] == "low" and "reasoning" not in chat
    generation = openai_api.parse(chat, True, template=TOOLS)
    assert [t["function"]["name"] for t in generation.tools] == ["get_weather", "read_file"]
    assert not generation.plan.grammar.lazy  # a named function is called from the first token
    for choice in ("auto", "none", "required"):
        assert responses_api.to_chat({"input": "x", "tool_choice": choice})["tool_choice"] == choice
    assert "tools" not in responses_api.to_chat({"input": "x", "tools": [{"type": "file_search"}]})


@pytest.mark.parametrize("body, message", [
    ({"messages": []}, "'input' is required"),
    ({"input": "x", "previous_response_id": "resp_1"}, "llama.cpp does not support 'previous_response_id'."),
    ({"input": 5}, "'input' must be a string or array of objects"),
    ({"input": ["hi"]}, "Cannot determine type of 'item'"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "Cannot determine type of 'item'"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]},
     "'type' must be one of 'input_text', 'input_image', or 'input_file'"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "'input_file' is not supported by llamacpp at this moment"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "'Input text' requires 'text'"),
    ({"input": [{"type": "message", "role": "assistant", "content": [{"type": "input_image"}]}]},
     "'type' must be one of 'output_text' or 'refusal'"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file"}]}]},
     "Output of tool call should be 'Input text' or 'Input image'"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "item['content'] is not an array"),
    ({"input": [{"type": "reasoning", "summary": [], "content": []}]}, "item['content'] is empty"),
    ({"input": "x", "tools": {"type": "function"}}, "'tools' must be an array of objects"),
    ({"input": "x", "instructions": ["a"]}, "'instructions' must be a string"),
])
def test_bad_bodies_are_400s_with_llama_servers_messages(body, message):
    with pytest.raises(ApiError) as e:
        responses_api.to_chat(body)
    assert e.value.status == 400 and e.value.message == message


@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/a.png"}]}]}, "messages"),
    ({"input": "x", "max_output_tokens": 0}, "max_tokens"),
    ({"input": "x", "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
])
def test_what_the_chat_endpoint_refuses_is_a_400_too(body, param):
    with pytest.raises(ApiError) as e:
        parsed(body)
    assert e.value.status == 400 and e.value.param == param


def test_progress_and_timings_per_token_are_booleans():
    """llama-server's stream extras pass on to the chat request, which reads them."""
    def telemetry(body: dict) -> tuple[bool, bool]:
        generation = parsed({"input": "Hi", **body})
        return generation.return_progress, generation.timings_per_token

    assert telemetry({"return_progress": True}) == (True, False)
    assert telemetry({"timings_per_token": True, "return_progress": None}) == (False, True)
    with pytest.raises(ApiError) as e:
        telemetry({"timings_per_token": 1})
    assert e.value.status == 400 and e.value.param == "timings_per_token"


# -- answers ----------------------------------------------------------------------------


STATS = Stats(n_prompt=20, n_cached=4, n_predict=9, n_drafted=6, n_accept=5, n_steps=4)


def final(text: str, reason: str = "stop") -> Final:
    """A run's end as the worker gives it, with STATS."""
    return Final(reason, "", text, [], STATS, [])


def reply(body: dict, template: str = TOOLS, prompt_tail: str = "") -> Reply:
    generation = replace(parsed(body, template), include_usage=True)
    out = Reply("the-model", generation)
    out.started(prompt_tail)
    return out


def test_a_whole_answer_is_a_response_with_its_text_and_usage():
    answer = reply({"input": "Hi"}).full(final("Hello there."))
    got = responses_api.response(answer)
    assert got["id"].startswith("resp_") and got["object"] == "response" and got["status"] == "completed"
    assert got["model"] == "the-model" and got["created_at"] <= got["completed_at"]
    (message,) = got["output"]
    assert message["id"].startswith("msg_") and message["role"] == "assistant" and message["type"] == "message"
    assert message["content"] == [{"type": "output_text", "annotations": [], "logprobs": [], "text": "Hello there."}]
    assert got["usage"] == {"input_tokens": 20, "output_tokens": 9, "total_tokens": 29,
                            "input_tokens_details": {"cached_tokens": 4}}
    assert "timings" not in got  # llama-server's unstreamed response has none


def test_a_whole_answers_calls_and_reasoning_are_output_items():
    got = responses_api.response(reply({"input": "Weather?", "tools": [WEATHER]}).full(final(CALL)))
    message, call_ = got["output"]
    assert message["content"][0]["text"].strip() == "Let me look."
    assert call_["type"] == "function_call" and call_["name"] == "get_weather" and call_["status"] == "completed"
    assert call_["id"] == "fc_" + call_["call_id"].removeprefix("call_") and len(call_["call_id"]) > 8
    assert json.loads(call_["arguments"]) == {"city": "Paris"}
    got = responses_api.response(reply({"input": "2+2?"}, THINKING).full(final("<think>add</think>It is 4.")))
    reasoning, message = got["output"]
    assert reasoning["id"].startswith("rs_") and reasoning["type"] == "reasoning" and reasoning["summary"] == []
    assert reasoning["content"] == [{"text": "add", "type": "reasoning_text"}]
    assert message["content"][0]["text"] == "It is 4."


def stream(answer: Reply, text: str, size: int = 3, timings: bool = False, progress: dict | None = None) -> list[dict]:
    """The events of `text` streamed `size` characters a step (with each step's number as its timings)."""
    events = responses_api.Events("the-model")
    out = events.opening(progress)
    for step, i in enumerate(range(0, len(text), size)):
        out += events.chunks(answer.chunks(Piece(((text[i:i + size], False),))), {"step": step} if timings else None)
    return out + events.end(answer.last_chunks(final(text)))


def assemble(events: list[dict]) -> dict:
    """The Response a client builds from the events, checked against the one response.completed carries."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] == "response.completed" and events[0]["response"]["id"] == events[-1]["response"]["id"]
    items: dict[int, dict] = {}
    done: dict[int, dict] = {}
    for e in events[2:-1]:
        kind = e["type"]
        if kind == "response.output_item.added":
            assert e["output_index"] == len(items) and e["item"]["status"] == "in_progress"
            items[e["output_index"]] = {**e["item"], "text": ""}
            continue
        item = items[e["output_index"]]
        assert e.get("item_id", item["id"]) == item["id"] and e["output_index"] not in done
        if kind in ("response.output_text.delta", "response.reasoning_text.delta",
                    "response.function_call_arguments.delta"):
            item["text"] += e["delta"]
        elif kind == "response.output_text.done":
            assert e["text"] == item["text"]
        elif kind == "response.output_item.done":
            assert e["item"]["id"] == item["id"] and e["item"]["status"] == "completed"
            done[e["output_index"]] = e["item"]
    assert sorted(done) == sorted(items) and [done[i] for i in sorted(done)] == events[-1]["response"]["output"]
    for i, item in items.items():  # every delta adds up to the whole item
        whole = done[i]
        text = whole.get("arguments") or (whole["content"][0]["text"] if whole["content"] else "")
        assert item["text"] == text
    return events[-1]


def test_a_streamed_answer_assembles_into_the_whole_answer():
    body = {"input": "Hi"}
    completed = assemble(stream(reply(body), "Hello there, how are you?"))
    whole = responses_api.response(reply(body).full(final("Hello there, how are you?")))
    assert completed["response"]["output"][0]["content"] == whole["output"][0]["content"]
    assert completed["response"]["usage"] == whole["usage"] and completed["response"]["status"] == "completed"
    assert completed["timings"]["draft_n"] == 6 and completed["timings"]["draft_n_accepted"] == 5


def test_a_streamed_call_opens_its_item_then_streams_its_arguments():
    events = stream(reply({"input": "Weather?", "tools": [WEATHER]}), CALL, size=2)
    completed = assemble(events)
    message, call_ = completed["response"]["output"]
    assert message["content"][0]["text"].strip() == "Let me look."
    assert call_["name"] == "get_weather" and json.loads(call_["arguments"]) == {"city": "Paris"}
    assert call_["call_id"] == "call_" + call_["id"].removeprefix("fc_")
    kinds = [e["type"] for e in events]
    assert "response.function_call_arguments.delta" in kinds
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [i["type"] for i in added] == ["message", "function_call"] and added[1]["name"] == "get_weather"


def test_streamed_reasoning_is_a_reasoning_item_before_the_message():
    events = stream(reply({"input": "2+2?"}, THINKING, "<|im_start|>assistant\n<think>\n"), "add them</think>It is 4.")
    reasoning, message = assemble(events)["response"]["output"]
    assert reasoning["content"] == [{"text": "add them", "type": "reasoning_text"}]
    assert message["content"][0]["text"] == "It is 4."
    assert any(e["type"] == "response.reasoning_text.delta" for e in events)


def test_text_held_back_to_the_end_still_comes_as_deltas():
    """A possible call's opening is held back while it may be one; the end settles it as text."""
    events = stream(reply({"input": "x", "tools": [WEATHER]}), "Use a <tool_c", size=20)
    (message,) = assemble(events)["response"]["output"]
    assert message["content"][0]["text"] == "Use a <tool_c"


def test_timings_per_token_on_each_steps_last_event_and_progress_on_in_progress():
    progress = Progress(20, 0, 0, 0.0).json()
    events = stream(reply({"input": "Hi"}), "abcdefghi", timings=True, progress=progress)
    assert events[1]["type"] == "response.in_progress" and events[1]["prompt_progress"] == progress
    timed = [e for e in events if "timings" in e]
    assert [e["type"] for e in timed[:-1]] == ["response.output_text.delta"] * 3
    assert [e["timings"] for e in timed[:-1]] == [{"step": 0}, {"step": 1}, {"step": 2}]
    assert timed[-1]["type"] == "response.completed"
    assert "timings" not in stream(reply({"input": "Hi"}), "abcdef")[3]


# -- over HTTP (the stand-in server: no generation) -----------------------------------


@pytest.mark.parametrize("path", ["/v1/responses", "/responses", "/v1/responses/input_tokens",
                                  "/responses/input_tokens"])
def test_bad_bodies_get_llama_servers_error_object_and_the_server_goes_on(path):
    asgi = app(api_key=None)
    for body, message in [({"input": "x", "previous_response_id": "resp_x"},
                           "llama.cpp does not support 'previous_response_id'."),
                          ({"input": [{"type": "nope"}]}, "Cannot determine type of 'item'"),
                          ([1], "the request body must be a JSON object")]:
        status, _, answer = call(asgi, "POST", path, body=body)
        assert status == 400 and answer == {"error": {"code": 400, "message": message,
                                                      "type": "invalid_request_error"}}
    status, _, answer = call(asgi, "POST", path, body={"input": "x", "temperature": "hot"})
    assert status == 400 and answer["error"]["code"] == 400
    assert call(asgi, "GET", "/health")[0] == 200


def test_input_tokens_count_the_prompt_the_chat_endpoint_would_render():
    asgi = app(api_key=None)
    chat = {"messages": [{"role": "system", "content": "Book"}, {"role": "user", "content": "Hi"}]}
    expected = {"input_tokens": len(StandInEngine().chat_text(chat["messages"]).encode()),
                "object": "response.input_tokens"}
    for path in ("/v1/responses/input_tokens", "/responses/input_tokens"):
        assert call(asgi, "POST", path, body={"input": "Hi", "instructions": "Book"})[2] == expected
    assert call(asgi, "POST", "/v1/chat/completions/input_tokens", body=chat)[2] == expected
