"""IBM Granite 3.x: reasoning in <think>, the answer optionally in <response>, tool calls as a
JSON list after <|tool_call|> (what the template's system prompt asks for):

    <think>...</think><response>Hello</response>
    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]

The pinned llama.cpp reads Granite 3.3 with its autoparser, patched for <think> and <response>
(common/chat-diff-analyzer.cpp, "Granite 3.3"), where unwrapping <response> is still a TODO
(tests/test-chat.cpp) and no tool calls are found: the template never writes an assistant's
calls. These are read as llama.cpp's earlier Granite handler read them (the <response> wrapper
taken off, the <|tool_call|> list). Granite 4.x templates write <tool_call> and are hermes'.
"""

from __future__ import annotations

from speculative.chat.format import Format, Syntax, ToolGrammar
from speculative.chat.formats._blocks import call_array_rule, read_call_array
from speculative.chat.formats._common import Incomplete, Reader, Rules, finish, selected, split_calls, split_reasoning
from speculative.chat.message import ChatMessage, ToolCall

TOOL_CALL = "<|tool_call|>"
RESPONSE, RESPONSE_END = "<response>", "</response>"
ROLE = "<|start_of_role|>"  # Granite's turn header


class Granite(Format):
    name = "granite"

    @classmethod
    def matches(cls, source: str) -> bool:
        return ROLE in source and TOOL_CALL in source and "<tool_call>" not in source

    def parse(self, text: str, partial: bool, syntax: Syntax) -> ChatMessage:
        reasoning, rest = split_reasoning(text, partial, syntax, self.think, (TOOL_CALL,))
        rest = _unwrapped(rest, partial)
        if not syntax.tools:
            return ChatMessage(content=rest, reasoning_content=reasoning)
        content, calls = split_calls(rest, partial, (TOOL_CALL,), _read_block)
        return ChatMessage(content=content, reasoning_content=reasoning, tool_calls=calls)

    def grammar(self, tools: list[dict], choice: str | dict, parallel: bool) -> ToolGrammar | None:
        chosen = selected(tools, choice)
        if chosen is None:
            return None
        rules = Rules()
        array = call_array_rule(rules, chosen, [("name", "NAME"), ("arguments", "ARGS")], parallel)
        return finish(rules, f'"{TOOL_CALL}" space {array}', choice, (TOOL_CALL,))


def _unwrapped(text: str, partial: bool) -> str:
    """The answer with its <response> wrapper taken off (a partial text's start of either tag
    held back); what follows </response> (a tool call) follows the answer."""
    reader = Reader(text)
    reader.space()
    try:
        wrapped = reader.literal(RESPONSE)
    except Incomplete:
        return "" if partial else text
    if not wrapped:
        return text
    answer, closing = reader.until((RESPONSE_END,), partial)
    if closing is None:
        return answer
    return answer + text[reader.pos + len(closing):]


def _read_block(reader: Reader) -> tuple[list[ToolCall], bool]:
    """<|tool_call|>[{"name": ..., "arguments": {...}}, ...] at the reader."""
    reader.literal(TOOL_CALL)
    reader.space()
    return read_call_array(reader, "name", "arguments")


FORMAT = Granite
