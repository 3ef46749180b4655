"""Hermes 2 Pro's tool calls, also written by Qwen2.5 (and Qwen2.5-Coder), Qwen3, QwQ and
Granite 4.0/4.1: a JSON object in tags, reasoning (Qwen3, QwQ) in <think>:

    <think>...</think>
    content<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The pinned llama.cpp reads these templates with its differential autoparser
(common/chat-diff-analyzer.cpp finds JSON_NATIVE calls, `<tool_call>` around each, keys
"name" then "arguments"; chat-auto-parser-generator.cpp builds the parser and grammar).
Where llama.cpp allows several <tool_call> blocks whatever parallel_tool_calls says, the grammar
here allows exactly one call without it.
"""

from __future__ import annotations

import re

from speculative.chat.format import Format, Syntax, ToolGrammar
from speculative.chat.formats._common import (Incomplete, Reader, Rules, alternatives, finish, json_call_rule,
                                              parse_message, read_json_call, repeated, selected)
from speculative.chat.message import ChatMessage, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_ARGUMENTS_KEY = re.compile(r'\\?"arguments\\?"')


class Hermes(Format):
    name = "hermes"

    @classmethod
    def matches(cls, source: str) -> bool:
        # the tag, and the call's JSON key (as the template writes a call back, or its instruction
        # shows one): GLM, Laguna, Ling and MiniMax put other forms in <tool_call>
        return OPEN in source and _ARGUMENTS_KEY.search(source) is not None

    def parse(self, text: str, partial: bool, syntax: Syntax) -> ChatMessage:
        return parse_message(text, partial, syntax, self.think, (OPEN,), _read_call)

    def grammar(self, tools: list[dict], choice: str | dict, parallel: bool) -> ToolGrammar | None:
        chosen = selected(tools, choice)
        if chosen is None:
            return None
        rules = Rules()
        bodies = [json_call_rule(rules, t, [("name", "NAME"), ("arguments", "ARGS")]) for t in chosen]
        body = rules.add("tool-call-body", alternatives(bodies))
        tool_call = rules.add("tool-call", f'"{OPEN}" space {body} space "{CLOSE}"')
        return finish(rules, repeated(tool_call, parallel), choice, (OPEN,))


def _read_call(reader: Reader) -> tuple[ToolCall | None, bool]:
    """<tool_call> {"name": ..., "arguments": {...}} </tool_call> at the reader."""
    reader.literal(OPEN)
    reader.space()
    found = read_json_call(reader, "name", "arguments")
    if not found.name:
        return None, False
    if not found.complete:
        return found.tool_call(), False
    reader.space()
    try:
        closed = reader.literal(CLOSE)
    except Incomplete:  # the closing tag is still to come
        closed = False
    return found.tool_call(), closed


FORMAT = Hermes
