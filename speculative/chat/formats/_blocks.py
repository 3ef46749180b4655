"""Calls that come in blocks: one opening marker, then several calls, then (mostly) a closing
marker, as DeepSeek's <｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜> and DSML
<｜DSML｜function_calls>...</｜DSML｜function_calls>, Granite 3's <|tool_call|>[...] and
Command R7B's <|START_ACTION|>[...]<|END_ACTION|> write them: _common.split_calls reads the
text, with a block reader from here that returns the calls of each block.

  read_calls_until(reader, opening, closing, read_call)   calls each after `opening`, up to `closing`
  read_call_array(reader, keys)                           [ {call}, {call} ] as JSON objects
  read_arguments(reader, name)                            a call's JSON object of arguments
  call_array_rule(rules, tools, fields, parallel)         the grammar of such an array
"""

from __future__ import annotations

from typing import Callable

from speculative.chat.formats._common import (Incomplete, NotJson, Reader, Rules, alternatives, call,
                                              json_call_rule, read_json_call, repeated)
from speculative.chat.message import ToolCall

ReadCall = Callable[[Reader], "tuple[ToolCall | None, bool]"]


def read_calls_until(reader: Reader, opening: str, closing: str, read_call: ReadCall) -> tuple[list[ToolCall], bool]:
    """Calls up to `closing`, each after `opening` and read by `read_call` (the call, None while
    its name is unfinished; whether it closed), whitespace around them skipped: the named calls
    and whether `closing` came. ValueError where something else stands before any call was
    read; after one, the calls so far (the block left open: a stream has shown them)."""
    calls: list[ToolCall] = []
    try:
        while True:
            reader.space()
            if reader.literal(closing):
                return calls, True
            if not reader.literal(opening):
                raise ValueError(f"expected {opening!r} or {closing!r}")
            found, closed = read_call(reader)
            if found is None:
                return calls, False
            calls.append(found)
            if not closed:
                return calls, False
    except Incomplete:
        return calls, False
    except ValueError:
        if not calls:
            raise
        return calls, False


def read_call_array(reader: Reader, name_key: str, args_key: str, id_key: str = "") -> tuple[list[ToolCall], bool]:
    """The calls in the JSON array at the reader, each an object with `name_key`, `args_key`
    (and `id_key`) as _common.read_json_call reads it: the named calls so far and whether the
    array closed (read_calls_until; ValueError where no array of calls starts here)."""
    def element(reader: Reader) -> tuple[ToolCall | None, bool]:
        if reader.literal(","):  # between elements (leniently, also before the first)
            reader.space()
        found = read_json_call(reader, name_key, args_key, id_key)
        return (found.tool_call(), found.complete) if found.name else (None, False)

    try:
        if not reader.literal("["):
            raise ValueError("not a JSON array of calls")
    except Incomplete:
        return [], False
    return read_calls_until(reader, "", "]", element)


def read_arguments(reader: Reader, name: str) -> tuple[ToolCall, bool]:
    """The call to `name` whose arguments, a JSON object, start at the reader (after whitespace):
    the call as far as they are written, and whether they closed. Where they are no JSON object
    the call stays as read, its arguments "{" (a stream has shown it), and reading stops."""
    reader.space()
    if reader.rest[:1] not in ("{", ""):
        return call(name, "", False), False
    try:
        return call(name, reader.json_value(), True), True
    except (Incomplete, NotJson) as e:
        return call(name, e.text, False), False


def call_array_rule(rules: Rules, tools: list[dict], fields: list[tuple[str, str]], parallel: bool) -> str:
    """The rule of a JSON array of call objects (_common.json_call_rule's `fields`): one call,
    or with `parallel` one or more, comma-separated as llama.cpp's standard_json_tools spaces
    them."""
    call = rules.add("tool-call-body", alternatives([json_call_rule(rules, t, fields) for t in tools]))
    calls = repeated(call, parallel, 'space "," space')
    return rules.add("tool-call-array", f'"[" space {calls} space "]"')
