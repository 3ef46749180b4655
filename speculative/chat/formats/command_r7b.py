"""Cohere's Command R7B and Cohere2 MoE (North Code): every part of the answer in markers,
the tool calls a JSON list with the model's own ids:

    <|START_THINKING|>...<|END_THINKING|>
    <|START_RESPONSE|>Hello<|END_RESPONSE|>            (Cohere2 MoE: <|START_TEXT|>...<|END_TEXT|>)
    <|START_ACTION|>[
        {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}
    ]<|END_ACTION|>

The pinned llama.cpp reads Command R7B with its autoparser (content always wrapped, the calls
JSON_NATIVE in the action section) and Cohere2 MoE with common/parsers/cohere2moe.cpp, whose
reasoning also ends where text or an action starts and whose prompt opens the thinking block.
With reasoning_format none the thinking block stays in the content, markers and all.
"""

from __future__ import annotations

from speculative.chat.format import Format, Syntax, ToolGrammar
from speculative.chat.formats._blocks import call_array_rule, read_call_array
from speculative.chat.formats._common import Reader, Rules, finish, selected, split_reasoning
from speculative.chat.message import ChatMessage, ToolCall

THINKING = ("<|START_THINKING|>", "<|END_THINKING|>")
WRAPPERS = {"<|START_RESPONSE|>": "<|END_RESPONSE|>", "<|START_TEXT|>": "<|END_TEXT|>"}
ACTION, ACTION_END = "<|START_ACTION|>", "<|END_ACTION|>"
TURN_END = "<|END_OF_TURN_TOKEN|>"
ID = "tool-call-id"
ID_RULE = r'"\"" [^"\\\x00-\x1F]* "\"" | [0-9]+'  # the template writes "0", "1", ...; llama.cpp takes a number too


class CommandR7B(Format):
    name = "command_r7b"
    think = THINKING

    @classmethod
    def matches(cls, source: str) -> bool:
        # R7B's templates (its default one too) answer in <|START_RESPONSE|>; <|START_TEXT|> is
        # Cohere2 MoE's only beside its actions
        return "<|START_RESPONSE|>" in source or ("<|START_TEXT|>" in source and ACTION in source)

    def parse(self, text: str, partial: bool, syntax: Syntax) -> ChatMessage:
        if syntax.extract_reasoning:
            reasoning, rest = split_reasoning(text, partial, syntax, THINKING, (*WRAPPERS, ACTION))
        else:  # the block as written, with the opening tag the prompt wrote
            reasoning, rest = "", (THINKING[0] if syntax.thinking_open else "") + text
        content, calls = _body(rest, partial, syntax.tools)
        return ChatMessage(content=content, reasoning_content=reasoning, tool_calls=calls)

    def grammar(self, tools: list[dict], choice: str | dict, parallel: bool) -> ToolGrammar | None:
        chosen = selected(tools, choice)
        if chosen is None:
            return None
        rules = Rules()
        call_id = rules.add(ID, ID_RULE)
        fields = [("tool_call_id", call_id), ("tool_name", "NAME"), ("parameters", "ARGS")]
        array = call_array_rule(rules, chosen, fields, parallel)
        return finish(rules, f'"{ACTION}" space {array} space "{ACTION_END}"', choice, (ACTION,))


def _body(text: str, partial: bool, tools: bool) -> tuple[str, list[ToolCall]]:
    """The content (each wrapper's text, and text outside them as written) and the calls of
    the action block, up to the end of the turn."""
    reader, content, calls = Reader(text), "", []
    starts = (*WRAPPERS, TURN_END) + ((ACTION,) if tools else ())
    while True:
        piece, marker = reader.until(starts, partial)
        if piece.strip():
            content += piece
        if marker is None or marker == TURN_END:
            return content, calls
        reader.pos += len(marker)
        if marker == ACTION:
            found, closed = _read_action(reader)
            calls += found
            if not closed:
                return content, calls
            continue
        inner, closing = reader.until((WRAPPERS[marker],), partial)
        content += inner
        if closing is None:
            return content, calls
        reader.pos += len(closing)


def _read_action(reader: Reader) -> tuple[list[ToolCall], bool]:
    """[{"tool_call_id": ..., "tool_name": ..., "parameters": {...}}, ...]<|END_ACTION|> after
    the action's opening marker: its calls and whether the block closed."""
    reader.space()
    try:
        calls, closed = read_call_array(reader, "tool_name", "parameters", "tool_call_id")
    except ValueError:
        return [], False
    if closed:
        reader.space()
        closed = reader.rest.startswith(ACTION_END)
        reader.pos += len(ACTION_END) if closed else 0
    return calls, closed


FORMAT = CommandR7B
