"""A chat request's plan (chat/request.py): which family reads the answer, whether thinking is
taken apart, the checks of tools and tool_choice; and an answer read piece by piece (Reading),
as `serve` streams it and the terminal shows it. No model: the templates are text."""

from __future__ import annotations

from pathlib import Path

import pytest

from speculative.chat.message import ChatMessage, accumulate
from speculative.chat.request import Reading, plan
from speculative.errors import GrammarError, UsageError

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "<|im_start|>assistant\n")
THINKING = CHATML + "<think>\n"  # a template that opens the thinking block itself
TOOLS = (Path(__file__).parent / "data" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def read_in_pieces(reading: Reading, text: str, size: int = 3) -> ChatMessage:
    """The message a client assembles from the deltas of `text` pushed `size` characters at a time."""
    built = ChatMessage()
    for i in range(0, len(text), size):
        for change in reading.push(text[i:i + size]):
            accumulate(built, change)
    for change in reading.end():
        accumulate(built, change)
    assert built == reading.message
    return built


def test_thinking_is_told_apart_from_the_answer_across_pieces():
    message = read_in_pieces(Reading(plan(THINKING)), "<think>let me see</think>\n\nThe answer is 4.")
    assert (message.reasoning_content, message.content) == ("let me see", "The answer is 4.")


def test_a_prompt_that_opened_the_thinking_starts_in_it():
    reading = Reading(plan(THINKING).after_prompt("<|im_start|>assistant\n<think>\n"))
    message = read_in_pieces(reading, "hmm</think>yes")
    assert (message.reasoning_content, message.content) == ("hmm", "yes")


def test_reasoning_format_none_and_a_template_that_never_thinks_leave_the_text_alone():
    text = "a < b and <think>x</think> <t"
    for chosen in (plan(THINKING, reasoning_format="none"), plan(CHATML)):
        assert read_in_pieces(Reading(chosen), text) == ChatMessage(content=text)
    assert read_in_pieces(Reading(None), text) == ChatMessage(content=text)


def test_a_call_streams_into_the_message_it_parses_to():
    chosen = plan(TOOLS, [WEATHER], "auto")
    assert chosen.grammar is not None and chosen.grammar.lazy
    text = 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    message = read_in_pieces(Reading(chosen), text, size=2)
    assert message.content.strip() == "Let me look."
    (call,) = message.tool_calls
    assert call.name == "get_weather" and call.arguments.replace(" ", "") == '{"city":"Paris"}'


def test_required_and_named_choices_hold_from_the_first_token():
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        assert not plan(TOOLS, [WEATHER], choice).grammar.lazy
    assert plan(TOOLS, [WEATHER], "none").grammar is None


@pytest.mark.parametrize("kwargs, error, message", [
    ({"tools": [WEATHER], "choice": {"type": "function", "function": {"name": "nope"}}}, UsageError, "'nope'"),
    ({"choice": "required"}, UsageError, "required needs tools"),
    ({"reasoning_format": "r1"}, UsageError, "reasoning_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}]}, GrammarError, "f"),
])
def test_requests_the_tools_cannot_meet_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        plan(TOOLS, **kwargs)


def test_parallel_calls_default_to_what_the_template_writes():
    """llama-server's default parallel_tool_calls: its template writes two calls of one message."""
    from speculative.engine.chat import writes_parallel_calls

    assert writes_parallel_calls(TOOLS)
    llama = (Path(__file__).parent / "data" / "templates" / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()
    assert not writes_parallel_calls(llama)  # it raises "only supports single tool-calls at once"
    assert not writes_parallel_calls(CHATML)
