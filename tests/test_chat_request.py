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


@pytest.mark.parametrize("template, thinking, end", [  # llama.cpp's tools/server/tests/unit/test_template.py
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", None, "<think>\n"),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", False, "<think>\n</think>"),
    ("Qwen-Qwen3-0.6B", None, "<|im_start|>assistant\n"),
    ("Qwen-Qwen3-0.6B", False, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    ("Qwen-QwQ-32B", None, "<|im_start|>assistant\n<think>\n"),
    ("Qwen-QwQ-32B", False, "<|im_start|>assistant\n<think>\n</think>"),
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use", None, "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"),
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use", False,
     "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|><|END_THINKING|>"),
])
@pytest.mark.parametrize("tools", [None, [WEATHER]])
def test_thinking_off_closes_the_block_as_llama_server_does(template, thinking, end, tools):
    from speculative.engine.chat import format_chat

    source = (Path(__file__).parent / "data" / "templates" / f"{template}.jinja").read_text()
    extra = {} if thinking is None else {"enable_thinking": thinking}
    prompt = format_chat(source, [{"role": "user", "content": "What is today?"}], True, "", "", tools, extra)
    assert prompt.endswith(end)


def test_add_generation_prompt_false_ends_with_the_history():
    from speculative.engine.chat import format_chat

    source = (Path(__file__).parent / "data" / "templates" / "meta-llama-Llama-3.3-70B-Instruct.jinja").read_text()
    messages = [{"role": "user", "content": "What is today?"}]
    header = "<|start_header_id|>assistant<|end_header_id|>"
    assert header in format_chat(source, messages, True, "", "")
    assert header not in format_chat(source, messages, True, "", "", None, {"add_generation_prompt": False})


def test_tojson_writes_json_as_llama_cpp_does():
    """Keys in their order and characters as they are (jinja2's own sorts keys and escapes for HTML)."""
    from speculative.engine.chat import render

    arguments = {"path": "a.py", "content": "it's <b> & 'c'"}
    text = render("{{ messages[0].tool_calls[0].function.arguments | tojson }}",
                  [{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": arguments}}]},
                   {"role": "user", "content": "go on"}])
    assert text == '{"path": "a.py", "content": "it\'s <b> & \'c\'"}'
    assert render("{{ {'b': [1, 2]} | tojson(indent=1) }}", []) == '{\n "b": [\n  1,\n  2\n ]\n}'


def test_templates_get_todays_date_as_llama_cpp_gives_it():
    import datetime

    from speculative.engine.chat import render

    source = (Path(__file__).parent / "data" / "templates" / "meta-llama-Llama-3.3-70B-Instruct.jinja").read_text()
    before = datetime.date.today().strftime("%d %b %Y")
    prompt = render(source, [{"role": "user", "content": "What is today?"}])
    assert before in prompt or datetime.date.today().strftime("%d %b %Y") in prompt  # midnight between


def test_text_plus_an_undefined_variable_is_the_text_as_in_llama_cpps_jinja():
    """firefunction-v2's template adds `functions`, which no server defines (llama.cpp's test_template.py)."""
    from speculative.engine.chat import render

    assert render('{{ "a" + nothing }}|{{ nothing + "b" }}', []) == "a|b"
