"""Mistral's tool calls after [TOOL_CALLS], in each form the pinned llama.cpp reads:

    [TOOL_CALLS][{"name": "f", "arguments": {...}, "id": "a1b2c3d4e"}]    Mistral Nemo
    [TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{...}                            Mistral Small 3.2
    [TOOL_CALLS]f[ARGS]{...}                                              Devstral, Ministral 3

with Ministral 3 / Magistral's reasoning in [THINK]...[/THINK] (common/parsers/ministral3.cpp;
the others through the differential autoparser). Parallel calls repeat [TOOL_CALLS] (or fill
Nemo's array). The format object does not see the template, so every form is read, and the
grammar offers each: the model writes the one it was trained on. A call id is nine letters
and digits (Mistral's tokenizer checks that).
"""

from __future__ import annotations

import re

from speculative.chat.format import Format, Syntax, ToolGrammar
from speculative.chat.formats._common import (Incomplete, NotJson, Reader, Rules, alternatives, call, finish,
                                              format_literal, function_name, json_call_rule,
                                              parse_message, read_json_call, selected)
from speculative.chat.message import ChatMessage, ToolCall

TOOL_CALLS, CALL_ID, ARGS = "[TOOL_CALLS]", "[CALL_ID]", "[ARGS]"
_NAME = re.compile(r"[^\[\s]*")  # a function's name or a call's id: up to the next tag


class Mistral(Format):
    name = "mistral"
    think = ("[THINK]", "[/THINK]")

    @classmethod
    def matches(cls, source: str) -> bool:
        return TOOL_CALLS in source

    def parse(self, text: str, partial: bool, syntax: Syntax) -> ChatMessage:
        names = set(syntax.parameters) if syntax.parameters is not None else None
        return parse_message(text, partial, syntax, self.think, (TOOL_CALLS,), lambda r: _read_calls(r, names))

    def grammar(self, tools: list[dict], choice: str | dict, parallel: bool) -> ToolGrammar | None:
        chosen = selected(tools, choice)
        if chosen is None:
            return None
        rules = Rules()
        call_id = rules.add("call-id", "[a-zA-Z0-9]{9}")
        tagged = rules.add("tool-call-tagged", alternatives([_tagged_rule(rules, t, call_id) for t in chosen]))
        id_field = f'(space "," space "\\"id\\"" space ":" space "\\"" {call_id} "\\"")?'
        in_array = rules.add("tool-call-object", alternatives(
            [json_call_rule(rules, t, [("name", "NAME"), ("arguments", "ARGS")], suffix=id_field) for t in chosen]))
        if parallel:
            tagged_calls = f'{tagged} ("{TOOL_CALLS}" {tagged})*'
            array = f'"[" space {in_array} (space "," space {in_array})* space "]"'
        else:
            tagged_calls, array = tagged, f'"[" space {in_array} space "]"'
        root = f'"{TOOL_CALLS}" ({tagged_calls} | {array})'
        return finish(rules, root, choice, (TOOL_CALLS,))


def _tagged_rule(rules: Rules, tool: dict, call_id: str) -> str:
    """NAME[CALL_ID]id[ARGS]{...}, the id optional (Small 3.2 writes it, Devstral does not)."""
    name = function_name(tool)
    body = f'{format_literal(name)} ("{CALL_ID}" {call_id})? "{ARGS}" {rules.arguments(tool)}'
    return rules.add(f"tool-{name}-tagged", body)


def _read_calls(reader: Reader, names: set[str] | None) -> tuple[ToolCall | list[ToolCall] | None, bool]:
    """The call (or Nemo's array of calls) after one [TOOL_CALLS]."""
    reader.literal(TOOL_CALLS)
    try:
        reader.space()
        if reader.literal("["):
            return _read_array(reader, names)
        return _read_tagged(reader, names)
    except Incomplete:
        return None, False


def _read_tagged(reader: Reader, names: set[str] | None) -> tuple[ToolCall | None, bool]:
    """NAME[CALL_ID]id[ARGS]{...}: the call appears once [ARGS] is read (name and id known)."""
    name = _NAME.match(reader.text, reader.pos).group()
    reader.pos += len(name)
    if reader.at_end:
        return None, False
    if not name or (names is not None and name not in names):
        raise ValueError("not a tool call")
    call_id = ""
    if reader.literal(CALL_ID):
        call_id = _NAME.match(reader.text, reader.pos).group()
        reader.pos += len(call_id)
    if not reader.literal(ARGS):
        raise ValueError("not a tool call")
    reader.space()
    if reader.rest[:1] not in ("{", ""):
        raise ValueError("the arguments are not a JSON object")
    try:
        return call(name, reader.json_value(), True, call_id), True
    except (Incomplete, NotJson) as e:  # named, the call stays as read
        return call(name, e.text, False, call_id), False


def _read_array(reader: Reader, names: set[str] | None) -> tuple[list[ToolCall], bool]:
    """[{"name": ..., "arguments": {...}, "id": ...}, ...]: the calls so far."""
    calls: list[ToolCall] = []
    while True:
        reader.space()
        try:
            found = read_json_call(reader, "name", "arguments", id_key="id", names=names)
        except ValueError:
            if not calls:
                raise
            return calls, False  # the calls before it stay: a stream has shown them
        if found.name:
            calls.append(found.tool_call())
        if not found.complete:
            return calls, False
        try:
            reader.space()
            if reader.literal("]"):
                return calls, True
            if not reader.literal(","):
                return calls, False
        except Incomplete:
            return calls, False


FORMAT = Mistral
