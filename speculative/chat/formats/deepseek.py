"""DeepSeek's tool calls, reasoning in <think>. Three forms, one family (the grammar allows each,
a model writes its own):

  R1 and its distills (the prompt opens <think>):
    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
  V3.1:
    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>
  V3.2 (DSML; V4 names the block tool_calls), where a call also ends the reasoning:
    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

The pinned llama.cpp reads R1 and V3.1 with its autoparser (chat-diff-analyzer.cpp's
"DeepSeek-R1-Distill-Qwen" patch for R1) and V3.2/V4 with common/parsers/deepseek.cpp: a DSML
parameter with string="true" is the text as written, any other is JSON. Where DSML's calls end
the reasoning in llama.cpp, <｜tool▁calls▁begin｜> ends it here too: a call a grammar forces from
the first token (tool_choice required) after a prompt that opened <think> is read as a call.
"""

from __future__ import annotations

import json
import re

from speculative.chat.format import Format, Syntax, ToolGrammar
from speculative.chat.formats._blocks import read_arguments, read_calls_until
from speculative.chat.formats._common import (Incomplete, Reader, Rules, alternatives, call, finish,
                                              format_literal, function_name, properties, repeated, selected,
                                              split_calls, split_reasoning, until_including)
from speculative.chat.message import ChatMessage, ToolCall

CALLS, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
R1_TYPE = "function" + SEP  # R1 writes the call's type before its name
DSML = "｜DSML｜"
DSML_BLOCKS = {f"<{DSML}function_calls>": f"</{DSML}function_calls>",  # V3.2
               f"<{DSML}tool_calls>": f"</{DSML}tool_calls>"}          # V4
INVOKE, INVOKE_END = f"<{DSML}invoke", f"</{DSML}invoke>"
PARAMETER, PARAMETER_END = f"<{DSML}parameter", f"</{DSML}parameter>"
_INVOKE_HEADER = re.compile(r'\s+name="([^"]*)"\s*')
_PARAMETER_HEADER = re.compile(r'\s+name="([^"]*)"\s+string="(true|false)"\s*')


class DeepSeek(Format):
    name = "deepseek"

    @classmethod
    def matches(cls, source: str) -> bool:
        dsml = "dsml_token" in source and "DSML" in source and ("function_calls" in source or "tool_calls" in source)
        return dsml or CALLS in source

    def parse(self, text: str, partial: bool, syntax: Syntax) -> ChatMessage:
        reasoning, rest = split_reasoning(text, partial, syntax, self.think, (CALLS, *DSML_BLOCKS))
        if not syntax.tools:
            return ChatMessage(content=rest, reasoning_content=reasoning)
        content, calls = split_calls(rest, partial, (CALLS, *DSML_BLOCKS), lambda r: _read_block(r, partial))
        return ChatMessage(content=content, reasoning_content=reasoning, tool_calls=calls)

    def grammar(self, tools: list[dict], choice: str | dict, parallel: bool) -> ToolGrammar | None:
        chosen = selected(tools, choice)
        if chosen is None:
            return None
        rules = Rules()
        calls = rules.add("tool-call", alternatives([_call_rule(rules, t) for t in chosen]))
        between = '"\\n"?'  # the templates write a newline between calls
        blocks = [rules.add("tool-calls", f'"{CALLS}" {repeated(calls, parallel, between)} "{CALLS_END}"')]
        invokes = rules.add("dsml-invoke", alternatives([_invoke_rule(rules, t) for t in chosen]))
        for opening, closing in DSML_BLOCKS.items():
            blocks.append(f'"{opening}" space {repeated(invokes, parallel)} space "{closing}"')
        return finish(rules, alternatives(blocks), choice, (CALLS, *DSML_BLOCKS))


# ---- reading -------------------------------------------------------------------------------

def _read_block(reader: Reader, partial: bool) -> tuple[list[ToolCall], bool]:
    """The block of calls at the reader (either form): its named calls and whether it closed."""
    if reader.rest.startswith(CALLS):
        reader.pos += len(CALLS)
        return _read_calls(reader)
    opening = next(o for o in DSML_BLOCKS if reader.rest.startswith(o))
    reader.pos += len(opening)
    return _read_invokes(reader, DSML_BLOCKS[opening], partial)


def _read_calls(reader: Reader) -> tuple[list[ToolCall], bool]:
    """<｜tool▁call▁begin｜>...<｜tool▁call▁end｜> (R1's or V3.1's), then <｜tool▁calls▁end｜>."""
    return read_calls_until(reader, CALL, CALLS_END, _read_call)


def _read_call(reader: Reader) -> tuple[ToolCall | None, bool]:
    """One call after <｜tool▁call▁begin｜>: None while its name is unfinished."""
    r1 = reader.rest.startswith(R1_TYPE)
    if r1:
        after = reader.rest[len(R1_TYPE):len(R1_TYPE) + 1]
        if not after:
            return None, False  # which form it is shows with the next character
        r1 = after != "{"  # V3.1 calling a tool named "function"
        reader.pos += len(R1_TYPE) if r1 else 0
    name, marker = reader.until(("\n",) if r1 else (SEP,), partial=False)
    if marker is None:
        return None, False
    reader.pos += len(marker)
    try:
        reader.space()
        fenced = not r1 or reader.literal("```json")
    except Incomplete:
        fenced = False
    if not fenced:  # a named call stays (a stream has shown it)
        return call(name, "", False), False
    found, complete = read_arguments(reader, name)
    return found, complete and _call_end(reader, r1)


def _call_end(reader: Reader, r1: bool) -> bool:
    """Whether the call's closing marker (after R1's closing fence) follows."""
    try:
        reader.space()
        if r1 and not reader.literal("```"):
            return False
        reader.space()
        return reader.literal(CALL_END)
    except Incomplete:
        return False


def _read_invokes(reader: Reader, closing: str, partial: bool) -> tuple[list[ToolCall], bool]:
    """DSML invokes up to the block's closing tag."""
    return read_calls_until(reader, INVOKE, closing, lambda r: _read_invoke(r, partial))


def _header(reader: Reader, pattern: re.Pattern) -> re.Match | None:
    """The attributes up to the tag's `>` (None while unfinished); ValueError where they are
    not the tag's."""
    attributes, marker = reader.until((">",), partial=False)
    if marker is None:
        return None
    found = pattern.fullmatch(attributes)
    if not found:
        raise ValueError(f"unexpected attributes {attributes[:40]!r}")
    reader.pos += 1
    return found


def _read_invoke(reader: Reader, partial: bool) -> tuple[ToolCall | None, bool]:
    """One invoke after `<｜DSML｜invoke`: its call (arguments as JSON, growing parameter by
    parameter; None while the name is unfinished) and whether it closed."""
    header = _header(reader, _INVOKE_HEADER)
    if header is None:
        return None, False
    name, arguments = header.group(1), "{"
    try:
        while True:
            reader.space()
            if reader.literal(INVOKE_END):
                return call(name, arguments + "}", True), True
            if not reader.literal(PARAMETER):
                raise ValueError("expected a parameter")
            attributes = _header(reader, _PARAMETER_HEADER)
            if attributes is None:
                return call(name, arguments, False), False
            key, is_string = attributes.group(1), attributes.group(2) == "true"
            arguments += ("" if arguments == "{" else ", ") + json.dumps(key, ensure_ascii=False) + ": "
            value, closed = _read_value(reader, is_string, partial)
            arguments += value
            if not closed:
                return call(name, arguments, False), False
    except Incomplete:
        return call(name, arguments, False), False
    except ValueError:
        return call(name, arguments, False), False


def _read_value(reader: Reader, is_string: bool, partial: bool) -> tuple[str, bool]:
    """A parameter's value up to </｜DSML｜parameter> as JSON text (a string's so far without its
    closing quote), and whether it closed."""
    value, marker = reader.until((PARAMETER_END,), partial)
    if marker is not None:
        reader.pos += len(marker)
    if is_string:
        text = json.dumps(value, ensure_ascii=False)
        return (text, True) if marker else (text[:-1], False)
    return value.strip(), marker is not None


# ---- constraining --------------------------------------------------------------------------

def _call_rule(rules: Rules, tool: dict) -> str:
    """One call in R1's form or V3.1's."""
    name, args = function_name(tool), rules.arguments(tool)
    r1 = f'"{CALL}{R1_TYPE}" {format_literal(name)} "\\n```json\\n" {args} space "```" "{CALL_END}"'
    v31 = f'"{CALL}" {format_literal(name)} "{SEP}" {args} "{CALL_END}"'
    return rules.add(f"tool-{name}", f"{r1} | {v31}")


def _invoke_rule(rules: Rules, tool: dict) -> str:
    """A DSML invoke: the required parameters in order, then optional ones, as deepseek.cpp
    writes them."""
    name = function_name(tool)
    required, optional = [], []
    for prop in properties(tool):
        is_string = "string" in prop.types
        opening = format_literal(f'{PARAMETER} name="{prop.name}" string="{str(is_string).lower()}">')
        if is_string:
            value = until_including(rules, "dsml-string", PARAMETER_END)
        else:
            value = f'{rules.argument(tool, prop.name)} "{PARAMETER_END}"'
        rule = rules.add(f"tool-{name}-arg-{prop.name}", f"{opening} {value}")
        (required if prop.required else optional).append(rule)
    body = " space ".join(required)
    if optional:
        body += f" (space ({alternatives(optional)}))*"
    opening = format_literal(f'{INVOKE} name="{name}">\n')
    return rules.add(f"dsml-{name}", f'{opening} {body} space "{INVOKE_END}"'.replace("  ", " "))


FORMAT = DeepSeek
