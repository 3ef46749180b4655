"""OpenAI's gpt-oss (the harmony format): the answer is messages on channels, the prompt ends
with `<|start|>assistant`:

    <|channel|>analysis<|message|>Thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}
    <|start|>assistant<|channel|>final<|message|>Hello

as the pinned llama.cpp reads it (common/parsers/gpt-oss.cpp): `analysis` is reasoning (with
reasoning_format none, the message as written is content), `commentary` without a recipient
(a preamble) and `final` are content, a recipient `functions.NAME` (in the channel's header or
before it) makes the message a call, whose JSON arguments end the answer (<|call|> ends the
turn: one call an answer, whatever parallel_tool_calls says). A message to another recipient
(a built-in tool, container.exec) is dropped; a stray `<|channel|>commentary to=assistant`
before a header is skipped.
"""

from __future__ import annotations

import re

from speculative.chat.format import Format, Syntax, ToolGrammar
from speculative.chat.formats._blocks import read_arguments
from speculative.chat.formats._common import (Incomplete, Reader, Rules, alternatives, finish, format_literal,
                                              function_name, selected)
from speculative.chat.message import ChatMessage

START, MESSAGE, END = "<|start|>assistant", "<|message|>", "<|end|>"
BODY_ENDS = (END, "<|call|>", "<|return|>")
FUNCTIONS = "functions."
_CHANNEL = re.compile(r"<\|channel\|>([A-Za-z]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")

# llama.cpp's triggers: a recipient right after the prompt's or a later message's start, in the
# role (" to=...") or in the channel's header ("<|channel|>commentary to=...")
TRIGGERS = (r"^\s+to$",
            r"^<\|channel\|>(?:commentary|analysis)\s+to=functions$",
            r"<\|start\|>assistant(\s+to)",
            r"<\|start\|>assistant(<\|channel\|>(?:commentary|analysis)\s+to)")


class GptOss(Format):
    name = "gpt_oss"
    think = ("<|channel|>analysis<|message|>", END)

    @classmethod
    def matches(cls, source: str) -> bool:
        return "<|channel|>" in source

    def parse(self, text: str, partial: bool, syntax: Syntax) -> ChatMessage:
        message, reader = ChatMessage(), Reader(text)
        if not partial and MESSAGE not in text:
            return ChatMessage(content=text)  # no harmony at all: the text as it is
        while _read_message(reader, partial, syntax, message):
            try:
                if not reader.literal(START):
                    break
            except Incomplete:
                break
        return message

    def grammar(self, tools: list[dict], choice: str | dict, parallel: bool) -> ToolGrammar | None:
        chosen = selected(tools, choice)
        if chosen is None:
            return None
        rules = Rules()
        channel = rules.add("channel", '"<|channel|>" ("commentary" | "analysis")')
        constraint = rules.add("constraint", 'space "<|constrain|>"? [A-Za-z0-9_-]+')
        bodies = []
        for tool in chosen:
            name = function_name(tool)
            recipient, args = format_literal(f" to={FUNCTIONS}{name}"), rules.arguments(tool)
            in_role = f'{recipient} {channel} {constraint}? "{MESSAGE}" {args}'
            in_channel = f'{channel} {recipient} {constraint}? "{MESSAGE}" {args}'
            bodies.append(rules.add(f"tool-{name}", f"{in_role} | {in_channel}"))
        grammar = finish(rules, alternatives(bodies), choice, ())
        return ToolGrammar(grammar.gbnf, TRIGGERS if choice == "auto" else ())


def _read_message(reader: Reader, partial: bool, syntax: Syntax, message: ChatMessage) -> bool:
    """Read one message (header, <|message|>, body) into `message`: whether it ended with
    <|end|> and another may follow."""
    start = reader.pos
    header, marker = reader.until((MESSAGE,), partial=False)
    if marker is None:  # the header is unfinished
        return False
    reader.pos += len(MESSAGE)
    recipients = [r for r in _RECIPIENT.findall(header) if r != "assistant"]
    channels = _CHANNEL.findall(header)
    if recipients and recipients[0].startswith(FUNCTIONS) and syntax.tools:
        message.tool_calls.append(read_arguments(reader, recipients[0][len(FUNCTIONS):])[0])
        return False  # a call ends the answer
    body, end = reader.until(BODY_ENDS, partial)
    if recipients:
        pass  # to a built-in tool, or to a function without tools: not the user's
    elif channels[-1:] == ["analysis"] and syntax.extract_reasoning:
        message.reasoning_content += body
    elif channels[-1:] == ["analysis"]:
        message.content += reader.text[start:reader.pos] + (end or "")
    else:
        message.content += body
    if end is None:
        return False
    reader.pos += len(end)
    return end == END and channels[-1:] != ["final"]


FORMAT = GptOss
