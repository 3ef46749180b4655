"""Google's Gemma 4: reasoning in a `thought` channel, tool calls with arguments in Gemma's own
notation (keys bare, strings between <|"|> quotes):

    <|channel>thought
    Thinking...<channel|>Let me look.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>

as the pinned llama.cpp reads it (common/parsers/gemma4.cpp, its mapper gemma4_to_json in
common/chat-peg-parser.cpp): the arguments are reported as compact JSON ({"city":"Paris"}),
growing as they are written. Empty or repeated channel openings are skipped, an empty thought
block at the end is dropped, and the answer ends at a stray <channel|>; text after the calls is
dropped. The grammar holds the calls to Gemma's notation, not to each tool's schema (neither
does llama.cpp's).
"""

from __future__ import annotations

import json
import re

from speculative.chat.format import Format, Syntax, ToolGrammar
from speculative.chat.formats._common import (Incomplete, Reader, Rules, alternatives, call, finish,
                                              format_literal, function_name, properties, repeated, selected,
                                              until_including)
from speculative.chat.message import ChatMessage, ToolCall

CHANNEL, CHANNEL_END = "<|channel>", "<channel|>"
THOUGHT = CHANNEL + "thought"
TOOL_CALL, CALL, TOOL_CALL_END = "<|tool_call>", "<|tool_call>call:", "<tool_call|>"
QUOTE = '<|"|>'
TURN = "<|turn>model\n"
_SCALAR = re.compile(r"[-+.0-9A-Za-z]+")
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")

# the notation's grammar, as gemma4.cpp's rules build it
VALUE_RULES = {
    "gemma4-dict-kv": "gemma4-dict-key-name \":\" space gemma4-value",
    "gemma4-dict-key-name": "[^:}]+",
    "gemma4-dict": '"{" space ("}" | gemma4-dict-kv ("," space gemma4-dict-kv)* space "}")',
    "gemma4-array": '"[" space ("]" | gemma4-value ("," space gemma4-value)* space "]")',
    "gemma4-number": '"-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [-+]? [0-9]+)?',
    "gemma4-value": 'gemma4-string | gemma4-dict | gemma4-array | gemma4-number | "true" | "false" | "null"',
}


class Gemma4(Format):
    name = "gemma4"
    think = (THOUGHT, CHANNEL_END)

    @classmethod
    def matches(cls, source: str) -> bool:
        return CALL in source

    def parse(self, text: str, partial: bool, syntax: Syntax) -> ChatMessage:
        message, reader = ChatMessage(), Reader(text)
        try:
            reader.literal(TURN)
        except Incomplete:
            return message
        stop = _read_messages(reader, partial, syntax, message)
        if syntax.tools and stop == CHANNEL_END:  # text up to a call is dropped
            _, stop = reader.until((TOOL_CALL,), partial)
        if syntax.tools and stop == TOOL_CALL:
            _read_calls(reader, partial, message.tool_calls)
        return message

    def grammar(self, tools: list[dict], choice: str | dict, parallel: bool) -> ToolGrammar | None:
        chosen = selected(tools, choice)
        if chosen is None:
            return None
        for tool in chosen:
            properties(tool)  # a schema llama.cpp refuses is refused here too, though it shapes nothing
        rules = Rules()
        rules.add("gemma4-string", f"{format_literal(QUOTE)} {until_including(rules, 'gemma4-string-content', QUOTE)}")
        for name, body in VALUE_RULES.items():
            rules.add(name, body)
        bodies = [rules.add(f"tool-{function_name(t)}", f"{format_literal(function_name(t))} gemma4-dict")
                  for t in chosen]
        tool_call = rules.add("tool-call", f'"{CALL}" ({alternatives(bodies)}) "{TOOL_CALL_END}"')
        return finish(rules, repeated(tool_call, parallel, ""), choice, (TOOL_CALL,))


def _read_messages(reader: Reader, partial: bool, syntax: Syntax, message: ChatMessage) -> str | None:
    """Thought blocks and content, into `message`, up to what stops them: a call's opening
    (with tools), a stray <channel|>, or the end (None)."""
    stops = (CHANNEL, CHANNEL_END) + ((TOOL_CALL,) if syntax.tools else ())
    while True:
        if reader.rest.startswith(CHANNEL) and not _read_thought(reader, partial, syntax, message):
            return None
        piece, marker = reader.until(stops, partial)
        message.content += piece
        if marker != CHANNEL:
            return marker


def _read_thought(reader: Reader, partial: bool, syntax: Syntax, message: ChatMessage) -> bool:
    """A thought block at the reader (after any empty channel openings): whether it closed."""
    while reader.rest.startswith(CHANNEL) and not reader.rest.startswith(THOUGHT):
        if partial and THOUGHT.startswith(reader.rest):
            return False  # may still be the thought's opening
        reader.pos += len(CHANNEL)
    if not reader.rest.startswith(THOUGHT):
        return True  # not a thought: what follows is content
    start = reader.pos
    reader.pos += len(THOUGHT)
    reader.space()
    reasoning, closing = reader.until((CHANNEL_END,), partial)
    reader.pos += len(closing or "")
    if syntax.extract_reasoning:
        message.reasoning_content += reasoning
    else:
        message.content += reader.text[start:reader.pos]
    return closing is not None


def _read_calls(reader: Reader, partial: bool, calls: list[ToolCall]) -> None:
    """<|tool_call>call:NAME{...}<tool_call|>, one after another, at the reader."""
    try:
        while reader.literal(CALL):
            name, brace = reader.until(("{",), partial=False)
            if brace is None:
                return
            out: list[str] = []
            try:
                _value(reader, partial, out)
            except (Incomplete, ValueError):
                calls.append(call(name, "".join(out), False))
                return
            calls.append(call(name, "".join(out), True))
            if not reader.literal(TOOL_CALL_END):
                return
            reader.space()
    except Incomplete:
        return


def _value(reader: Reader, partial: bool, out: list[str]) -> None:
    """Gemma's notation of a value at the reader, written to `out` as JSON; Incomplete where the
    text ends inside it (`out` has its JSON so far), ValueError where it is not the notation."""
    if reader.literal(QUOTE):
        out.append('"')
        text, quote = reader.until((QUOTE,), partial)
        out.append(json.dumps(text, ensure_ascii=False)[1:-1])
        if quote is None:
            raise Incomplete()
        reader.pos += len(QUOTE)
        out.append('"')
    elif reader.literal("{"):
        _members(reader, partial, out, "{", "}", keyed=True)
    elif reader.literal("["):
        _members(reader, partial, out, "[", "]", keyed=False)
    else:
        scalar = _SCALAR.match(reader.text, reader.pos)
        if not scalar:
            raise ValueError("not a value")
        out.append(scalar.group())
        reader.pos = scalar.end()
        if reader.at_end:
            raise Incomplete()
        if scalar.group() not in ("true", "false", "null") and not _NUMBER.fullmatch(scalar.group()):
            raise ValueError(f"not a value: {scalar.group()!r}")


def _members(reader: Reader, partial: bool, out: list[str], opening: str, closing: str, keyed: bool) -> None:
    """A dict's or an array's members after its opening, as JSON."""
    out.append(opening)
    reader.space()
    first = True
    while not reader.literal(closing):
        if not first:
            if not reader.literal(","):
                raise ValueError(f"expected ',' or {closing!r}")
            out.append(",")
            reader.space()
        if keyed:
            key, colon = reader.until((":",), partial=False)
            out.append('"' + json.dumps(key, ensure_ascii=False)[1:-1])
            if colon is None:
                raise Incomplete()
            reader.pos += 1
            out.append('":')
            reader.space()
        _value(reader, partial, out)
        reader.space()
        first = False
    out.append(closing)


FORMAT = Gemma4
