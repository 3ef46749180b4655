"""Qwen3-Coder's XML tool calls, also written by Qwen3.5, Nemotron 3 Nano and StepFun-3.5-Flash,
as the pinned llama.cpp reads them (common/parsers/qwen3-coder.cpp):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value is typed by its parameter's schema (Syntax.parameters): a string parameter's value is
the text as written; a value of any other type is JSON; where the schema allows a string and
other types, JSON of those types when the value reads as such, the text otherwise. The arguments
are reported as compact JSON ({"city":"Paris"}), growing value by value. Reasoning (Qwen3.5,
Nemotron, StepFun) is in <think>, which a <tool_call> also ends. Qwen3-Coder may leave out the
first <tool_call>: a call may start at <function=NAME> (a trigger too).
"""

from __future__ import annotations

import json

from speculative.chat.format import Format, Syntax, ToolGrammar
from speculative.chat.formats._common import (SPACE, Incomplete, NotJson, Reader, Rules, alternatives, call,
                                              finish, format_literal, function_name, parse_message,
                                              properties, selected, until_including)
from speculative.chat.message import ChatMessage, ToolCall
from speculative.errors import GrammarError
from speculative.grammar.json_schema import Property, object_properties

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
ARG_END = "\n</parameter>\n"  # what ends a value, as the template writes it
ALL_TYPES = frozenset({"null", "boolean", "integer", "number", "string", "array", "object"})


class Qwen3Coder(Format):
    name = "qwen3_coder"

    @classmethod
    def matches(cls, source: str) -> bool:
        return (OPEN in source and FUNCTION in source and PARAMETER in source
                # a template writing <tool_call><function=...> with no newline is another family's
                and "'<tool_call><function=' ~ tool_call.name ~ '>'" not in source)

    def parse(self, text: str, partial: bool, syntax: Syntax) -> ChatMessage:
        types = _types(syntax.parameters) if syntax.tools else None
        starts = (OPEN, *(f"{FUNCTION}{name}>" for name in types)) if types is not None else (OPEN, FUNCTION)
        return parse_message(text, partial, syntax, self.think, starts, lambda r: _read_call(r, types, partial),
                             also_ends=(OPEN,))

    def grammar(self, tools: list[dict], choice: str | dict, parallel: bool) -> ToolGrammar | None:
        chosen = selected(tools, choice)
        if chosen is None:
            return None
        rules = Rules()
        body = rules.add("tool-choice", alternatives([_tool_rule(rules, t) for t in chosen]))
        first = rules.add("tool-call-first", f'"{OPEN}\\n"? {body} "{CLOSE}" space')
        root = first
        if parallel:
            later = rules.add("tool-call", f'"{OPEN}\\n" {body} "{CLOSE}" space')
            root = f"{first} {later}*"
        starts = (OPEN, *(f"{FUNCTION}{function_name(t)}>" for t in chosen))
        return finish(rules, root, choice, starts)


def _types(parameters: dict[str, object] | None) -> dict[str, dict[str, frozenset[str]]] | None:
    """Each tool's argument types by name (None: no schemas; a schema that does not read: its
    values are typed as they read)."""
    if parameters is None:
        return None
    found = {}
    for name, schema in parameters.items():
        try:
            found[name] = {p.name: p.types for p in object_properties(schema or {"type": "object"})}
        except GrammarError:  # the grammar refused it; read its values as they are
            found[name] = {}
    return found


def _read_call(reader: Reader, types: dict | None, partial: bool) -> tuple[ToolCall | None, bool]:
    """[<tool_call>] <function=NAME> <parameter=KEY>VALUE</parameter>... </function> </tool_call>."""
    try:
        if reader.literal(OPEN):
            reader.space()
        if not reader.literal(FUNCTION):
            raise ValueError("not a function")
        name, marker = reader.until((">", "\n", "<"), partial=False)
    except Incomplete:
        return None, False  # the opening is still being written
    if marker is None:
        return None, False  # the name is still being written
    if marker != ">" or not name.strip():
        raise ValueError("not a function name")
    reader.pos += 1
    args = _Arguments((types or {}).get(name.strip()), types is not None)
    try:
        _newline(reader)
        closed = _read_arguments(reader, args, partial)
    except (Incomplete, ValueError):  # named, the call stays as read: a stream has shown it
        return call(name.strip(), args.text, False), False
    found = call(name.strip(), args.text, closed)
    if not closed:
        return found, False
    try:
        reader.space()
        return found, reader.literal(CLOSE)
    except Incomplete:
        return found, False


def _newline(reader: Reader) -> None:
    if reader.at_end:
        raise Incomplete()
    if reader.text[reader.pos] == "\n":
        reader.pos += 1


class _Arguments:
    """The arguments' JSON as llama.cpp's mapper builds it from the tags: `{"key":value,...`,
    closed by call() once the function closes."""

    def __init__(self, types: dict[str, frozenset[str]] | None, typed: bool):
        self.types, self.typed, self.text = types or {}, typed, ""

    def key(self, key: str) -> frozenset[str]:
        self.text += ("," if self.text else "{") + json.dumps(key, ensure_ascii=False) + ":"
        return self.types.get(key, ALL_TYPES) if self.typed else ALL_TYPES


def _read_arguments(reader: Reader, args: _Arguments, partial: bool) -> bool:
    """Each <parameter=KEY>VALUE</parameter> up to </function>: True at </function>, False where
    the text goes on otherwise (the call stays as read); Incomplete where it ends."""
    while True:
        reader.space()
        if reader.literal(FUNCTION_END):
            return True
        if not reader.literal(PARAMETER):
            return False
        key, marker = reader.until((">", "\n"), partial=False)
        if marker is None:
            raise Incomplete()
        if marker != ">":
            return False
        reader.pos += 1
        types = args.key(key.strip(SPACE))
        _newline(reader)
        if not _read_value(reader, args, types, partial):
            return False


def _read_value(reader: Reader, args: _Arguments, types: frozenset[str], partial: bool) -> bool:
    """The value up to </parameter>, typed by `types` as qwen3-coder.cpp types it, added to
    `args`: JSON where the schema has no string; the text where it has only strings; where it
    has both, JSON of the other types when the value reads as such (undecided while the text
    ends inside it), the text otherwise. False where the parameter does not close."""
    if "string" not in types:
        return _read_json_value(reader, args)
    if types != {"string"}:
        start = reader.pos
        try:
            value = reader.json_value()
            if _json_of(value, types) and _parameter_end(reader):
                args.text += value
                return True
        except NotJson:
            pass
        except Incomplete:
            if partial:
                raise
        reader.pos = start
    return _read_string_value(reader, args, partial)


def _json_of(value: str, types: frozenset[str]) -> bool:
    """Whether the JSON `value` is of one of `types` (an integer is a number too)."""
    kind = type(json.loads(value))
    name = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}[kind]
    return name in types or (name == "integer" and "number" in types)


def _read_json_value(reader: Reader, args: _Arguments) -> bool:
    """A JSON value, then </parameter>: added to `args` (its prefix where the text ends inside
    it, or where it stops being JSON). False where the parameter does not close after it."""
    try:
        value = reader.json_value()
    except (Incomplete, NotJson) as e:
        args.text += e.text
        raise
    args.text += value
    return _parameter_end(reader)


def _parameter_end(reader: Reader) -> bool:
    """</parameter> next (after whitespace), read with the newline after it."""
    reader.space()
    if not reader.literal(PARAMETER_END):
        return False
    if reader.rest[:1] == "\n":
        reader.pos += 1
    return True


def _read_string_value(reader: Reader, args: _Arguments, partial: bool) -> bool:
    value, marker = reader.until(("\n" + PARAMETER_END, PARAMETER_END), partial)
    args.text += '"' + json.dumps(value, ensure_ascii=False)[1:-1]
    if marker is None:
        raise Incomplete()
    reader.pos += len(marker)
    if reader.rest[:1] == "\n":
        reader.pos += 1
    args.text += '"'
    return True


def _tool_rule(rules: Rules, tool: dict) -> str:
    """tool-NAME ::= "<function=NAME>\\n" required arguments (in any order) optional ones
    "</function>\\n", as qwen3-coder.cpp writes it."""
    name = function_name(tool)
    required, optional = [], []
    for prop in properties(tool):
        (required if prop.required else optional).append(_argument_rule(rules, tool, prop))
    parts = [format_literal(f"{FUNCTION}{name}>\n")]
    if required:
        parts.append(_permute(rules, f"tool-{name}-args", required))
    if optional:
        parts.append(f"({alternatives(optional)})*")
    parts.append(format_literal(f"{FUNCTION_END}\n"))
    return rules.add(f"tool-{name}", " ".join(parts))


def _argument_rule(rules: Rules, tool: dict, prop: Property) -> str:
    name = function_name(tool)
    opening = format_literal(f"{PARAMETER}{prop.name}>\n")
    if "string" in prop.types:
        value = until_including(rules, "xml-arg-string", ARG_END)
    else:
        value = f"{rules.argument(tool, prop.name)} {format_literal(ARG_END)}"
    return rules.add(f"tool-{name}-arg-{prop.name}", f"{opening} {value}")


def _permute(rules: Rules, prefix: str, items: list[str]) -> str:
    """Every item once, in any order (llama.cpp's permute, up to 6 items; in order beyond)."""
    if len(items) <= 1 or len(items) > 6:
        return " ".join(items)
    named: dict[int, str] = {0: ""}

    def remaining(mask: int) -> str:
        if mask not in named:
            alts = [f"{items[i]} {remaining(mask & ~(1 << i))}".strip() for i in range(len(items)) if mask & 1 << i]
            named[mask] = rules.add(f"{prefix}-{mask}", " | ".join(alts))
        return named[mask]

    return remaining((1 << len(items)) - 1)


FORMAT = Qwen3Coder
