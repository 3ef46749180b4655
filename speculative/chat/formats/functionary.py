"""MeetKai's Functionary v3.2: every message names its recipient, `all` for the user, a tool's
name for a call, after `>>>`; the prompt ends with the first `>>>`:

    all
    Let me look.>>>get_weather
    {"city": "Paris"}>>>get_time
    {"city": "Paris"}

as the pinned llama.cpp reads it (common/parsers/functionary-v3-2.cpp), recipients separated
by `>>>` as the template writes them. Without tools the text after `all\\n` is the content.

The grammar starts at a call's recipient, where a call comes first (right after the prompt's
`>>>`) or after `>>>` (llama.cpp's lazy trigger, `>>>(?!all)`, fires only for a call after
content: its grammar would never see the first).
"""

from __future__ import annotations

from speculative.chat.format import Format, Syntax, ToolGrammar
from speculative.chat.formats._blocks import read_arguments
from speculative.chat.formats._common import (Reader, Rules, alternatives, finish, format_literal, function_name,
                                              repeated, selected, word_pattern)
from speculative.chat.message import ChatMessage

SEPARATOR = ">>>"
ALL = "all\n"


class Functionary(Format):
    name = "functionary"
    think = None

    @classmethod
    def matches(cls, source: str) -> bool:
        return ">>>all" in source and ">>>${recipient}" in source

    def parse(self, text: str, partial: bool, syntax: Syntax) -> ChatMessage:
        if not syntax.tools:
            if text.startswith(ALL):
                return ChatMessage(content=text[len(ALL):])
            return ChatMessage(content="" if partial and ALL.startswith(text) else text)
        message, reader = ChatMessage(), Reader(text)
        while not reader.at_end and _message(reader, partial, message):
            pass
        return message

    def grammar(self, tools: list[dict], choice: str | dict, parallel: bool) -> ToolGrammar | None:
        chosen = selected(tools, choice)
        if chosen is None:
            return None
        rules = Rules()
        bodies = []
        for tool in chosen:
            opening = format_literal(function_name(tool) + "\n")
            bodies.append(rules.add(f"tool-{function_name(tool)}", f"{opening} {rules.arguments(tool)}"))
        tool_call = rules.add("tool-call", alternatives(bodies))
        grammar = finish(rules, repeated(tool_call, parallel, f'"{SEPARATOR}"'), choice, ())
        if choice != "auto":
            return grammar
        names = "|".join(word_pattern(function_name(t)) for t in chosen)
        return ToolGrammar(grammar.gbnf, (f"(?:^|{SEPARATOR})((?:{names})\\n)",))


def _message(reader: Reader, partial: bool, message: ChatMessage) -> bool:
    """Read one message (a recipient line and what follows) into `message`: whether another
    one follows (`>>>` read)."""
    recipient, newline = reader.until(("\n",), partial=False)
    if newline is None:  # the recipient is unfinished
        if not partial:
            message.content += recipient
        return False
    reader.pos += 1
    if recipient == "all":
        content, separator = reader.until((SEPARATOR,), partial)
        message.content += content
    else:
        found, complete = read_arguments(reader, recipient)
        message.tool_calls.append(found)
        if not complete:
            return False
        _, separator = reader.until((SEPARATOR,), partial)  # text after a call is dropped
    if separator is None:
        return False
    reader.pos += len(SEPARATOR)
    return True


FORMAT = Functionary
